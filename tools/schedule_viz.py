#!/usr/bin/env python3
"""Draws a pipeline schedule as the engine runs it: a timeline PNG and an ASCII table.

  python tools/schedule_viz.py --schedule 2bw --stages 4 --microbatches 8
  python tools/schedule_viz.py --schedule 2bw,1f1b,gpipe --stages 4 --microbatches 8 \
      --out docs/img/schedules_S4_M8.png
  python tools/schedule_viz.py --schedule all --stages 2 --microbatches 4 --steps 3
  python tools/schedule_viz.py --schedule interleaved --stages 4 --microbatches 8 \
      --virtual-stages 2

Everything comes from `jaxpipe.pipeline.timetable`, the unrolled form of the
step plan that the engine executes: stages are rows, ticks are columns. A
tick in which some stage runs a forward and some stage a backward has a
forward half (top) and a backward half (bottom); a forward-only tick (gpipe's
forward phase, the fill of 1f1b and pipedream) and a backward-only tick (the
drain) have full-height cells. Cells are labelled with the global microbatch
id (F3 / B1; with interleaved's v chunks per stage also the stage's chunk,
F3c1) and coloured by the weight version they run on; idle slots are
white and hatched; thick lines mark step boundaries. The terminal gets
`Timetable.ascii()` and, under it, the steady-state bubble (counted from the
cells, and as `jaxpipe.pipeline.facts` gives it) and, for 2bw, how much of
the first step is fill.

Time axis: a tick is as wide as it lasts under the cost model of
`Timetable.tick_costs` (a forward 1, a backward 2, a tick with both 3), and
one unit of the axis is a "full" tick, with both: one forward and one
backward per stage. An interleaved tick runs one of the stage's v chunks and
is 1/v as wide. A zb1 tick (1F1B's, with W moved) runs, per stage, at most
one F, one B (the input's gradient) and any number of W (the weights'), one
unit of work each, drawn one after another in that order, and is as wide as
its busiest stage's work. With `all` the panels share that axis, on which a
step's length is its cost: M for 2bw, M+S-1 for gpipe, 1f1b and pipedream,
M+(S-1)/v for interleaved, M+(2S-3)/3 for zb1 (M >= S). `all` leaves
interleaved out (with a note) where M is not a multiple of S;
`--virtual-stages` (default 2) sets its v.

Bad input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpipe.cli import Parser  # noqa: E402
from jaxpipe.pipeline import (PIPELINED, Timetable, check_virtual_stages, facts,  # noqa: E402
                              min_microbatches, timetable)

# 2bw, the schedule this project is about, drawn first; then the pipeline's own order.
SCHEDULES = tuple(sorted(PIPELINED, key=lambda name: name != "2bw"))
# Interleaved's chunks per stage unless --virtual-stages says otherwise.
VIRTUAL_STAGES = 2


def chunks(schedule: str, virtual_stages: int = VIRTUAL_STAGES) -> int:
  """v for `schedule`: `virtual_stages` for interleaved, 1 for the others."""
  return virtual_stages if schedule == "interleaved" else 1

# Version colours (backward shade); the forward half uses a lighter tint of
# the same hue, so a microbatch's version reads the same in both halves.
_PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860",
            "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")


def _tint(hex_color: str, amount: float) -> tuple[float, float, float]:
  """Mixes a colour with white (amount 0: unchanged, 1: white)."""
  rgb = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
  return tuple(c + (1 - c) * amount for c in rgb)


def version_color(version: int, forward: bool) -> tuple[float, float, float]:
  """The fill colour of a half-cell that runs on weight version `version`."""
  base = _PALETTE[version % len(_PALETTE)]
  return _tint(base, 0.55 if forward else 0.0)


def parse_schedules(text: str) -> list[str]:
  """`all`, one schedule, or a comma-separated list, in the order given."""
  names = list(SCHEDULES) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
  bad = [n for n in names if n not in SCHEDULES]
  if bad or not names:
    raise ValueError(f"unknown schedule {', '.join(bad) or repr(text)}; choose from "
                     f"{', '.join(SCHEDULES)}, all, or a comma-separated list")
  return names


def check_shape(schedules: Sequence[str], num_stages: int, num_microbatches: int,
                num_steps: int, virtual_stages: int = VIRTUAL_STAGES) -> None:
  """Raises ValueError (one line) for a shape the engine would refuse."""
  if num_stages < 1:
    raise ValueError(f"--stages must be >= 1, got {num_stages}")
  if num_microbatches < 1:
    raise ValueError(f"--microbatches must be >= 1, got {num_microbatches}")
  if num_steps < 1:
    raise ValueError(f"--steps must be >= 1, got {num_steps}")
  if virtual_stages < 2:
    raise ValueError(f"--virtual-stages must be >= 2 (interleaved's chunks per stage), "
                     f"got {virtual_stages}")
  for name in schedules:
    if name == "interleaved" and num_microbatches % num_stages:
      raise ValueError(f"interleaved needs --microbatches a multiple of --stages "
                       f"{num_stages}, got {num_microbatches}")
    check_virtual_stages(name, num_stages, num_microbatches, chunks(name, virtual_stages))
    need = min_microbatches(name, num_stages)
    if num_microbatches < need:
      raise ValueError(f"{name} with {num_stages} stages needs --microbatches >= {need} "
                       f"(2(S-1)), got {num_microbatches}")


def steady_bubble(schedule: str, num_stages: int, num_microbatches: int,
                  virtual_stages: int = VIRTUAL_STAGES) -> float:
  """Idle share of a steady-state step, counted from the timetable's cells.

  Step 1 of a two-step timetable: for 2bw step 0 is the fill, and the
  flushed schedules repeat the same step forever.
  """
  return timetable(schedule, num_stages, num_microbatches, 2,
                   chunks(schedule, virtual_stages)).idle_fraction(1)


def fill_fraction(num_stages: int, num_microbatches: int) -> float:
  """Idle share of 2bw's first step (the pipeline filling up)."""
  return timetable("2bw", num_stages, num_microbatches, 1).idle_fraction(0)


