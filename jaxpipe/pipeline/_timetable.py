"""Schedules as data: which microbatch each stage runs forward and backward at each tick.

A `StepPlan` is the plan of one training step, in the form the engine executes:
two integer arrays `[ticks, stages]` naming, per tick and stage, the microbatch
whose forward (and whose backward) that stage runs, or -1 for none.
Microbatches are numbered in "window" coordinates: 0..M-1 are the previous
batch, M..2M-1 the current one, so a schedule that never flushes (2bw) can
finish the previous batch's microbatches while it starts the current one's.

A `Timetable` unrolls the plan over a few steps into cells with global
microbatch numbers and weight versions: the ASCII table, the PNG of
`tools/schedule_viz.py` and the tests are all drawn from it, so what they show
is what the engine runs. Pure Python and NumPy; no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__ = ["StepPlan", "Cell", "Timetable", "step_plan", "timetable", "ticks_per_step",
           "bubble_fraction", "min_microbatches"]

PIPELINED = ("gpipe", "1f1b", "2bw", "pipedream")


def min_microbatches(schedule: str, num_stages: int) -> int:
  """The fewest microbatches per step a schedule accepts for S stages."""
  if schedule == "2bw":
    # Every backward of batch k-1 must land within step k (docs/schedules.md).
    return max(1, 2 * (num_stages - 1))
  return 1


def ticks_per_step(schedule: str, num_stages: int, num_microbatches: int) -> int:
  """Ticks (stage-parallel time slots) of one step.

  none: M microbatches on one device; gpipe: M+S-1 forward ticks then as many
  backward ticks; 1f1b and pipedream (lockstep, flushed): M+2(S-1) ticks that
  each hold a forward and a backward; 2bw: M ticks.
  """
  s, m = num_stages, num_microbatches
  return {"none": m, "gpipe": 2 * (m + s - 1), "1f1b": m + 2 * (s - 1),
          "pipedream": m + 2 * (s - 1), "2bw": m}[schedule]


def bubble_fraction(schedule: str, num_stages: int, num_microbatches: int) -> float:
  """Share of (stage, tick, forward-or-backward) slots left idle in steady state."""
  s, m = num_stages, num_microbatches
  if schedule == "none" or s == 1:
    return 0.0
  if schedule == "gpipe":
    return (s - 1) / (m + s - 1)
  if schedule in ("1f1b", "pipedream"):
    return 2 * (s - 1) / (m + 2 * (s - 1))
  if schedule == "2bw":
    return 0.0
  raise ValueError(f"unknown schedule {schedule!r}")


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """One step of a schedule, as the engine executes it.

  Attributes:
    schedule: the schedule's name.
    num_stages: S.
    num_microbatches: M.
    fwd: int32 [ticks, S]: window index (0..2M-1) of the forward each stage
      runs at each tick, or -1. Indices below M belong to the previous batch.
    bwd: int32 [ticks, S]: the same for backwards.
    backward_by_autodiff: True for gpipe, whose engine runs only the forward
      ticks and lets `jax.grad` run the backward ticks in reverse order.
  """
  schedule: str
  num_stages: int
  num_microbatches: int
  fwd: np.ndarray
  bwd: np.ndarray
  backward_by_autodiff: bool = False

  @property
  def num_ticks(self) -> int:
    return self.fwd.shape[0]


def step_plan(schedule: str, num_stages: int, num_microbatches: int) -> StepPlan:
  """Builds the per-step plan of a pipelined schedule (see module docstring)."""
  s_, m = num_stages, num_microbatches
  if schedule not in PIPELINED:
    raise ValueError(f"schedule {schedule!r} has no stage plan; choose from {PIPELINED}")
  if m < min_microbatches(schedule, s_):
    raise ValueError(f"{schedule} needs at least {min_microbatches(schedule, s_)} "
                     f"microbatches for {s_} stages, got {m}")
  stage = np.arange(s_)[None, :]
  if schedule == "2bw":
    tick = np.arange(m)[:, None]
    # Forward of microbatch t-s, backward of t-2(S-1)+s, both counted from
    # the start of this step's batch; negative ones are the previous batch's.
    fwd = m + tick - stage
    bwd = m + tick - 2 * (s_ - 1) + stage
    return StepPlan(schedule, s_, m, fwd.astype(np.int32), bwd.astype(np.int32))
  if schedule in ("1f1b", "pipedream"):
    tick = np.arange(m + 2 * (s_ - 1))[:, None]
    f, b = tick - stage, tick - 2 * (s_ - 1) + stage
    fwd = np.where((f >= 0) & (f < m), m + f, -1)
    bwd = np.where((b >= 0) & (b < m), m + b, -1)
    return StepPlan(schedule, s_, m, fwd.astype(np.int32), bwd.astype(np.int32))
  # gpipe: M+S-1 forward ticks; autodiff then runs them backwards in reverse.
  tick = np.arange(m + s_ - 1)[:, None]
  f = tick - stage
  fwd = np.where((f >= 0) & (f < m), m + f, -1)
  none = np.full_like(fwd, -1)
  return StepPlan(schedule, s_, m, np.concatenate([fwd, none]).astype(np.int32),
                  np.concatenate([none, fwd[::-1]]).astype(np.int32),
                  backward_by_autodiff=True)


@dataclasses.dataclass(frozen=True)
class Cell:
  """What one stage does in one tick: global microbatch ids and weight versions.

  A weight version is the number of updates the weights have seen (v[k] ran
  batch k in 2bw; with pipedream stage s runs batch k on v[k - (S-1-s)]).
  """
  fwd: Optional[int] = None
  bwd: Optional[int] = None
  fwd_version: Optional[int] = None
  bwd_version: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Timetable:
  """A schedule unrolled over `num_steps` steps; `cells[tick][stage]`."""
  schedule: str
  num_stages: int
  num_microbatches: int
  num_steps: int
  ticks_per_step: int
  cells: tuple[tuple[Cell, ...], ...]

  @property
  def num_ticks(self) -> int:
    return len(self.cells)

  def busy_slots(self, step: int) -> tuple[int, int]:
    """(busy, total) forward-or-backward slots of one step, over all stages."""
    rows = self.cells[step * self.ticks_per_step:(step + 1) * self.ticks_per_step]
    busy = sum((c.fwd is not None) + (c.bwd is not None) for row in rows for c in row)
    total = 2 * len(rows) * self.num_stages
    if self.schedule == "gpipe":
      total //= 2  # a gpipe tick is a forward tick or a backward tick, not both
    return busy, total

  def idle_fraction(self, step: int) -> float:
    """Share of one step's slots left idle (the bubble, for step >= 1)."""
    busy, total = self.busy_slots(step)
    return 1.0 - busy / total

  def ascii(self) -> str:
    """Renders the timetable: a row per stage, a column per tick.

    A cell reads `F3/B1`: forward of microbatch 3 and backward of microbatch 1
    (global numbers; batch = microbatch // M); a trailing `'v` lists weight
    versions when more than one is alive; `.` is an idle slot.
    """
    many_versions = self.schedule in ("2bw", "pipedream")

    def part(kind: str, mb: Optional[int], ver: Optional[int]) -> str:
      if mb is None:
        return "."
      return f"{kind}{mb}" + (f"v{ver}" if many_versions else "")

    cols = []
    for tick, row in enumerate(self.cells):
      col = []
      for c in row:
        if self.schedule == "gpipe":
          col.append(part("F", c.fwd, c.fwd_version) if c.bwd is None and c.fwd is not None
                     else part("B", c.bwd, c.bwd_version))
        else:
          col.append(part("F", c.fwd, c.fwd_version) + "/" + part("B", c.bwd, c.bwd_version))
      cols.append(col)
    width = max(len(x) for col in cols for x in col)
    width = max(width, len(str(self.num_ticks - 1)))
    lines = [f"{self.schedule}: S={self.num_stages} M={self.num_microbatches}, "
             f"{self.ticks_per_step} ticks per step, {self.num_steps} steps"]
    head = "tick    " + " ".join(f"{t:>{width}}" for t in range(self.num_ticks))
    lines.append(head)
    for s in range(self.num_stages):
      lines.append(f"stage {s:<2}" + " ".join(f"{cols[t][s]:>{width}}" for t in range(self.num_ticks)))
    for k in range(self.num_steps):
      lines.append(f"step {k}: idle {self.idle_fraction(k):.1%} of slots")
    return "\n".join(lines)


