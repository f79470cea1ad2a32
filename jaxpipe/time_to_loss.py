"""Time to a target loss: wall-clock curves of training runs, and a projection to S stages.

`tools/time_to_loss.py` trains cells (a schedule, an optimizer, with or
without error feedback) on two cores and keeps every run's per-step times
and validation losses in one JSON file; this module is the arithmetic on
that file, so that a report can be recomputed from it and tested on known
curves:

- the wall clock of a run (`counted_step_times`, `curve`): cumulative
  `step_time_s`, with the steps that compilation or an evaluation
  lengthened counted at the run's median step;
- the time and the steps to a target validation loss (`first_crossing`,
  `to_target`), linear between evaluations, per seed and on the seeds'
  mean curve, with their spread (`spread`, `summarize`);
- a projection to S stages and M microbatches (`project`): each schedule's
  step from its bubble (`jaxpipe.pipeline.facts`), times the steps each
  optimizer needs under its schedule's delay, measured;
- the check of that projection at the measured S=2 (`check_two_stages`),
  the tables (`markdown`) and the planner's view (`planner_projection`).

Pure Python: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from typing import Any, Optional, Sequence

from jaxpipe.errors import InputError
from jaxpipe.pipeline import PIPELINED, facts

__all__ = ["FIRST_TIMED", "REFERENCE", "STAGES", "MULTIPLES", "CHECK_TOLERANCE", "BEGIN", "END",
           "MAKE_IT", "CellName", "Curve", "counted_step_times", "curve", "first_crossing",
           "to_target", "mean_curve", "spread", "target_from", "summarize", "step_units",
           "project", "default_points", "check_two_stages", "measured_table",
           "projection_tables", "check_table", "markdown", "replace_tables", "default_json",
           "load_result", "planner_projection", "format_projection"]

# Steps before this one include compilation and the first dispatches (as
# tools/cpu/bench_train_steps.py counts them).
FIRST_TIMED = 3
# The synchronous run whose loss is the default target: 1F1B with Muon.
REFERENCE = "1f1b-muon"
# The projection's pipeline depths, and its microbatch counts as multiples of S.
STAGES = (2, 4, 8, 16)
MULTIPLES = (1, 2, 4, 8)
# How far the projection at S=2 may be from the measurement before it must be explained.
CHECK_TOLERANCE = 0.15
# Where the doc's tables go (`replace_tables`).
BEGIN = "<!-- time_to_loss tables: begin (written by tools/time_to_loss.py --markdown) -->"
END = "<!-- time_to_loss tables: end -->"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class CellName:
  """A cell's name, `SCHEDULE-OPTIMIZER` or `SCHEDULE-OPTIMIZER-ef` (error feedback, c = 1)."""
  schedule: str
  optimizer: str
  error_feedback: bool = False

  @classmethod
  def parse(cls, name: str) -> "CellName":
    """The parts of `name`; InputError for a name that is not one."""
    parts = name.split("-")
    ef = len(parts) == 3 and parts[2] == "ef"
    if len(parts) not in (2, 3) or (len(parts) == 3 and not ef) or not all(parts):
      raise InputError(f"cell '{name}' is not SCHEDULE-OPTIMIZER[-ef] (e.g. 2bw-muon-ef)")
    if parts[0] not in PIPELINED:
      raise InputError(f"cell '{name}': schedule '{parts[0]}' is not one of "
                       f"{', '.join(PIPELINED)}")
    return cls(parts[0], parts[1], ef)

  @property
  def name(self) -> str:
    return f"{self.schedule}-{self.arm}"

  @property
  def arm(self) -> str:
    """The optimizer with its correction: `muon` or `muon-ef`."""
    return self.optimizer + ("-ef" if self.error_feedback else "")

  @property
  def delayed(self) -> bool:
    """Whether the schedule delays the gradient (2bw's one step; pipedream's S-1-s)."""
    v = 2 if self.schedule == "interleaved" else 1
    return facts(self.schedule, 2, 4, v).gradient_delay != "none"


