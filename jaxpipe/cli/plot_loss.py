"""Plots the loss curves of one or several runs to a PNG.

  python tools/plot_loss.py runs/quickstart [runs/other ...] --out loss.png
  jaxpipe-plot runs/quickstart --out loss.png   (installed)

Each run directory's metrics.jsonl gives a training curve (light, with an
exponential moving average on top) and a validation curve (markers). The
x axis is optimizer steps, or tokens with --x tokens.
"""

from __future__ import annotations

import os
import sys

from jaxpipe import runs
from jaxpipe.cli._common import Parser


def read_metrics(run_dir: str) -> tuple[list[dict], list[dict]]:
  """(training records, validation records) of a run, sorted by step."""
  path = os.path.join(run_dir, runs.METRICS)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist (is {run_dir} a run directory?)")
  train, val = {}, {}
  for rec in runs.read_records(run_dir, strict=True):
    if rec.get("loss") is not None:
      train[rec["step"]] = rec
    elif rec.get("val_loss") is not None:
      val[rec["step"]] = rec
  return [train[k] for k in sorted(train)], [val[k] for k in sorted(val)]


def ema(values: list[float], alpha: float) -> list[float]:
  """Exponential moving average with bias correction (so it starts at the data)."""
  out, avg, weight = [], 0.0, 0.0
  for v in values:
    avg = alpha * avg + (1 - alpha) * v
    weight = alpha * weight + (1 - alpha)
    out.append(avg / weight)
  return out


def plot(run_dirs: list[str], out: str, *, x: str = "step", smooth: float = 0.9,
         labels: list[str] | None = None, title: str = "") -> str:
  """Draws the runs' curves into `out` (PNG) and returns its path."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, run_dir in enumerate(run_dirs):
    train, val = read_metrics(run_dir)
    label = labels[i] if labels else os.path.basename(os.path.normpath(run_dir))
    color = colors[i % len(colors)]
    tokens_per_step = train[0]["tokens"] / (train[0]["step"] + 1) if train else 0

    def xs(records):
      if x == "tokens":
        return [r.get("tokens", (r["step"] + 1) * tokens_per_step) for r in records]
      return [r["step"] for r in records]

    if train:
      losses = [r["loss"] for r in train]
      ax.plot(xs(train), losses, color=color, alpha=0.25, linewidth=0.8)
      ax.plot(xs(train), ema(losses, smooth) if smooth else losses, color=color,
              linewidth=1.6, label=f"{label} train")
    if val:
      vx = [r["step"] * tokens_per_step for r in val] if x == "tokens" else xs(val)
      ax.plot(vx, [r["val_loss"] for r in val], color=color, marker="o", markersize=4,
              linestyle="--", linewidth=1.0, label=f"{label} val")
  ax.set_xlabel("tokens" if x == "tokens" else "step")
  ax.set_ylabel("loss (nats per token)")
  ax.grid(alpha=0.3)
  ax.legend()
  if title:
    ax.set_title(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out)
  plt.close(fig)
  return out


def main(argv=None) -> int:
  parser = Parser(prog="plot_loss", description=__doc__.split("\n\n")[0])
  parser.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
  parser.add_argument("--out", default="loss.png", help="output PNG")
  parser.add_argument("--x", choices=("step", "tokens"), default="step")
  parser.add_argument("--smooth", type=float, default=0.9,
                      help="EMA factor for training curves (0 = raw)")
  parser.add_argument("--labels", nargs="*", help="one legend label per run")
  parser.add_argument("--title", default="")
  args = parser.parse_args(argv)
  if args.labels and len(args.labels) != len(args.runs):
    print(f"error: {len(args.labels)} labels for {len(args.runs)} runs", file=sys.stderr)
    return 2
  try:
    path = plot(args.runs, args.out, x=args.x, smooth=args.smooth, labels=args.labels,
                title=args.title)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
