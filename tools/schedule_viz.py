#!/usr/bin/env python3
"""Draws a pipeline schedule as the engine runs it: a timeline PNG and an ASCII table.

  python tools/schedule_viz.py --schedule 2bw --stages 4 --microbatches 8
  python tools/schedule_viz.py --schedule 2bw,1f1b,gpipe --stages 4 --microbatches 8 \
      --out docs/img/schedules_S4_M8.png
  python tools/schedule_viz.py --schedule all --stages 2 --microbatches 4 --steps 3

Everything comes from `jaxpipe.pipeline.timetable`, the unrolled form of the
step plan that the engine executes: stages are rows, ticks are columns, each
tick-engine cell has a forward half (top) and a backward half (bottom)
labelled with the global microbatch id (F3 / B1), coloured by the weight
version it runs on; idle slots are white and hatched; thick lines mark step
boundaries. The terminal gets `Timetable.ascii()` and, under it, the
steady-state bubble fraction (and, for 2bw, how much of the first step is
fill).

Time axis: one column is one tick of the tick engine (1f1b, 2bw, pipedream),
in which every stage runs a forward and a backward. A gpipe tick runs only a
forward or only a backward, so gpipe's ticks are drawn half as wide: with
`all` the panels then share one axis on which a step's length is its cost
(M, M+S-1 and M+2(S-1) tick-pairs for 2bw, gpipe and 1f1b).

Bad input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpipe.pipeline import (Timetable, bubble_fraction, min_microbatches,  # noqa: E402
                              timetable)

SCHEDULES = ("2bw", "1f1b", "gpipe", "pipedream")

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
                num_steps: int) -> None:
  """Raises ValueError (one line) for a shape the engine would refuse."""
  if num_stages < 1:
    raise ValueError(f"--stages must be >= 1, got {num_stages}")
  if num_microbatches < 1:
    raise ValueError(f"--microbatches must be >= 1, got {num_microbatches}")
  if num_steps < 1:
    raise ValueError(f"--steps must be >= 1, got {num_steps}")
  for name in schedules:
    need = min_microbatches(name, num_stages)
    if num_microbatches < need:
      raise ValueError(f"{name} with {num_stages} stages needs --microbatches >= {need} "
                       f"(2(S-1)), got {num_microbatches}")


def steady_bubble(schedule: str, num_stages: int, num_microbatches: int) -> float:
  """Idle share of a steady-state step, counted from the timetable's cells.

  Step 1 of a two-step timetable: for 2bw step 0 is the fill, and the
  flushed schedules repeat the same step forever.
  """
  return timetable(schedule, num_stages, num_microbatches, 2).idle_fraction(1)


def fill_fraction(num_stages: int, num_microbatches: int) -> float:
  """Idle share of 2bw's first step (the pipeline filling up)."""
  return timetable("2bw", num_stages, num_microbatches, 1).idle_fraction(0)


def summary_lines(schedule: str, num_stages: int, num_microbatches: int) -> list[str]:
  """The lines printed under a schedule's ASCII table.

  Format: `bubble <name>: steady <counted> (formula <bubble_fraction>)`, and
  for 2bw `fill <name>: first step <idle share>`; fractions to 4 decimals so
  that tests can read them back.
  """
  counted = steady_bubble(schedule, num_stages, num_microbatches)
  formula = bubble_fraction(schedule, num_stages, num_microbatches)
  lines = [f"bubble {schedule}: steady {counted:.4f} (formula {formula:.4f})"]
  if schedule == "2bw":
    lines.append(f"fill {schedule}: first step {fill_fraction(num_stages, num_microbatches):.4f}")
  return lines


def _tick_width(tt: Timetable) -> float:
  # A gpipe tick holds a forward or a backward, not both: half a tick-pair.
  return 0.5 if tt.schedule == "gpipe" else 1.0