def summary_lines(schedule: str, num_stages: int, num_microbatches: int,
                  virtual_stages: int = VIRTUAL_STAGES) -> list[str]:
  """The lines printed under a schedule's ASCII table.

  Format: `bubble <name>: steady <counted> (formula <facts bubble>)`, and
  for 2bw `fill <name>: first step <idle share>`; fractions to 4 decimals so
  that tests can read them back.
  """
  counted = steady_bubble(schedule, num_stages, num_microbatches, virtual_stages)
  formula = facts(schedule, num_stages, num_microbatches,
                  chunks(schedule, virtual_stages)).bubble
  lines = [f"bubble {schedule}: steady {counted:.4f} (formula {formula:.4f})"]
  if schedule == "2bw":
    lines.append(f"fill {schedule}: first step {fill_fraction(num_stages, num_microbatches):.4f}")
  return lines


# A tick with both a forward and a backward (cost 3) is one unit of the time
# axis; the other ticks are as wide as they last relative to it.
_FULL_TICK = 3.0


def tick_edges(tt: Timetable) -> list[float]:
  """x of each tick's left edge, and the right edge of the last one (time units)."""
  edges = [0.0]
  for cost in tt.tick_costs:
    edges.append(edges[-1] + cost / _FULL_TICK)
  return edges


def _tick_halves(tt: Timetable, tick: int) -> tuple[bool, bool]:
  """(forward half, backward half) drawn for a tick, read off its cost.

  The cost says what the engine runs in the tick: a forward-only tick (1)
  has no backward half and a backward-only tick (2) no forward half. 2bw's
  first-step ticks cost 3 even where the previous batch's backwards are
  missing, since the engine runs the same step with them masked out: their
  backward halves are drawn, idle.
  """
  cost = tt.tick_costs[tick]
  return cost != 2.0, cost != 1.0


