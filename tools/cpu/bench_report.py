"""The benchmark's report: its tables, the speed-up targets it checks, the sweep plot, the machine.

`tools/cpu/bench_pipeline.py` measures; this formats what it measured.
"""

from __future__ import annotations

import os
import platform
from typing import Any, Optional, Sequence


def _table(columns: Sequence[str], align: str, lines: Sequence[str]) -> str:
  """A markdown table: a header of `columns`, each aligned by `align` ('l' or 'r'), then `lines`."""
  rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
  return "\n".join(["| " + " | ".join(columns) + " |", rule, *lines])


def two_core_table(rows: list[dict[str, Any]]) -> str:
  """Markdown: speed-up of each schedule on two cores over one device on one core.

  Where the rows carry several sets of processes (`per_instance`), a column
  gives each set's median beside the pooled one.
  """
  labels = {"none": "none (the reference: one device on one core)",
            "ceiling": "ceiling (2 devices of one process, no collective)",
            "hardware": "hardware (2 one-device processes at once)"}
  lines = []
  sets = any(r.get("per_instance") for r in rows)
  for r in rows:
    if r["target"] is None:
      target = "-"
    else:
      status = "PASS" if r["speedup"] >= r["target"] else "MISS"
      target = f">= {r['target']:.2f}x {status}"
    name = labels.get(r["schedule"], r["schedule"])
    if name.startswith("none ["):
      name += " (one device, against none)"
    lines.append(
        f"| {r['vocab']} | {name} | {r['ref_s']:.3f} | "
        f"{r['step_s']:.3f} | {r['speedup']:.2f}x | {r['q1']:.2f}-{r['q3']:.2f} | "
        f"{r['low']:.2f}-{r['high']:.2f} | "
        + (" / ".join(f"{x:.2f}x" for x in r.get("per_instance") or []) + " | " if sets else "")
        + f"{r['bound']:.2f}x | {_share(r)} | "
        f"{target} | {_faults(r.get('faults'))} | "
        f"{r['load_before'].split('/')[0]}-{r['load_after'].split('/')[0]} |")
  return _table(["vocabulary", "schedule", "one device s/step", "two cores s/step",
                 "speed-up (median)", "quartiles", "min-max"]
                + (["median of each set of processes"] if sets else [])
                + ["bubble bound", "share of the ceiling", "target", "page faults per step",
                   "load (1 min)"],
                "llrrrrr" + ("r" if sets else "") + "rrlrl", lines)


def _faults(n: Optional[float]) -> str:
  """A median count of page faults per step, with the memory they touched (4 KiB pages)."""
  if n is None:
    return "-"
  return f"{n:,.0f} ({n * 4096 / 2**20:.0f} MiB)" if n >= 256 else f"{n:.0f}"


def _share(row: dict[str, Any]) -> str:
  """The row's speed-up over the ceiling's speed-up x its bubble share, as a percentage."""
  ceiling = row.get("ceiling")
  if not ceiling or row["schedule"].split(" [")[0] in ("none", "ceiling", "hardware"):
    return "-"
  return f"{row['speedup'] / (ceiling * row['bound'] / 2):.0%}"


# The account's parts, gathered into the columns of `account_tables`.
_GROUPS = (("forward", ("forward",)), ("backward", ("backward",)),
           ("weight gradient (zb1's W)", ("weight_grad",)), ("head", ("head",)),
           ("embedding", ("embed", "embed_grad")), ("update", ("grad_reduce", "optimizer")),
           ("other", ("other",)))