def _panel(ax, tt: Timetable, versions_seen: set[int]) -> None:
  """Draws one timetable into `ax` (x: ticks, y: stages, stage 0 on top)."""
  from matplotlib.patches import Rectangle  # pylint: disable=g-import-not-at-top

  w = _tick_width(tt)
  s_ = tt.num_stages
  # Labels shrink with the cell so that F15 / B15 still fit a half-cell.
  font = 7.0 if w == 1.0 else 6.0
  idle_style = dict(facecolor="white", edgecolor="#b0b0b0", hatch="////", linewidth=0.4)

  def half(x, y, h, mb, version, forward, label):
    if mb is None:
      ax.add_patch(Rectangle((x, y), w, h, **idle_style))
      return
    versions_seen.add(version)
    ax.add_patch(Rectangle((x, y), w, h, facecolor=version_color(version, forward),
                           edgecolor="white", linewidth=0.8))
    ax.text(x + w / 2, y + h / 2, f"{label}{mb}", ha="center", va="center", fontsize=font,
            color="black" if forward else "white", fontweight="bold" if not forward else None)

  for t, row in enumerate(tt.cells):
    x = t * w
    for s, c in enumerate(row):
      y = s
      if tt.schedule == "gpipe":
        # A forward tick or a backward tick: one full-height slot.
        if c.fwd is not None:
          half(x, y, 1.0, c.fwd, c.fwd_version, True, "F")
        else:
          half(x, y, 1.0, c.bwd, c.bwd_version, False, "B")
      else:
        half(x, y, 0.5, c.fwd, c.fwd_version, True, "F")
        half(x, y + 0.5, 0.5, c.bwd, c.bwd_version, False, "B")
  # Stage separators, then step boundaries on top.
  for s in range(s_ + 1):
    ax.axhline(s, color="#404040", linewidth=0.6)
  for k in range(tt.num_steps + 1):
    x = k * tt.ticks_per_step * w
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
  s_, m = tt.num_stages, tt.num_microbatches
  ticks = {"2bw": "M", "1f1b": "M+2(S-1)", "pipedream": "M+2(S-1)",
           "gpipe": "M+S-1 forward, then M+S-1 backward"}[tt.schedule]
  text = (f"{tt.schedule}: {tt.ticks_per_step} ticks per step ({ticks}), steady-state bubble "
          f"{steady_bubble(tt.schedule, s_, m):.1%}")
  if tt.schedule == "2bw":
    text += f"; first step fills: {fill_fraction(s_, m):.1%} idle"
  return text


def draw(schedules: Sequence[str], num_stages: int, num_microbatches: int, num_steps: int,
         out: str) -> str:
  """Draws one panel per schedule on a common tick axis into the PNG `out`."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.patches import Patch  # pylint: disable=g-import-not-at-top

  tables = [timetable(name, num_stages, num_microbatches, num_steps) for name in schedules]
  span = max(tt.num_ticks * _tick_width(tt) for tt in tables)
  # About half an inch per tick keeps "F15" legible in a half-cell.
  width = min(max(6.0, 0.52 * span + 1.6), 40.0)
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
  ax.set_xlabel("tick (a forward and a backward per stage; gpipe's forward-only and "
                "backward-only ticks are drawn half as wide)", fontsize=8.5)
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


class _Parser(argparse.ArgumentParser):
  """Reports a usage error as one line, like every other bad input."""

  def error(self, message: str) -> None:
    self.exit(2, f"{self.prog}: {message} (see --help)\n")


def main(argv: Optional[list[str]] = None) -> int:
  """Prints each schedule's ASCII table and bubble fractions; draws the PNG if asked."""
  parser = _Parser(prog="schedule_viz", description=__doc__.split("\n\n")[0])
  parser.add_argument("--schedule", required=True,
                      help=f"{', '.join(SCHEDULES)}, all, or a comma-separated list")
  parser.add_argument("--stages", type=int, required=True, help="S, pipeline stages")
  parser.add_argument("--microbatches", type=int, required=True, help="M, microbatches per step")
  parser.add_argument("--steps", type=int, default=2,
                      help="steps to unroll (default 2: 2bw's fill step and a steady one)")
  parser.add_argument("--out", default="", help="PNG to write (default: none, terminal only)")
  args = parser.parse_args(argv)
  try:
    names = parse_schedules(args.schedule)
    check_shape(names, args.stages, args.microbatches, args.steps)
  except ValueError as e:
    print(f"schedule_viz: {e}", file=sys.stderr)
    return 2
  for i, name in enumerate(names):
    if i:
      print()
    print(timetable(name, args.stages, args.microbatches, args.steps).ascii())
    for line in summary_lines(name, args.stages, args.microbatches):
      print(line)
  if args.out:
    print(f"\nwrote {draw(names, args.stages, args.microbatches, args.steps, args.out)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