@dataclasses.dataclass(frozen=True)
class Curve:
  """A run's validation loss against its wall clock.

  Attributes:
    steps: the updates done at each evaluation (0 first).
    val: the validation loss there (non-finite evaluations left out).
    seconds: the wall clock there: the counted seconds of the steps before it.
    step_s: the run's mean counted step (its clock's rate).
  """
  steps: tuple[float, ...]
  val: tuple[float, ...]
  seconds: tuple[float, ...]
  step_s: float


# --- one run ------------------------------------------------------------------------


def counted_step_times(step_times: Sequence[Optional[float]], eval_steps: Sequence[int],
                       first_timed: int = FIRST_TIMED) -> list[float]:
  """The seconds each step of a run adds to its wall clock.

  `step_times[k]` is train.py's `step_time_s` of step k: the interval
  between step k-1's completion and step k's. Three kinds of step are not
  training time and count as the median of the others: steps before
  `first_timed` (the first includes compilation, the next ones the first
  dispatches), a step followed by an evaluation (train.py evaluates after
  dispatching the step that follows, so the evaluation, and the first
  one's compilation, land in the interval of step e-1 for an evaluation
  after e updates; the evaluation after the last step lands in none), and a
  step that was not timed (null).
  """
  n = len(step_times)
  lengthened = {e - 1 for e in eval_steps if 0 < e < n}
  clean = [t for k, t in enumerate(step_times)
           if t is not None and k >= first_timed and k not in lengthened]
  if not clean:
    raise InputError(f"a run of {n} steps has no step timed from step {first_timed} on, "
                     "away from evaluations; run more steps")
  median = statistics.median(clean)
  return [median if (t is None or k < first_timed or k in lengthened) else float(t)
          for k, t in enumerate(step_times)]


def curve(run: dict[str, Any], first_timed: int = FIRST_TIMED) -> Curve:
  """A run's `Curve` from its record in the JSON (`step_time_s`, `val` as [[step, loss]])."""
  val = [(int(s), float(v)) for s, v in run["val"] if v is not None and v == v]
  counted = counted_step_times(run["step_time_s"], [s for s, _ in run["val"]], first_timed)
  clock = [0.0]
  for t in counted:
    clock.append(clock[-1] + t)
  return Curve(tuple(float(s) for s, _ in val), tuple(v for _, v in val),
               tuple(clock[s] for s, _ in val), clock[-1] / len(counted))


def first_crossing(xs: Sequence[float], ys: Sequence[float], target: float) -> Optional[float]:
  """The first x at which the broken line through (xs, ys) falls to `target`; None if never.

  Between two points the line is straight, so a crossing between (x0, y0)
  and (x1, y1) is at x0 + (y0 - target) / (y0 - y1) * (x1 - x0).
  """
  for i, y in enumerate(ys):
    if y <= target:
      if i == 0:
        return float(xs[0])
      x0, y0 = xs[i - 1], ys[i - 1]
      return x0 + (y0 - target) / (y0 - y) * (xs[i] - x0)
  return None


def to_target(c: Curve, target: float) -> dict[str, Optional[float]]:
  """{seconds, steps} at which the curve first reaches `target` (both None if it never does).

  Both are interpolated on the same segment between evaluations.
  """
  index = list(range(len(c.val)))
  at = first_crossing(index, c.val, target)
  if at is None:
    return {"seconds": None, "steps": None}
  i = min(int(at), len(index) - 2) if len(index) > 1 else 0
  frac = at - i

  def between(xs):
    return xs[i] if len(xs) == 1 else xs[i] + frac * (xs[i + 1] - xs[i])

  return {"seconds": between(c.seconds), "steps": between(c.steps)}


# --- seeds and cells ----------------------------------------------------------------


def mean_curve(curves: Sequence[Curve]) -> Curve:
  """The seeds' mean curve: at each evaluation every seed has, the mean loss and mean clock."""
  common = sorted(set.intersection(*(set(c.steps) for c in curves)))
  at = [{s: i for i, s in enumerate(c.steps)} for c in curves]
  mean = lambda xs: sum(xs) / len(xs)
  return Curve(tuple(common),
               tuple(mean([c.val[a[s]] for c, a in zip(curves, at)]) for s in common),
               tuple(mean([c.seconds[a[s]] for c, a in zip(curves, at)]) for s in common),
               mean([c.step_s for c in curves]))