def account_tables(accounts: dict[str, Any]) -> str:
  """Markdown: where each configuration's step went, per device, in ms (`tools/cpu/account.py`).

  The first table gives compute by phase, time in collectives (moving data,
  and waiting for the other devices to arrive), idle time inside the step and
  the host's gap before it; they add up to the traced step, shown beside the
  step as the host measured it. The second splits the collectives by phase;
  the third counts them (`transfers_table`).
  """
  main, coll = [], []
  phases = ("embed", "head", "embed_grad", "send", "grad_reduce", "optimizer", "other")
  for label, acc in accounts.items():
    for device, parts in sorted(acc["devices"].items()):
      ms = lambda keys: sum(parts.get(k, 0.0) for k in keys) / 1e3
      cols = [ms(keys) for _, keys in _GROUPS]
      moving = ms([p for p in parts if p.endswith(" collective")])
      waiting = ms([p for p in parts if p.endswith(" wait")])
      rest = [moving, waiting, ms(["idle"]), ms(["host gap"])]
      total = sum(cols) + sum(rest)
      main.append(f"| {label} | {device} | " + " | ".join(f"{c:.1f}" for c in cols + rest)
                  + f" | {total:.1f} | {acc['measured_us'] / 1e3:.1f} |")
      coll.append(f"| {label} | {device} | " + " | ".join(
          f"{ms([p + ' collective']):.1f} / {ms([p + ' wait']):.1f}" for p in phases) + " |")
  first = _table(["configuration", "device", *(g for g, _ in _GROUPS), "collectives",
                  "waiting at collectives", "idle", "host gap", "sum", "step (host clock)"],
                 "ll" + "r" * (len(_GROUPS) + 6), main)
  second = _table(["configuration", "device",
                   *(f"{p} (moving / waiting)" for p in phases)], "ll" + "r" * len(phases), coll)
  return (first + "\n\nCollectives by phase, ms per step (moving data / waiting):\n\n" + second
          + "\n\n" + transfers_table(accounts))


def _device_key(device: Any) -> tuple[str, int]:
  """Orders devices 0, 1, ..., 10 (and p0, p1 of processes) by their number, not as text."""
  text = str(device)
  digits = text.lstrip("abcdefghijklmnopqrstuvwxyz")
  return text[:len(text) - len(digits)], int(digits) if digits.isdigit() else -1


def transfers_table(accounts: dict[str, Any]) -> str:
  """Markdown: each configuration's collectives per device and step, by kind, as executed.

  Count / KiB: for `collective-permute` what the device sent (point to
  point), for the other kinds the size of their result on the device
  (`account.hlo_transfers` (tools/cpu/account.py)); means over the traced steps.
  """
  kinds = sorted({k for acc in accounts.values()
                  for per in acc.get("transfers", {}).values() for k in per})
  lines = []
  for label, acc in accounts.items():
    for device, per in sorted(acc.get("transfers", {}).items(), key=lambda kv: _device_key(kv[0])):
      cells = [f"{per[k]['count']:g} / {per[k]['bytes'] / 1024:.1f}" if k in per else "0"
               for k in kinds]
      lines.append(f"| {label} | {device} | " + " | ".join(cells) + " |")
  return ("Collectives per step as executed, count / KiB (collective-permute: sent by the "
          "device; the others: their result on it):\n\n"
          + _table(["configuration", "device", *kinds], "ll" + "r" * len(kinds), lines))


def _mib(n: int) -> str:
  return f"{n / 2 ** 20:.2f}"


def _frac(x: Optional[float]) -> str:
  return "n/a" if x is None else f"{x:.1%}"


def step_table(rows: list[dict[str, Any]]) -> str:
  """Markdown: wall and CPU step time, ratios, bubble, ticks and cores busy per schedule."""
  two = {r["schedule"]: r for r in rows}.get("2bw", {})
  lines = []
  for r in rows:
    head = f"| {r['schedule']} | {r['ticks']:g} | {_frac(r['bubble'])} |"
    if "skipped" in r:
      lines.append(f"{head} {r['skipped']} | | | | | | |")
      continue
    wall = f"{two['step_s'] / r['step_s']:.2f}" if "step_s" in two else "-"
    cpu = f"{two['cpu_s'] / r['cpu_s']:.2f}" if "cpu_s" in two else "-"
    lines.append(f"{head} {r['step_s']:.3f} | {r['step_min_s']:.3f}-{r['step_max_s']:.3f} | "
                 f"{wall} | {r['cpu_s']:.3f} | {cpu} | {r['cores']:.2f} | "
                 f"{r['compile_s']:.1f} ({r['compile_cpu_s']:.1f}) |")
  return _table(["schedule", "step cost (F+B ticks)", "bubble (timetable)",
                 "wall s/step (median)", "min-max", "2bw / this (wall)", "CPU s/step (median)",
                 "2bw / this (CPU)", "cores busy", "compile s (CPU s)"], "lrrrrrrrrr", lines)