def _panel(ax, tt: Timetable, versions_seen: set[int]) -> None:
  """Draws one timetable into `ax` (x: time, y: stages, stage 0 on top)."""
  from matplotlib.patches import Rectangle  # pylint: disable=g-import-not-at-top

  edges = tick_edges(tt)
  s_ = tt.num_stages
  idle_style = dict(facecolor="white", edgecolor="#b0b0b0", hatch="////", linewidth=0.4)

  def box(x, y, w, h, mb, version, forward, label, chunk):
    if mb is None:
      ax.add_patch(Rectangle((x, y), w, h, **idle_style))
      return
    versions_seen.add(version)
    ax.add_patch(Rectangle((x, y), w, h, facecolor=version_color(version, forward),
                           edgecolor="white", linewidth=0.8))
    # A forward-only tick is a third of a unit wide: its label stands upright.
    upright = w < 0.5
    tag = f"{label}{mb}" + (f"c{chunk}" if tt.virtual_stages > 1 else "")
    ax.text(x + w / 2, y + h / 2, tag, ha="center", va="center",
            fontsize=6.5 if upright or h < 1.0 else 7.0, rotation=90 if upright else 0,
            color="black" if forward else "white", fontweight=None if forward else "bold")

  for t, row in enumerate(tt.cells):
    x, w = edges[t], edges[t + 1] - edges[t]
    fwd_half, bwd_half = _tick_halves(tt, t)
    for s, c in enumerate(row):
      if tt.split_backward:
        # zb1: the stage's F, B and W's one after another, a unit of time each
        # (W drawn as a backward), then idle to the tick's end. One weight
        # version per step (it flushes): the step's.
        unit = 1.0 / _FULL_TICK
        items = [(k, m) for k, m in (("F", c.fwd), ("B", c.bwd)) if m is not None]
        items += [("W", m) for m in c.wgt]
        for i, (kind, mb) in enumerate(items):
          box(x + i * unit, s, unit, 1.0, mb, t // tt.ticks_per_step, kind == "F", kind, 0)
        if w - len(items) * unit > 1e-9:
          box(x + len(items) * unit, s, w - len(items) * unit, 1.0, None, None, False, "", 0)
        if s == 0:  # a tick's items are not boxes of equal width: mark where it ends
          ax.axvline(x + w, color="black", linewidth=0.8, linestyle=":")
      elif fwd_half and bwd_half:
        box(x, s, w, 0.5, c.fwd, c.fwd_version, True, "F", c.fwd_chunk)
        box(x, s + 0.5, w, 0.5, c.bwd, c.bwd_version, False, "B", c.bwd_chunk)
      elif fwd_half:
        box(x, s, w, 1.0, c.fwd, c.fwd_version, True, "F", c.fwd_chunk)
      else:
        box(x, s, w, 1.0, c.bwd, c.bwd_version, False, "B", c.bwd_chunk)
  # Stage separators, then step boundaries on top.
  for s in range(s_ + 1):
    ax.axhline(s, color="#404040", linewidth=0.6)
  for k in range(tt.num_steps + 1):
    x = edges[k * tt.ticks_per_step]
    ax.axvline(x, color="black", linewidth=2.2)
    if k < tt.num_steps:
      fill = " (fill)" if tt.schedule == "2bw" and k == 0 and s_ > 1 else ""
      ax.text(x + 0.1, -0.12, f"step {k}{fill}", ha="left", va="bottom", fontsize=8,
              fontweight="bold")
  ax.set_ylim(s_, -0.45)
  ax.set_yticks([s + 0.5 for s in range(s_)])
  ax.set_yticklabels([f"stage {s}" for s in range(s_)], fontsize=8)
  ax.tick_params(axis="y", length=0)


def _title(tt: Timetable) -> str:
  """The panel's title: ticks per step and steady-state bubble, from `facts`."""
  s_, m = tt.num_stages, tt.num_microbatches
  f = facts(tt.schedule, s_, m, tt.virtual_stages)
  ticks = {"2bw": "M, all full",
           "1f1b": "S-1 forward-only, M full, S-1 backward-only",
           "pipedream": "S-1 forward-only, M full, S-1 backward-only",
           "gpipe": "M+S-1 forward-only, then M+S-1 backward-only",
           "interleaved": f"v={tt.virtual_stages} chunks per stage, each tick 1/v wide: "
                          "vS-1 forward-only, vM-vS+S full, vS-1 backward-only",
           "zb1": "1F1B's, each stage at most one F, one B and its W's per tick, "
                  "each tick as wide as its busiest stage's"}[tt.schedule]
  text = (f"{tt.schedule}: {f.ticks} ticks per step ({ticks}), a step lasts "
          f"{f.step_cost / _FULL_TICK:g} units, steady-state bubble {f.bubble:.1%}")
  if tt.schedule == "2bw":
    text += f"; first step fills: {fill_fraction(s_, m):.1%} idle"
  return text


def draw(schedules: Sequence[str], num_stages: int, num_microbatches: int, num_steps: int,
         out: str, virtual_stages: int = VIRTUAL_STAGES) -> str:
  """Draws one panel per schedule on a common tick axis into the PNG `out`."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.patches import Patch  # pylint: disable=g-import-not-at-top

  tables = [timetable(name, num_stages, num_microbatches, num_steps,
                      chunks(name, virtual_stages)) for name in schedules]
  span = max(tick_edges(tt)[-1] for tt in tables)
  # About half an inch per unit keeps "F15" legible in a half-cell; the
  # titles (about 0.075 inch a character) must fit as well.
  longest = max(len(_title(tt)) for tt in tables)
  width = min(max(6.0, 0.52 * span + 1.6, 0.075 * longest + 1.2), 40.0)
  heights = [0.42 * tt.num_stages + 0.55 for tt in tables]
  fig, axes = plt.subplots(len(tables), 1, figsize=(width, sum(heights) + 1.3), sharex=True,
                           gridspec_kw={"height_ratios": heights}, squeeze=False)
  versions: set[int] = set()
  for ax, tt in zip(axes[:, 0], tables):
    _panel(ax, tt, versions)
    ax.set_title(_title(tt), fontsize=9.5, loc="left")
  ax = axes[-1, 0]
  ax.set_xlim(0, span)
  step = 1 if span <= 40 else 2 if span <= 80 else 5
  ax.set_xticks(range(0, int(span) + 1, step))
  ax.tick_params(axis="x", labelsize=8)
  ax.set_xlabel("time (1 = a full tick: a forward and a backward per stage; a forward-only tick "
                "is 1/3 as wide, a backward-only tick 2/3)", fontsize=8.5)
  handles = []
  for v in sorted(versions):
    handles.append(Patch(facecolor=version_color(v, True), edgecolor="none",
                         label=f"v{v} forward"))
    handles.append(Patch(facecolor=version_color(v, False), edgecolor="none",
                         label=f"v{v} backward"))
  handles.append(Patch(facecolor="white", edgecolor="#b0b0b0", hatch="////", label="idle"))
  fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 9), fontsize=8,
             frameon=False, title="weight version (v[k]: weights after k updates)",
             title_fontsize=8)
  fig.suptitle(f"Pipeline schedules as the engine runs them: S={num_stages} stages, "
               f"M={num_microbatches} microbatches, {num_steps} steps", fontsize=11)
  # Room at the bottom for the legend, which is a figure legend (shared by the panels).
  fig.tight_layout(rect=(0, 0.62 / (sum(heights) + 1.3), 1, 1 - 0.3 / (sum(heights) + 1.3)))
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=130)
  plt.close(fig)
  return out


def main(argv: Optional[list[str]] = None) -> int:
  """Prints each schedule's ASCII table and bubble fractions; draws the PNG if asked."""
  parser = Parser(prog="schedule_viz", description=__doc__.split("\n\n")[0])
  parser.add_argument("--schedule", required=True,
                      help=f"{', '.join(SCHEDULES)}, all, or a comma-separated list")
  parser.add_argument("--stages", type=int, required=True, help="S, pipeline stages")
  parser.add_argument("--microbatches", type=int, required=True, help="M, microbatches per step")
  parser.add_argument("--steps", type=int, default=2,
                      help="steps to unroll (default 2: 2bw's fill step and a steady one)")
  parser.add_argument("--out", default="", help="PNG to write (default: none, terminal only)")
  parser.add_argument("--virtual-stages", type=int, default=VIRTUAL_STAGES,
                      help=f"v, interleaved's chunks per stage (default {VIRTUAL_STAGES})")
  args = parser.parse_args(argv)
  v = args.virtual_stages
  left_out = None
  try:
    names = parse_schedules(args.schedule)
    if (args.schedule == "all" and args.stages >= 1 and args.microbatches >= 1
        and args.microbatches % args.stages):
      names.remove("interleaved")
      left_out = (f"interleaved left out: its order needs --microbatches a multiple of "
                  f"--stages {args.stages}")
    check_shape(names, args.stages, args.microbatches, args.steps, v)
  except ValueError as e:
    print(f"schedule_viz: {e}", file=sys.stderr)
    return 2
  for i, name in enumerate(names):
    if i:
      print()
    print(timetable(name, args.stages, args.microbatches, args.steps, chunks(name, v)).ascii())
    for line in summary_lines(name, args.stages, args.microbatches, v):
      print(line)
  if left_out:
    print(f"\n{left_out}")
  if args.out:
    print(f"\nwrote {draw(names, args.stages, args.microbatches, args.steps, args.out, v)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