def spread(values: Sequence[Optional[float]]) -> dict[str, Any]:
  """{each, reached, of, mean, min, max} of per-seed values (None: not reached).

  The mean and the largest exist only when every seed reached the target
  (the others are beyond the run's end); the smallest when one did.
  """
  reached = [v for v in values if v is not None]
  every = bool(values) and len(reached) == len(values)
  return {"each": list(values), "reached": len(reached), "of": len(values),
          "mean": sum(reached) / len(reached) if every else None,
          "min": min(reached) if reached else None,
          "max": max(reached) if every else None}


def _by_cell(runs: dict[str, dict]) -> dict[str, list[dict]]:
  """{cell: its runs, by seed}, cells in the order they first appear."""
  out: dict[str, list[dict]] = {}
  for run in runs.values():
    out.setdefault(run["cell"], []).append(run)
  return {c: sorted(rs, key=lambda r: r["seed"]) for c, rs in out.items()}


def target_from(runs: dict[str, dict], reference: str, at_step: int) -> float:
  """The mean over seeds of `reference`'s validation loss after `at_step` updates."""
  mine = _by_cell(runs).get(reference)
  if not mine:
    raise InputError(f"no run of the reference cell {reference} to take the target from; "
                     "add it to --cells, name another with --reference, or give --target")
  vals = [dict((int(s), v) for s, v in r["val"]).get(at_step) for r in mine]
  if any(v is None for v in vals):
    raise InputError(f"{reference} has no finite validation loss at step {at_step} in every "
                     "seed; give --target")
  return sum(vals) / len(vals)


def summarize(runs: dict[str, dict], target: float, reference: str = REFERENCE,
              first_timed: int = FIRST_TIMED) -> dict[str, Any]:
  """Per cell: time and steps to `target`, per seed and on the mean curve, and the step.

  `time_vs_reference` is the cell's time to target on its mean curve over
  the reference's (below 1: sooner); None where either never reaches it.
  """
  cells = {}
  for name, mine in _by_cell(runs).items():
    curves = [curve(r, first_timed) for r in mine]
    each = [to_target(c, target) for c in curves]
    cells[name] = {
        "seeds": [r["seed"] for r in mine],
        "seconds": spread([e["seconds"] for e in each]),
        "steps": spread([e["steps"] for e in each]),
        "mean_curve": to_target(mean_curve(curves), target),
        "step_s": sum(c.step_s for c in curves) / len(curves),
        "final_val": spread([c.val[-1] for c in curves]),
    }
  ref = cells.get(reference, {}).get("mean_curve", {}).get("seconds")
  for row in cells.values():
    mine = row["mean_curve"]["seconds"]
    row["time_vs_reference"] = mine / ref if (mine is not None and ref) else None
  return {"target": target, "reference": reference, "cells": cells}


# --- the projection -----------------------------------------------------------------


def step_units(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 2,
               num_layers: Optional[int] = None) -> Optional[float]:
  """A step in units of one stage's forward and backward of one microbatch: M + the bubble.

  From the schedule's own plan (`facts(...).step_cost`, in units of a
  forward, 3 to a forward and backward): M + S - 1 for 1F1B and GPipe, M
  for 2BW (no flush), M + (S-1)/v for interleaved with v chunks per device
  (v only for interleaved). None where the schedule refuses S and M (2bw
  needs M >= 2(S-1); interleaved a multiple of S, and with `num_layers`
  given, S*v dividing them).
  """
  v = virtual_stages if schedule == "interleaved" else 1
  if num_layers is not None and num_layers % (num_stages * v):
    return None
  try:
    f = facts(schedule, num_stages, num_microbatches, v)
  except ValueError:
    return None
  if num_microbatches < f.min_microbatches:
    return None
  return f.step_cost / 3