def timetable(schedule: str, num_stages: int, num_microbatches: int,
              num_steps: int = 2) -> Timetable:
  """Unrolls a schedule's step plan over `num_steps` steps (2bw: step 0 fills)."""
  s_, m = num_stages, num_microbatches
  if schedule == "none":
    cells = tuple((Cell(k * m + j, k * m + j, k, k),)
                  for k in range(num_steps) for j in range(m))
    return Timetable(schedule, 1, m, num_steps, m, cells)
  plan = step_plan(schedule, s_, m)

  def version(k: int, stage: int) -> int:
    if schedule == "pipedream":
      return max(0, k - (s_ - 1 - stage))
    return k

  rows = []
  for k in range(num_steps):
    for t in range(plan.num_ticks):
      row = []
      for s in range(s_):
        f, b = int(plan.fwd[t, s]), int(plan.bwd[t, s])
        # Window index w of step k is global microbatch (k-1)*M + w; indices
        # of a batch before the first do not exist (2bw's fill).
        fg = (k - 1) * m + f if f >= 0 and (k - 1) * m + f >= 0 else None
        bg = (k - 1) * m + b if b >= 0 and (k - 1) * m + b >= 0 else None
        row.append(Cell(fg, bg,
                        None if fg is None else version(fg // m, s),
                        None if bg is None else version(bg // m, s)))
      rows.append(tuple(row))
  return Timetable(schedule, s_, m, num_steps, plan.num_ticks, tuple(rows))
