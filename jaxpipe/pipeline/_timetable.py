"""What a schedule is, read off its plan: its facts, and its timetable unrolled over steps.

A schedule is data (`_plan`: a `StepPlan` names every (tick, stage)
decision of a step; `_builders`: each schedule's plan). `facts` gives what
the rest of the project needs to know about a schedule (the fewest
microbatches, ticks, the bubble, versions, stash slots), computed from those
arrays; `timetable` unrolls the plan over steps into the cells that
`tools/schedule_viz.py` draws and the tests check. The plan's names are
importable from here too. Pure Python and NumPy.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from jaxpipe.pipeline._builders import (check_virtual_stages, layer_order, min_microbatches,
                                        stash_slots, step_plan)
from jaxpipe.pipeline._names import SCHEDULE_NAMES
from jaxpipe.pipeline._plan import (BACKWARD_COST, FORWARD_COST, INPUT_GRAD_COST,
                                    WEIGHT_GRAD_COST, StepPlan, TickKind)

__all__ = ["StepPlan", "TickKind", "Facts", "Cell", "Timetable",
           "step_plan", "facts", "timetable", "min_microbatches", "stash_slots",
           "FORWARD_COST", "BACKWARD_COST", "INPUT_GRAD_COST", "WEIGHT_GRAD_COST",
           "layer_order", "check_virtual_stages"]


@dataclasses.dataclass(frozen=True)
class Facts:
  """What the project needs to know of a schedule for S stages and M microbatches.

  Attributes:
    schedule, num_stages, num_microbatches: as given.
    min_microbatches: the fewest microbatches it accepts.
    ticks: ticks per step (0 for none).
    step_cost: a step's duration in units of one stage's forward (1) and
      backward (2) on one microbatch; `none` runs all S stages' work itself.
    bubble: share of stage time idle in a steady-state step (the fill of
      2bw's first step is not steady state).
    versions: weight versions each stage keeps.
    stash_slots: stash slots each stage keeps.
    gradient_delay: the gradient delay, in words.
    flushes: whether every step drains the pipeline.
    virtual_stages: v, the chunks of blocks each device holds.
    transfers: activations a step sends from device to device, over the
      whole pipeline (as many cotangents come back): M(S-1), and M(vS-1)
      for interleaved, whose microbatches go around the ring v times.
  """
  schedule: str
  num_stages: int
  num_microbatches: int
  min_microbatches: int
  ticks: int
  step_cost: float
  bubble: float
  versions: int
  stash_slots: int
  gradient_delay: str
  flushes: bool
  virtual_stages: int = 1
  transfers: int = 0


def facts(schedule: str, num_stages: int, num_microbatches: int,
          virtual_stages: int = 1) -> Facts:
  """The facts of a schedule, read off its plan (raises ValueError for a bad M or v)."""
  s_, m, v = num_stages, num_microbatches, virtual_stages
  if schedule not in SCHEDULE_NAMES:
    raise ValueError(f"unknown schedule '{schedule}'; choose from {', '.join(SCHEDULE_NAMES)}")
  delay = {"none": "none (or optimizer.delay)", "gpipe": "none", "1f1b": "none",
           "2bw": "one step", "pipedream": "S-1-s steps on stage s",
           "interleaved": "none", "zb1": "none"}[schedule]
  if schedule == "none":
    check_virtual_stages(schedule, s_, m, v)
    cost = (FORWARD_COST + BACKWARD_COST) * m * s_
    return Facts(schedule, s_, m, 1, 0, cost, 0.0, 1, 0, delay, True)
  plan = step_plan(schedule, s_, m, v)
  cost = float(plan.tick_costs().sum())
  # Busy time: every microbatch's forward and backward on every stage; a 2bw
  # step in steady state runs M of each (the previous batch's last ones
  # included), as do the flushed schedules (interleaved's v chunks make one
  # stage's work; zb1's B and W together cost a backward).
  busy = (FORWARD_COST + BACKWARD_COST) * m * s_
  versions = {"gpipe": 1, "1f1b": 1, "2bw": 2, "pipedream": s_, "interleaved": 1,
              "zb1": 1}[schedule]
  # Every forward sends its output on, but the last stage's of the last chunk.
  sends = int(((plan.fwd >= 0) & (plan.fwd_chunk * s_ + np.arange(s_) < v * s_ - 1)).sum())
  return Facts(schedule, s_, m, min_microbatches(schedule, s_, v), plan.num_ticks, cost,
               1.0 - busy / (cost * s_), versions, plan.slots, delay, schedule != "2bw", v,
               sends)


@dataclasses.dataclass(frozen=True)
class Cell:
  """What one stage does in one tick: global microbatch ids, versions, stash slots.

  A weight version is the number of updates the weights have seen (v[k] ran
  batch k in 2bw; with pipedream stage s runs batch k on v[k - (S-1-s)]).
  A chunk is which of the stage's chunks of blocks the forward (backward)
  runs: 0 but in interleaved, where chunk j of stage s is the pipeline's
  virtual stage j*S + s. In zb1 `bwd` is B (the input's gradient) and `wgt`
  the microbatches whose W (the weights' gradient) the stage runs, in
  order, with `wgt_slot` their W's stash slots; empty elsewhere.
  """
  fwd: Optional[int] = None
  bwd: Optional[int] = None
  fwd_version: Optional[int] = None
  bwd_version: Optional[int] = None
  fwd_slot: Optional[int] = None
  bwd_slot: Optional[int] = None
  fwd_chunk: Optional[int] = None
  bwd_chunk: Optional[int] = None
  wgt: tuple[int, ...] = ()
  wgt_slot: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Timetable:
  """A schedule unrolled over `num_steps` steps; `cells[tick][stage]`.

  `tick_costs[t]` is tick t's duration under the cost model (1 for a
  forward, 2 for a backward, 3 for a tick with both; divided by v for
  interleaved's ticks, which run one of a stage's v chunks; for zb1's, in
  which a stage runs F, B and W's of one unit each (`split_backward`), its
  busiest stage's count).
  """
  schedule: str
  num_stages: int
  num_microbatches: int
  num_steps: int
  ticks_per_step: int
  cells: tuple[tuple[Cell, ...], ...]
  tick_costs: tuple[float, ...]
  virtual_stages: int = 1
  split_backward: bool = False

  @property
  def num_ticks(self) -> int:
    return len(self.cells)

  def idle_fraction(self, step: int) -> float:
    """Share of one step's stage time left idle (the bubble, for a steady step).

    Counted from the cells: a stage is busy FORWARD_COST for each forward
    and BACKWARD_COST for each backward it runs (1/v of that for one of
    interleaved's chunks), out of the step's duration.
    """
    lo, hi = step * self.ticks_per_step, (step + 1) * self.ticks_per_step
    b_cost = INPUT_GRAD_COST if self.split_backward else BACKWARD_COST
    busy = sum(FORWARD_COST * (c.fwd is not None) + b_cost * (c.bwd is not None)
               + WEIGHT_GRAD_COST * len(c.wgt)
               for row in self.cells[lo:hi] for c in row) / self.virtual_stages
    return 1.0 - busy / (sum(self.tick_costs[lo:hi]) * self.num_stages)

  def ascii(self) -> str:
    """Renders the timetable: a row per stage, a column per tick.

    A cell reads `F3/B1`: forward of microbatch 3 and backward of microbatch 1
    (global numbers; batch = microbatch // M); a trailing `'v` gives the
    weight version when more than one is alive, and with v > 1 chunks a
    `c` the stage's chunk (`F3c1`: microbatch 3 through the stage's second
    chunk); `.` is an idle slot, and a tick in which no stage runs a forward
    (or a backward) drops that half. A zb1 cell lists its items, as in
    `F3/B1/W0W1` (B: the input's gradient; W: the weights'), or `.`.
    """
    if self.split_backward:
      return self._ascii_split()
    many_versions = self.schedule in ("2bw", "pipedream")
    chunks = self.virtual_stages > 1

    def part(kind: str, mb: Optional[int], ver: Optional[int], chunk: Optional[int]) -> str:
      if mb is None:
        return "."
      return (f"{kind}{mb}" + (f"v{ver}" if many_versions else "")
              + (f"c{chunk}" if chunks else ""))

    cols = []
    for row in self.cells:
      any_f = any(c.fwd is not None for c in row)
      any_b = any(c.bwd is not None for c in row)
      col = []
      for c in row:
        parts = ([part("F", c.fwd, c.fwd_version, c.fwd_chunk)] if any_f or not any_b
                 else []) + ([part("B", c.bwd, c.bwd_version, c.bwd_chunk)] if any_b else [])
        col.append("/".join(parts))
      cols.append(col)
    width = max(len(x) for col in cols for x in col)
    width = max(width, len(str(self.num_ticks - 1)))
    lines = [f"{self.schedule}: S={self.num_stages} M={self.num_microbatches}"
             + (f" v={self.virtual_stages}" if chunks else "")
             + f", {self.ticks_per_step} ticks per step, {self.num_steps} steps"]
    head = "tick    " + " ".join(f"{t:>{width}}" for t in range(self.num_ticks))
    lines.append(head)
    for s in range(self.num_stages):
      lines.append(f"stage {s:<2}" + " ".join(f"{cols[t][s]:>{width}}" for t in range(self.num_ticks)))
    lines += self._idle_lines()
    return "\n".join(lines)

  def _idle_lines(self) -> list[str]:
    return [f"step {k}: idle {self.idle_fraction(k):.1%} of stage time"
            for k in range(self.num_steps)]

  def _ascii_split(self) -> str:
    """`ascii` of a zb1 timetable: a cell's F, B and W's, or `.`."""
    def item(c: Cell) -> str:
      parts = [f"{kind}{mb}" for kind, mb in (("F", c.fwd), ("B", c.bwd)) if mb is not None]
      parts += ["".join(f"W{mb}" for mb in c.wgt)] if c.wgt else []
      return "/".join(parts) or "."

    cols = [[item(c) for c in row] for row in self.cells]
    width = max(max(len(x) for col in cols for x in col), len(str(self.num_ticks - 1)))
    lines = [f"{self.schedule}: S={self.num_stages} M={self.num_microbatches}, "
             f"{self.ticks_per_step} ticks per step, {self.num_steps} steps",
             "tick    " + " ".join(f"{t:>{width}}" for t in range(self.num_ticks))]
    for s in range(self.num_stages):
      lines.append(f"stage {s:<2}" + " ".join(f"{cols[t][s]:>{width}}"
                                              for t in range(self.num_ticks)))
    return "\n".join(lines + self._idle_lines())


def timetable(schedule: str, num_stages: int, num_microbatches: int,
              num_steps: int = 2, virtual_stages: int = 1) -> Timetable:
  """Unrolls a schedule's step plan over `num_steps` steps (2bw: step 0 fills).

  Global microbatch numbers, versions and slots come from the plan's arrays:
  window index w of step k is microbatch (k-1)*M + w for 2bw (k*M + w for
  the flushed schedules), plan version i of a 2bw step k is v[k-1+i], and a
  stash slot is (base + offset) mod slots with base k*M when the plan's base
  advances. Pipedream's plan has one block version, the one the engine is
  given: stage s's v[max(0, k-(S-1-s))]. Chunks are the plan's.
  """
  s_, m = num_stages, num_microbatches
  if schedule == "none":
    check_virtual_stages(schedule, s_, m, virtual_stages)
    cells = tuple((Cell(k * m + j, k * m + j, k, k),)
                  for k in range(num_steps) for j in range(m))
    cost = FORWARD_COST + BACKWARD_COST
    return Timetable(schedule, 1, m, num_steps, m, cells, (cost,) * len(cells))
  plan = step_plan(schedule, s_, m, virtual_stages)
  first = -m if plan.history else 0

  def version(k: int, stage: int, plan_version: int) -> int:
    if schedule == "pipedream":
      return max(0, k - (s_ - 1 - stage))
    if schedule == "2bw":
      return k - 1 + plan_version
    return k

  rows = []
  for k in range(num_steps):
    base = k * m if plan.slot_base_step else 0
    for t in range(plan.num_ticks):
      row = []
      for s in range(s_):
        f, b = int(plan.fwd[t, s]), int(plan.bwd[t, s])
        ws = [(int(w), int(slot)) for w, slot in zip(plan.wgt[t, s], plan.wgt_slot[t, s])
              if w >= 0]
        fg = k * m + first + f if f >= 0 else None
        bg = k * m + first + b if b >= 0 else None
        fg = fg if fg is not None and fg >= 0 else None   # 2bw's fill: no batch -1
        bg = bg if bg is not None and bg >= 0 else None
        row.append(Cell(
            fg, bg,
            None if fg is None else version(k, s, int(plan.fwd_version[t, s])),
            None if bg is None else version(k, s, int(plan.bwd_version[t, s])),
            None if fg is None else (base + int(plan.fwd_slot[t, s])) % plan.slots,
            None if bg is None else (base + int(plan.bwd_slot[t, s])) % plan.slots,
            None if fg is None else int(plan.fwd_chunk[t, s]),
            None if bg is None else int(plan.bwd_chunk[t, s]),
            tuple(k * m + w for w, _ in ws), tuple(slot for _, slot in ws)))
      rows.append(tuple(row))
  costs = tuple(float(c) for c in plan.tick_costs()) * num_steps
  return Timetable(schedule, s_, m, num_steps, plan.num_ticks, tuple(rows), costs,
                   virtual_stages, plan.split_backward)