def _steps_source(cells: dict[str, dict], schedule: str, arm: str) -> Optional[str]:
  """The measured cell whose steps to target stand for `schedule` with `arm`.

  A delaying schedule's own cell; for a synchronous one, 1f1b's with the same
  arm, else any synchronous cell with it (they compute the same updates).
  """
  own = f"{schedule}-{arm}"
  if CellName.parse(own).delayed:
    return own if own in cells else None
  sync = [c for c in cells if not CellName.parse(c).delayed and CellName.parse(c).arm == arm]
  return f"1f1b-{arm}" if f"1f1b-{arm}" in sync else (sync[0] if sync else None)


def _rows(cells: dict[str, dict]) -> list[tuple[str, str]]:
  """(schedule, arm) of every measured cell, in the cells' order."""
  return [(CellName.parse(c).schedule, CellName.parse(c).arm) for c in cells]


def project(summary: dict[str, Any], points: Sequence[tuple[int, int]], *,
            virtual_stages: int = 2, num_layers: Optional[int] = None) -> dict[str, Any]:
  """Projected time to target of every measured (schedule, arm) at each (S, M) of `points`.

  The model, for a model and global batch held fixed: a step takes
  `step_units` (M + the schedule's bubble, in microbatch-stage units) x the
  compute of one microbatch on one stage, which is the one-device step /
  (S M); communication and the optimizer's update are left out. The steps
  to target do not depend on S: 2bw's delay is one step at any depth, and
  the synchronous schedules compute the same updates. So, per row:
  `steps_ratio` = its steps to target / the reference's (measured; see
  `_steps_source`), `step_vs_one_device` = step_units / (S M), `time` =
  steps_ratio x step_vs_one_device (the time to target over the time the
  reference's steps take on one device), and `vs_reference` = time / the
  reference's time at the same S and M. None where a schedule refuses S and
  M or the measurement never reached the target.
  """
  cells, ref = summary["cells"], summary["reference"]
  ref_steps = cells.get(ref, {}).get("mean_curve", {}).get("steps")
  ratios = {}
  for schedule, arm in _rows(cells):
    src = _steps_source(cells, schedule, arm)
    steps = cells[src]["mean_curve"]["steps"] if src else None
    ratios[f"{schedule}-{arm}"] = {"source": src, "steps_ratio": (
        steps / ref_steps if steps is not None and ref_steps else None)}
  rows = []
  for s_, m in points:
    ref_units = step_units(CellName.parse(ref).schedule, s_, m, virtual_stages, num_layers)
    for schedule, arm in _rows(cells):
      units = step_units(schedule, s_, m, virtual_stages, num_layers)
      ratio = ratios[f"{schedule}-{arm}"]["steps_ratio"]
      time = None if units is None or ratio is None else ratio * units / (s_ * m)
      rows.append({"stages": s_, "microbatches": m, "cell": f"{schedule}-{arm}",
                   "step_units": units, "steps_ratio": ratio,
                   "step_vs_one_device": None if units is None else units / (s_ * m),
                   "time": time, "vs_reference": (
                       time / (ref_units / (s_ * m)) if time is not None and ref_units else None)})
  return {"reference": ref, "virtual_stages": virtual_stages, "ratios": ratios, "rows": rows}