def memory_table(rows: list[dict[str, Any]]) -> str:
  """Markdown: XLA's memory analysis of each compiled step, MiB per device."""
  keys = ("argument", "output", "alias", "temp", "resident")
  lines = ["| " + " | ".join([r["schedule"], *(_mib(r["memory"][k]) for k in keys)]) + " |"
           for r in rows if "memory" in r]
  return _table(["schedule", "arguments", "outputs", "aliased (donated)", "temporaries",
                 "resident (arg + out - alias + temp)"], "lrrrrr", lines)


def compile_table(rows: list[dict[str, Any]]) -> str:
  """Markdown: 2bw lowering and compile time against M."""
  first = rows[0]
  lines = [f"| {r['microbatches']} | {r['lower_s']:.2f} | {r['compile_s']:.1f} | "
           f"{r['compile_cpu_s']:.1f} | {r['compile_s'] / first['compile_s']:.2f} | "
           f"{r['compile_cpu_s'] / first['compile_cpu_s']:.2f} | {_mib(r['memory']['temp'])} |"
           for r in rows]
  return _table(["M", "lower (s)", "compile wall (s)", "compile CPU (s)", "wall / first",
                 "CPU / first", "temporaries (MiB)"], "rrrrrrr", lines)


def target_table(rows: list[dict[str, Any]]) -> str:
  """Markdown: one line per target, judged on wall-clock and on CPU time."""
  lines = []
  for t in rows:
    pred = "-" if t["predicted"] is None else f"{t['predicted']:.2f}"
    lines.append(f"| {t['target']} | <= {t['limit']} | {pred} | {t['wall']:.2f} | "
                 f"{t['status']} ({t['wall'] / t['limit'] - 1:+.0%}) | {t['cpu']:.2f} | "
                 f"{t['cpu_status']} ({t['cpu'] / t['limit'] - 1:+.0%}) |")
  return _table(["target", "limit", "tick-count prediction", "wall-clock", "result (wall)",
                 "CPU time", "result (CPU)"], "lrrrlrl", lines)


def sweep_table(rows: list[dict[str, Any]]) -> str:
  """Markdown: one line per (S, M, schedule) of the sweep."""
  ratio = lambda a, b, k: f"{a[k] / b[k]:.2f}" if a and b else "-"
  lines = []
  for (s_, m), group in _groups(rows):
    by = {r["schedule"]: r for r in group if "step_s" in r}
    two, none = by.get("2bw"), by.get("none")
    for r in group:
      head = f"| {s_} | {m} | {r['schedule']} | {r['ticks']:g} | {_frac(r['bubble'])} |"
      if "step_s" not in r:
        lines.append(f"{head} {r.get('skipped', '-')} | | | | |")
        continue
      lines.append(f"{head} {r['step_s']:.3f} | {r['cpu_s']:.3f} | {ratio(two, r, 'step_s')} | "
                   f"{ratio(two, r, 'cpu_s')} | {ratio(r, none, 'cpu_s')} |")
  return _table(["S", "M", "schedule", "ticks", "bubble (timetable)", "wall s/step",
                 "CPU s/step", "2bw / this (wall)", "2bw / this (CPU)", "this / none (CPU)"],
                "rrlrrrrrrr", lines)


