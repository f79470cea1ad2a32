"""Results from the runs on disk: per-optimizer finals, gaps, shares, tables and plots."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Sequence

from jaxpipe.study._cells import (
    ROOT, SETTINGS, SETTING_LABELS, Cell, fmt_lr, read_records, marker_wall)

# --- results ----------------------------------------------------------------------


def _mean_std(values: Sequence[float]) -> tuple[Optional[float], Optional[float]]:
  if not values:
    return None, None
  mean = sum(values) / len(values)
  if len(values) < 2:
    return mean, None
  var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
  return mean, math.sqrt(var)


def recovered_share(sync: Optional[float], delayed: Optional[float],
                    corrected: Optional[float]) -> Optional[float]:
  """(delayed - corrected) / (delayed - sync): the share of the gap the correction recovers.

  None when a value is missing or non-finite, or when the delay opened no gap
  (delayed <= sync), where the share means nothing.
  """
  if sync is None or delayed is None or corrected is None:
    return None
  if not all(map(math.isfinite, (sync, delayed, corrected))):
    return None
  gap = delayed - sync
  if gap <= 0:
    return None
  return (delayed - corrected) / gap


def summarize(cells: Sequence[Cell], optimizers: Sequence[str], seeds: Sequence[int],
              params: int, tokens_per_step: int) -> dict[str, Any]:
  """Per optimizer: final validation loss per setting, gaps, recovered share, gap curves.

  Gaps are paired by seed (same initialisation and data order): the gap of
  seed s is delayed_s - sync_s, and its mean equals the difference of means.
  """
  by_key = {(c.optimizer, c.setting, c.seed): c for c in cells}
  table = {}
  for opt in optimizers:
    row: dict[str, Any] = {"lr": None, "settings": {}, "curves": {}}
    finals: dict[str, dict[int, float]] = {}
    curves: dict[str, dict[int, dict[int, float]]] = {}
    for setting in SETTINGS:
      finals[setting], curves[setting] = {}, {}
      for seed in seeds:
        cell = by_key.get((opt, setting, seed))
        if cell is None:
          continue
        row["lr"] = cell.lr
        train, val, times = read_records(cell.run_dir)
        if cell.steps in val:
          finals[setting][seed] = val[cell.steps]
          curves[setting][seed] = val
      vals = list(finals[setting].values())
      mean, std = _mean_std(vals)
      row["settings"][setting] = {"mean": mean, "std": std, "n": len(vals),
                                  "per_seed": {str(s): v for s, v in finals[setting].items()}}
      # The mean curve over the seeds that finished, at the steps they share.
      if curves[setting]:
        steps = sorted(set.intersection(*(set(c) for c in curves[setting].values())))
        row["curves"][setting] = {
            k: sum(c[k] for c in curves[setting].values()) / len(curves[setting])
            for k in steps}

    def paired(a: str, b: str) -> tuple[Optional[float], Optional[float], int]:
      common = sorted(set(finals[a]) & set(finals[b]))
      diffs = [finals[a][s] - finals[b][s] for s in common]
      m, sd = _mean_std(diffs)
      return m, sd, len(diffs)

    gap, gap_std, _ = paired("delay", "sync")
    cgap, cgap_std, _ = paired("delay-ef", "sync")
    pgap, pgap_std, _ = paired("delay-wp", "sync")
    s = row["settings"]
    row["gap"], row["gap_std"] = gap, gap_std
    row["corrected_gap"], row["corrected_gap_std"] = cgap, cgap_std
    row["predicted_gap"], row["predicted_gap_std"] = pgap, pgap_std
    row["recovered"] = recovered_share(s["sync"]["mean"], s["delay"]["mean"],
                                       s["delay-ef"]["mean"])
    row["recovered_wp"] = recovered_share(s["sync"]["mean"], s["delay"]["mean"],
                                          s["delay-wp"]["mean"])
    # The gap at every evaluation both curves share: how it changes with the horizon.
    gap_curve = {}
    sync_curve = row["curves"].get("sync", {})
    for setting in ("delay", "delay-ef", "delay-wp"):
      other = row["curves"].get(setting, {})
      gap_curve[setting] = {k: other[k] - sync_curve[k] for k in sync_curve if k in other}
    row["gap_curve"] = gap_curve
    table[opt] = row
  return {"params": params, "tokens_per_step": tokens_per_step,
          "tokens_per_param_per_step": tokens_per_step / params if params else None,
          "optimizers": table}


def _with_std(x: Optional[float], std: Optional[float], fmt: str, nonfinite: str) -> str:
  if x is None:
    return "—"
  if not math.isfinite(x):
    return nonfinite
  return format(x, fmt) + (f" ± {std:.4f}" if std is not None else "")


def _cell_text(entry: dict[str, Any]) -> str:
  return _with_std(entry["mean"], entry["std"], ".4f", "diverged")


def _gap_text(gap: Optional[float], std: Optional[float]) -> str:
  return _with_std(gap, std, "+.4f", "n/a")


def _recovered_text(rec: Optional[float], gap: Optional[float]) -> str:
  no_gap = gap is not None and math.isfinite(gap) and gap <= 0
  return f"{100 * rec:.0f}%" if rec is not None else ("n/a (no gap)" if no_gap else "—")


def markdown_table(summary: dict[str, Any]) -> str:
  """The results table: final validation loss per setting, gaps and recovered share.

  Columns for weight prediction (delay-wp) appear when any optimizer has them.
  """
  wp = any(row["settings"].get("delay-wp", {}).get("n") for row in summary["optimizers"].values())
  head = ("| optimizer | lr | synchronous | delayed | delayed + EF | gap (delayed − sync) "
          "| corrected gap (EF − sync) | recovered |")
  lines = [head + (" delayed + WP | WP − sync | recovered by WP |" if wp else ""),
           "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if wp else "")]
  for opt, row in summary["optimizers"].items():
    s = row["settings"]
    lr = fmt_lr(row["lr"]) if row["lr"] is not None else "—"
    line = (f"| {opt} | {lr} | {_cell_text(s['sync'])} | {_cell_text(s['delay'])} | "
            f"{_cell_text(s['delay-ef'])} | {_gap_text(row['gap'], row['gap_std'])} | "
            f"{_gap_text(row['corrected_gap'], row['corrected_gap_std'])} | "
            f"{_recovered_text(row['recovered'], row['gap'])} |")
    if wp:
      line += (f" {_cell_text(s['delay-wp'])} | "
               f"{_gap_text(row['predicted_gap'], row['predicted_gap_std'])} | "
               f"{_recovered_text(row['recovered_wp'], row['gap'])} |")
    lines.append(line)
  return "\n".join(lines)


def gap_length_table(summary: dict[str, Any], columns: int = 6) -> str:
  """The gap (delayed − sync / corrected − sync) at a few points of the horizon."""
  per_step = summary["tokens_per_param_per_step"] or 0.0
  steps = set()
  for row in summary["optimizers"].values():
    steps |= set(row["gap_curve"].get("delay", {}))
  steps = sorted(k for k in steps if k > 0)
  if not steps:
    return ""
  pick = sorted({steps[round(i * (len(steps) - 1) / max(1, columns - 1))]
                 for i in range(min(columns, len(steps)))})
  head = " | ".join(f"step {k} ({k * per_step:.1f} tok/param)" for k in pick)
  lines = [f"| optimizer | gap | {head} |", "|---|---|" + "---|" * len(pick)]
  for opt, row in summary["optimizers"].items():
    for setting, label in (("delay", "delayed − sync"), ("delay-ef", "EF − sync"),
                           ("delay-wp", "WP − sync")):
      curve = row["gap_curve"].get(setting, {})
      if setting == "delay-wp" and not curve:
        continue
      cells = " | ".join(f"{curve[k]:+.4f}" if k in curve else "—" for k in pick)
      lines.append(f"| {opt} | {label} | {cells} |")
  return "\n".join(lines)


def plot_results(summary: dict[str, Any], out: str) -> list[str]:
  """val_curves.png (a panel per optimizer) and gap_vs_length.png; returns their paths."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  per_step = summary["tokens_per_param_per_step"] or 1.0
  opts = list(summary["optimizers"])
  colors = {"sync": "tab:blue", "delay": "tab:red", "delay-ef": "tab:green",
            "delay-wp": "tab:purple"}
  cols = 2 if len(opts) > 1 else 1
  rows = math.ceil(len(opts) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), dpi=110, squeeze=False)
  for i, opt in enumerate(opts):
    ax = axes[i // cols][i % cols]
    row = summary["optimizers"][opt]
    tops, lows = [], []
    for setting, curve in row["curves"].items():
      xs = [int(k) * per_step for k in curve]
      ys = list(curve.values())
      ax.plot(xs, ys, marker="o", markersize=3, color=colors[setting],
              label=SETTING_LABELS[setting])
      finite = [y for x, y in zip(xs, ys) if math.isfinite(y)]
      lows += finite
      # Leave the first tenth of training off the y range: its losses dwarf the gaps.
      late = [y for x, y in zip(xs, ys) if math.isfinite(y) and x >= 0.1 * max(xs)]
      tops += late or finite
    if lows and tops:
      lo, hi = min(lows), max(tops)
      ax.set_ylim(lo - 0.05 * (hi - lo + 1e-3), hi + 0.05 * (hi - lo + 1e-3))
    lr = fmt_lr(row["lr"]) if row["lr"] is not None else "?"
    ax.set_title(f"{opt} (lr {lr})")
    ax.set_xlabel("tokens per parameter")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
  for j in range(len(opts), rows * cols):
    axes[j // cols][j % cols].axis("off")
  fig.tight_layout()
  curves_png = os.path.join(out, "val_curves.png")
  fig.savefig(curves_png)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
  palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, opt in enumerate(opts):
    for setting, style, label in (("delay", "-", "delayed − sync"),
                                  ("delay-ef", "--", "delayed+EF − sync"),
                                  ("delay-wp", ":", "delayed+WP − sync")):
      curve = summary["optimizers"][opt]["gap_curve"].get(setting, {})
      ks = sorted(k for k in curve if k > 0)
      if ks:
        ax.plot([k * per_step for k in ks], [curve[k] for k in ks], style, marker="o",
                markersize=3, color=palette[i % len(palette)], label=f"{opt}: {label}")
  gap_png = os.path.join(out, "gap_vs_length.png")
  _save_gap_plot(plt, fig, ax, "tokens per parameter", "validation-loss gap to synchronous",
                 "The delay's gap against training length", gap_png)
  return [curves_png, gap_png]


def run_info(cells: Sequence[Cell], tokens_per_step: int) -> list[dict[str, Any]]:
  """Per cell: its settings, final validation loss, training wall time and tokens per second."""
  out = []
  for c in cells:
    _, val, times = read_records(c.run_dir)
    steady = sorted(times[1:])  # the first step of a process includes compilation
    median = steady[len(steady) // 2] if steady else None
    out.append({"name": c.name, "optimizer": c.optimizer, "setting": c.setting, "seed": c.seed,
                "lr": c.lr, "steps": c.steps, "final_val_loss": val.get(c.steps),
                "wall_s": round(marker_wall(c), 1),
                "tokens_per_s": round(tokens_per_step / median) if median else None,
                "run_dir": os.path.relpath(c.run_dir, ROOT)})
  return out


def write_json(path: str, data: dict[str, Any]) -> None:
  """Writes JSON atomically; non-finite floats become null."""
  def clean(x):
    if isinstance(x, float) and not math.isfinite(x):
      return None
    if isinstance(x, dict):
      return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [clean(v) for v in x]
    return x
  with open(path + ".tmp", "w") as f:
    json.dump(clean(data), f, indent=1)
  os.replace(path + ".tmp", path)


def size_summary(results: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
  """Per optimizer that every study has, smallest model first: parameters, rate, finals,
  gaps, shares."""
  order = sorted(range(len(results)), key=lambda i: results[i]["summary"]["params"])
  common = [o for o in results[order[0]]["summary"]["optimizers"]
            if all(o in r["summary"]["optimizers"] for r in results)]
  rows: dict[str, list[dict[str, Any]]] = {}
  for i in order:
    res = results[i]
    summary, meta = res["summary"], res.get("meta", {})
    for opt in common:
      row = summary["optimizers"][opt]
      s = row["settings"]
      rows.setdefault(opt, []).append({
          "study": names[i], "params": summary["params"], "lr": row["lr"],
          "tokens_per_param": meta.get("tokens_per_param"),
          "epochs": meta.get("epochs"),
          "sync": s["sync"]["mean"], "delay": s["delay"]["mean"],
          "delay_ef": s["delay-ef"]["mean"], "gap": row["gap"],
          "corrected_gap": row["corrected_gap"], "recovered": row["recovered"]})
  return {"optimizers": rows}


def size_table(summary: dict[str, Any]) -> str:
  """The gap-against-size table: one row per optimizer and model size."""
  lines = ["| optimizer | parameters | tokens/param | lr | synchronous | delayed | delayed + EF "
           "| gap | corrected gap | recovered |", "|---|---|---|---|---|---|---|---|---|---|"]
  num = lambda x: "—" if x is None else f"{x:.4f}"
  for opt, rows in summary["optimizers"].items():
    for r in rows:
      tpp = "—" if r["tokens_per_param"] is None else f"{r['tokens_per_param']:.1f}"
      lines.append(f"| {opt} | {r['params']:,} | {tpp} | "
                   f"{fmt_lr(r['lr']) if r['lr'] else '—'} | {num(r['sync'])} | "
                   f"{num(r['delay'])} | {num(r['delay_ef'])} | {_gap_text(r['gap'], None)} | "
                   f"{_gap_text(r['corrected_gap'], None)} | "
                   f"{_recovered_text(r['recovered'], r['gap'])} |")
  return "\n".join(lines)


def plot_sizes(summary: dict[str, Any], path: str) -> None:
  """gap_vs_size.png: the delayed and corrected gaps against parameters (log axis)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
  palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (opt, rows) in enumerate(summary["optimizers"].items()):
    for key, style, label in (("gap", "-", "delayed − sync"),
                              ("corrected_gap", "--", "delayed+EF − sync")):
      pts = [(r["params"], r[key]) for r in rows if r[key] is not None]
      if pts:
        ax.plot(*zip(*pts), style, marker="o", color=palette[i % len(palette)],
                label=f"{opt}: {label}")
  ax.set_xscale("log")
  _save_gap_plot(plt, fig, ax, "parameters", "final validation-loss gap to synchronous",
                 "The delay's gap against model size", path)


def _save_gap_plot(plt, fig, ax, xlabel: str, ylabel: str, title: str, path: str) -> None:
  """Finishes a plot of gaps (a zero line, labels, a legend if any) and writes it."""
  ax.axhline(0.0, color="black", linewidth=0.8)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def fmt_num(x: Optional[float]) -> str:
  """A loss to 8 decimals, or 'missing' for None."""
  return "missing" if x is None else f"{x:.8f}"


def compare_check(sim: Cell, pipe: Cell, rtol: float) -> dict[str, Any]:
  """Per-step training losses of the simulated and the 2bw run, and their largest difference."""
  a, va, _ = read_records(sim.run_dir)
  b, vb, _ = read_records(pipe.run_dir)
  steps = list(range(sim.steps))
  missing = [k for k in steps if k not in a or k not in b]
  rel = [abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in steps if k in a and k in b]
  worst = max(rel) if rel else math.inf
  passed = not missing and all(math.isfinite(a[k]) for k in steps) and worst <= rtol
  return {"optimizer": sim.optimizer, "lr": sim.lr, "steps": sim.steps, "rtol": rtol,
          "max_rel_diff": worst, "passed": passed, "missing_steps": missing,
          "sim_losses": [a.get(k) for k in steps], "pipe_losses": [b.get(k) for k in steps],
          "sim_val_loss": va.get(sim.steps), "pipe_val_loss": vb.get(pipe.steps),
          "sim_dir": os.path.relpath(sim.run_dir, ROOT),
          "pipe_dir": os.path.relpath(pipe.run_dir, ROOT)}