def default_points(extra: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
  """(S, M) for S in STAGES and M = S x MULTIPLES, then `extra` where new."""
  out = [(s_, s_ * k) for s_ in STAGES for k in MULTIPLES]
  return out + [p for p in extra if p not in out]


def check_two_stages(summary: dict[str, Any], microbatches: int,
                     virtual_stages: int = 2) -> list[dict[str, Any]]:
  """The projection at the measured S=2 and M, in seconds, against each cell's measurement.

  One microbatch-stage's compute `c` is measured where nothing idles: a 2bw
  cell's step / M (2bw's step is M such units), the 2bw cell of the same
  optimizer (and correction, for a corrected cell). A cell's projected time
  is c x step_units(its schedule, 2, M) x the steps the projection gives it
  (`_steps_source`); `ratio` = projected / measured, both on the seeds'
  mean curves; `within` = |ratio - 1| <= CHECK_TOLERANCE.
  """
  cells, out = summary["cells"], []
  for name in cells:
    cell = CellName.parse(name)
    twobw = cells.get(f"2bw-{cell.arm}" if cell.delayed else f"2bw-{cell.optimizer}")
    src = _steps_source(cells, cell.schedule, cell.arm)
    units = step_units(cell.schedule, 2, microbatches, virtual_stages)
    measured = cells[name]["mean_curve"]["seconds"]
    steps = cells[src]["mean_curve"]["steps"] if src else None
    if twobw is None or units is None or steps is None or measured is None:
      out.append({"cell": name, "measured_s": measured, "projected_s": None, "ratio": None,
                  "within": None, "c_s": None, "projected_step_s": None,
                  "measured_step_s": cells[name]["step_s"]})
      continue
    c = twobw["step_s"] / microbatches
    projected = c * units * steps
    out.append({"cell": name, "c_s": c, "projected_step_s": c * units,
                "measured_step_s": cells[name]["step_s"], "projected_s": projected,
                "measured_s": measured, "ratio": projected / measured,
                "within": abs(projected / measured - 1) <= CHECK_TOLERANCE})
  return out


# --- tables -------------------------------------------------------------------------


def _num(x: Optional[float], fmt: str = ".4g", missing: str = "-") -> str:
  return missing if x is None else format(x, fmt)


def _seeds(sp: dict[str, Any], fmt: str) -> str:
  """Per-seed values, `never` for a seed that did not reach the target."""
  return ", ".join("never" if v is None else format(v, fmt) for v in sp["each"])


def measured_table(summary: dict[str, Any]) -> str:
  """Markdown: per cell, time and steps to target (mean curve, and each seed), step, final loss."""
  ref = summary["reference"]
  lines = [f"| cell | time to target, s (mean curve) | each seed, s | vs {ref} | steps to "
           "target (mean curve) | each seed | step, s | final val loss (mean) |",
           "|---|---:|---|---:|---:|---|---:|---:|"]
  for name, row in summary["cells"].items():
    reached = row["mean_curve"]["seconds"] is not None
    lines.append(
        f"| {name} | {_num(row['mean_curve']['seconds'], '.4g', 'not reached')} | "
        f"{_seeds(row['seconds'], '.4g')} | {_num(row['time_vs_reference'], '.3f')} | "
        f"{_num(row['mean_curve']['steps'], '.1f', 'not reached') if reached else 'not reached'}"
        f" | {_seeds(row['steps'], '.1f')} | {row['step_s']:.4f} | "
        f"{_num(row['final_val']['mean'], '.4f')} |")
  return "\n".join(lines)


def projection_tables(projection: dict[str, Any]) -> str:
  """Markdown: a table per S, a row per cell, a column per M: time to target vs the reference."""
  rows, ref = projection["rows"], projection["reference"]
  out = []
  for s_ in sorted({r["stages"] for r in rows}):
    ms = sorted({r["microbatches"] for r in rows if r["stages"] == s_})
    mine = [r for r in rows if r["stages"] == s_]
    out += [f"S = {s_} (time to target over {ref}'s at the same S and M):", "",
            "| cell | steps ratio | " + " | ".join(f"M={m}" for m in ms) + " |",
            "|---|---:|" + "---:|" * len(ms)]
    for cell in dict.fromkeys(r["cell"] for r in mine):
      by_m = {r["microbatches"]: r for r in mine if r["cell"] == cell}
      ratio = projection["ratios"][cell]["steps_ratio"]
      out.append(f"| {cell} | {_num(ratio, '.3f', 'not reached')} | " + " | ".join(
          _num(by_m[m]["vs_reference"], ".3f") for m in ms) + " |")
    out.append("")
  return "\n".join(out).rstrip()


def check_table(check: Sequence[dict[str, Any]]) -> str:
  """Markdown: the projection at S=2 against the measurement, per cell."""
  lines = ["| cell | measured step, s | projected step, s | measured time to target, s | "
           f"projected, s | projected / measured | within {CHECK_TOLERANCE:.0%} |",
           "|---|---:|---:|---:|---:|---:|---|"]
  for r in check:
    within = "-" if r["within"] is None else ("yes" if r["within"] else "NO")
    lines.append(f"| {r['cell']} | {r['measured_step_s']:.4f} | "
                 f"{_num(r['projected_step_s'], '.4f')} | {_num(r['measured_s'])} | "
                 f"{_num(r['projected_s'])} | {_num(r['ratio'], '.3f')} | {within} |")
  return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
  """The measured table, the S=2 check and the projected tables of a result, with their header."""
  s, summary = result["settings"], result["summary"]
  seeds = sorted({r["seed"] for r in result["runs"].values()})
  return "\n".join([
      BEGIN, "",
      f"Target: validation loss {summary['target']:.4f} ({result['target_source']}). "
      f"{len(result['runs'])} runs: {len(summary['cells'])} cells x seeds "
      f"{', '.join(map(str, seeds))}; {s['steps_per_run']} steps each, S=2, "
      f"M={s['microbatches']}; commit {result.get('commit', 'unknown')}.", "",
      "Measured (two cores, a stage per core; time = counted step time, see the tool):", "",
      measured_table(summary), "",
      "The projection at the measured S=2 against the measurement:", "",
      check_table(result["check"]), "",
      "Projected (step = (M + bubble) x one microbatch-stage's compute; steps to target "
      "as measured):", "",
      projection_tables(result["projection"]), "", END])


def replace_tables(text: str, tables: str) -> str:
  """`text` with what lies between BEGIN and END (both included) replaced by `tables`."""
  start, stop = text.find(BEGIN), text.find(END)
  if start < 0 or stop < start:
    raise InputError(f"the file has no '{BEGIN}' ... '{END}' pair to write the tables "
                     "between; add them, or name a new file")
  return text[:start] + tables + text[stop + len(END):]


# --- the file and the planner -------------------------------------------------------


def default_json() -> str:
  """Where the committed measurement lives in a clone: docs/data/time_to_loss.json."""
  return os.path.join(_ROOT, "docs", "data", "time_to_loss.json")


MAKE_IT = ("python tools/time_to_loss.py --out runs/time_to_loss, then copy "
           "runs/time_to_loss/time_to_loss.json to docs/data/time_to_loss.json")


def load_result(path: str) -> dict[str, Any]:
  """The tool's JSON at `path`; InputError (naming the command that makes it) if unusable."""
  if not os.path.isfile(path):
    raise InputError(f"no time-to-loss measurement at {path}; make it with {MAKE_IT} "
                     "(or pass --ttl-json FILE)")
  try:
    with open(path) as f:
      result = json.load(f)
  except (OSError, ValueError) as e:
    raise InputError(f"{path} is not a time-to-loss JSON ({e}); remake it with {MAKE_IT}") \
        from None
  if not isinstance(result, dict) or not isinstance(result.get("summary"), dict):
    raise InputError(f"{path} has no summary; remake it with {MAKE_IT}, or run the tool "
                     "with --report on its --out")
  return result


def planner_projection(path: str, num_stages: int, num_microbatches: int, virtual_stages: int,
                       num_layers: int) -> dict[str, Any]:
  """The planner's `--time-to-loss`: the measurement at `path` projected to STAGES x MULTIPLES
  and to the config's own S and M, for a model of `num_layers` blocks."""
  result = load_result(path)
  proj = project(result["summary"], default_points([(num_stages, num_microbatches)]),
                 virtual_stages=virtual_stages, num_layers=num_layers)
  return {"source": path, "target": result["summary"]["target"],
          "target_source": result.get("target_source"),
          "steps_to_target": {c: row["mean_curve"]["steps"]
                              for c, row in result["summary"]["cells"].items()},
          **proj}


def format_projection(p: dict[str, Any]) -> str:
  """The planner's text report of `planner_projection`."""
  ratios = ", ".join(f"{c} {_num(r['steps_ratio'], '.3f', 'not reached')}"
                     for c, r in p["ratios"].items())
  return "\n".join([
      f"time to target, projected from {p['source']}: target val loss {p['target']:.4f} "
      f"({p['target_source']})",
      f"steps to target over {p['reference']}'s (measured at S=2, taken as independent of S): "
      f"{ratios}",
      "a step = (M + the schedule's bubble) x one microbatch-stage's compute (2bw: no flush; "
      f"interleaved v={p['virtual_stages']}); communication and the update left out", "",
      projection_tables(p)])