def _groups(rows: list[dict[str, Any]]) -> list[tuple[tuple[int, int], list[dict[str, Any]]]]:
  keys = []
  for r in rows:
    k = (r["stages"], r["microbatches"])
    if k not in keys:
      keys.append(k)
  return [(k, [r for r in rows if (r["stages"], r["microbatches"]) == k]) for k in keys]


COLORS = {"none": "#7f7f7f", "gpipe": "#4c72b0", "1f1b": "#dd8452", "2bw": "#55a868",
          "pipedream": "#c44e52", "interleaved": "#8172b3", "zb1": "#937860"}
# Schedules with equal curves (1f1b and pipedream bubbles; none and 2bw at 0)
# stay visible: wide translucent lines under narrow dotted ones.
STYLES = {"none": dict(marker="o", linestyle="--", linewidth=1.2),
          "gpipe": dict(marker="s", linestyle="-", linewidth=1.6),
          "1f1b": dict(marker="D", linestyle="-", linewidth=4.0, alpha=0.55),
          "2bw": dict(marker="^", linestyle="-", linewidth=4.0, alpha=0.7),
          "pipedream": dict(marker="x", linestyle=":", linewidth=1.6),
          "interleaved": dict(marker="v", linestyle="-.", linewidth=1.6),
          "zb1": dict(marker="P", linestyle="--", linewidth=1.6)}


def draw_sweep(rows: list[dict[str, Any]], out: str, title: str) -> str:
  """PNG: per S, wall and CPU step time and bubble against M, a line per schedule."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  stages = sorted({r["stages"] for r in rows})
  ms = sorted({r["microbatches"] for r in rows})
  fig, axes = plt.subplots(len(stages), 3, figsize=(15, 3.8 * len(stages)), squeeze=False)
  for i, s_ in enumerate(stages):
    for name in dict.fromkeys(r["schedule"] for r in rows):
      pts = [r for r in rows if r["stages"] == s_ and r["schedule"] == name]
      timed = [r for r in pts if "step_s" in r]
      base = name.split()[0]   # 'interleaved v4' is drawn in interleaved's colour
      style = dict(color=COLORS[base], label=name, **STYLES[base])
      if name.endswith(" v4"):
        style["linestyle"] = ":"
      x = [r["microbatches"] for r in timed]
      if timed:
        axes[i, 0].errorbar(x, [r["step_s"] for r in timed], capsize=2,
                            yerr=[[r["step_s"] - r["step_min_s"] for r in timed],
                                  [r["step_max_s"] - r["step_s"] for r in timed]], **style)
        axes[i, 1].plot(x, [r["cpu_s"] for r in timed], **style)
      valid = [r for r in pts if r["bubble"] is not None]
      axes[i, 2].plot([r["microbatches"] for r in valid], [100 * r["bubble"] for r in valid],
                      **style)
    labels = ("wall-clock s per step (median, bars min-max)", "CPU s per step (median)",
              "steady-state bubble (% of slots)")
    for j, ylabel in enumerate(labels):
      ax = axes[i, j]
      ax.set_xscale("log", base=2)
      ax.set_xticks(ms)
      ax.set_xticklabels([str(m) for m in ms])
      ax.set_xlabel("microbatches per step M (global batch grows with M)")
      ax.set_ylabel(ylabel, fontsize=9)
      ax.set_title(f"S={s_} stages", fontsize=10)
      ax.grid(alpha=0.3)
    axes[i, 0].legend(fontsize=8)
    axes[i, 2].legend(fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def machine(emulated: bool = True) -> str:
  """One line on the host: CPU, cores, JAX version (and this process's emulated devices)."""
  import jax  # pylint: disable=g-import-not-at-top
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    cpu = names[0] if names else cpu
  except OSError:
    pass
  line = f"{cpu}; {os.cpu_count()} cores; jax {jax.__version__}"
  if emulated:
    line += f"; {jax.device_count()} emulated {jax.default_backend()} devices"
  return line


def load() -> str:
  """`os.getloadavg()` as text (1, 5, 15 minutes)."""
  return "/".join(f"{x:.2f}" for x in os.getloadavg())
