"""What each mode writes: results and sweep files, their invocation journal, the size report."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from typing import Any, Optional, Sequence

from jaxpipe import config as config_lib
from jaxpipe.errors import InputError
from jaxpipe.study._cells import (
    ROOT, StudyError, Cell, say, fmt_lr, fmt_duration, git_commit, machine, read_records, Plan)
from jaxpipe.study._results import (
    summarize, markdown_table, gap_length_table, plot_results, run_info, write_json,
    size_summary, size_table, plot_sizes)

# --- modes ------------------------------------------------------------------------


def _invocation(args: argparse.Namespace, t0: float, outcome: dict[str, str],
                finished: bool) -> dict[str, Any]:
  """What this invocation of the tool was and did: command, time, machine, commit, runs."""
  return {"command": shlex.join([os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "",
                                 *sys.argv[1:]]),
          "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t0)),
          "t0": t0, "elapsed_s": round(time.time() - t0, 1), "finished": finished,
          "jaxpipe_commit": git_commit(), "machine": machine(), "jobs": args.jobs,
          "threads": args.threads,
          "runs": {s: sum(v == s for v in outcome.values())
                   for s in ("done", "failed", "interrupted")}}


def journal_path(result_path: str) -> str:
  """The file beside a result file that lists the invocations behind it as they run."""
  head, name = os.path.split(result_path)
  return os.path.join(head, f".{os.path.splitext(name)[0]}.invocations.json")


def read_history(result_path: str) -> list[dict[str, Any]]:
  """The invocations behind a result file: its journal, else the result file's own list."""
  for path, from_meta in ((journal_path(result_path), False), (result_path, True)):
    try:
      with open(path) as f:
        data = json.load(f)
    except (OSError, ValueError):
      continue
    return list((data.get("meta", {}) if from_meta else data).get("invocations", []))
  return []


def journal_update(result_path: str, args: argparse.Namespace, t0: float,
                   outcome: dict[str, str], finished: bool) -> list[dict[str, Any]]:
  """Records this invocation (identified by its start time) in the journal; returns the list.

  Written when the invocation starts and after every run that ends, so one that
  is killed outright (SIGKILL, a machine restart) still leaves its command and
  its elapsed time up to its last finished run, marked as not finished.
  """
  history = [h for h in read_history(result_path) if h.get("t0") != t0]
  history.append(_invocation(args, t0, outcome, finished))
  os.makedirs(os.path.dirname(result_path) or ".", exist_ok=True)
  write_json(journal_path(result_path), {"invocations": history})
  return history


def _epochs(cfg: config_lib.Config, tokens: int) -> Optional[float]:
  """Passes over the training split that `tokens` make (None if the data cannot be read)."""
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  try:
    return round(tokens / trainer.open_data(cfg).num_tokens("train"), 3)
  except (InputError, OSError):
    return None


def study_meta(args: argparse.Namespace, t0: float, outcome: dict[str, str], plan: Plan,
               params: int, steps: int, path: str) -> dict[str, Any]:
  """The study's scale and every invocation that trained into it.

  A sweep finished over several invocations (interrupted and resumed) keeps
  each one's command and elapsed time, from the journal beside `path`;
  `--report` adds none, as it trains nothing.
  """
  if args.report:
    history = read_history(path)
  else:
    history = journal_update(path, args, t0, outcome, finished=True)
  return {"config": os.path.relpath(plan.config_path, ROOT), "overrides": list(plan.extra),
          "params": params, "steps": steps, "tokens_per_step": plan.tokens_per_step(),
          "tokens_per_param": round(steps * plan.tokens_per_step() / params, 2) if params else None,
          "epochs": _epochs(plan.base, steps * plan.tokens_per_step()),
          "invocations": history,
          "elapsed_total_s": round(sum(h["elapsed_s"] for h in history), 1)}


def _how_it_ran(meta: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
  """Markdown lines: the command, times, jobs, machine and commit behind a result."""
  history = meta["invocations"]
  if not history:
    return ["- no training invocation is recorded (the runs were made elsewhere)"]
  last = history[-1]
  m = last["machine"]
  wall = sum(r["wall_s"] for r in runs)
  # Records from before the journal existed have no "finished" key; they were written at the end.
  cut = sum(not h.get("finished", True) for h in history)
  note = (f", {cut} of them stopped before the end (counted up to their last finished run)"
          if cut else "")
  lines = [f"- command: `{last['command']}`",
           f"- elapsed: {fmt_duration(meta['elapsed_total_s'])} over {len(history)} "
           f"invocation(s){note} (the last one {fmt_duration(last['elapsed_s'])}); the runs' "
           f"own wall time sums to {fmt_duration(wall)} over {len(runs)} runs",
           f"- jobs: {last['jobs']} x {'1 thread' if last['threads'] == 1 else 'all threads'}",
           f"- machine: {m['cpu']}, {m['usable_cpus']} usable CPUs, {m['platform']}, "
           f"jax {m['jax']}; load average {m.get('load_avg_1m', '?')} at the end",
           f"- jaxpipe commit: {last['jaxpipe_commit']}"]
  return lines


def report_study(args, plan: Plan, cells: Sequence[Cell], optimizers, seeds, params: int,
                 steps: int, t0: float, outcome: dict[str, str]) -> dict[str, Any]:
  """Writes results.json, results.md and the two PNGs of the study under plan.out."""
  summary = summarize(cells, optimizers, seeds, params, plan.tokens_per_step())
  meta = study_meta(args, t0, outcome, plan, params, steps, os.path.join(plan.out, "results.json"))
  check_path = os.path.join(plan.out, "check_2bw.json")
  check = None
  if os.path.exists(check_path):
    with open(check_path) as f:
      check = json.load(f)
  result = {"meta": meta, "seeds": list(seeds), "summary": summary,
            "runs": run_info(cells, plan.tokens_per_step()), "check_2bw": check}
  os.makedirs(plan.out, exist_ok=True)
  write_json(os.path.join(plan.out, "results.json"), result)
  pngs = plot_results(summary, plan.out)
  text = [
      "# Delay study results", "",
      f"{len(optimizers)} optimizers x {len({c.setting for c in cells})} settings x "
      f"{len(seeds)} seed(s); "
      f"{params:,} parameters, {steps} steps x {plan.tokens_per_step():,} tokens = "
      f"{meta['tokens_per_param']} tokens per parameter, {meta.get('epochs')} epochs of the "
      "training split. Final validation loss "
      "(nats per byte-token)" + (", mean ± std over seeds" if len(seeds) > 1 else "") + ".", "",
      markdown_table(summary), "",
      "Recovered = (delayed − corrected) / (delayed − synchronous); WP = weight prediction "
      "(`optimizer.weight_prediction=1`).", "",
      "## Gap against training length", "", gap_length_table(summary), "",
      f"![validation curves]({os.path.basename(pngs[0])})", "",
      f"![gap against length]({os.path.basename(pngs[1])})", "",
      "## How it was run", "",
      *_how_it_ran(meta, result["runs"]),
  ]
  if check is not None:
    text.append(f"- 2bw check ({check['optimizer']}, delayed + EF, {check['steps']} steps): "
                f"max relative difference {check['max_rel_diff']:.2e}, "
                f"{'passed' if check['passed'] else 'FAILED'}")
  with open(os.path.join(plan.out, "results.md"), "w") as f:
    f.write("\n".join(text) + "\n")
  return result


def report_sweep(args, plan: Plan, cells: Sequence[Cell], optimizers, params: int, steps: int,
                 t0: float, outcome: dict[str, str]) -> dict[str, Any]:
  """Writes lr_sweep.json and lr_sweep.md: final val loss per rate, best rate per optimizer."""
  losses: dict[str, dict[str, Optional[float]]] = {}
  best, edge = {}, {}
  for opt in optimizers:
    mine = [c for c in cells if c.optimizer == opt]
    losses[opt] = {}
    for c in mine:
      _, val, _ = read_records(c.run_dir)
      losses[opt][fmt_lr(c.lr)] = val.get(c.steps)
    finite = [(v, c.lr) for c in mine
              if (v := losses[opt][fmt_lr(c.lr)]) is not None and math.isfinite(v)]
    if finite:
      _, lr = min(finite)
      best[opt] = lr
      grid = [c.lr for c in mine]
      edge[opt] = len(grid) > 1 and lr in (min(grid), max(grid))
  meta = study_meta(args, t0, outcome, plan, params, steps, os.path.join(plan.out, "lr_sweep.json"))
  data = {"meta": meta, "steps": steps, "val_loss": losses, "best": best, "at_edge": edge,
          "runs": run_info(cells, plan.tokens_per_step())}
  os.makedirs(plan.out, exist_ok=True)
  write_json(os.path.join(plan.out, "lr_sweep.json"), data)
  lines = ["# Learning-rate sweep (synchronous, seed 0)", "",
           f"{steps} steps = {meta['tokens_per_param']} tokens per parameter. The study reads "
           "the best rates with `--lr from-sweep`.", "",
           "| optimizer | lr | final val loss | |", "|---|---|---|---|"]
  for opt in optimizers:
    for lr, v in losses[opt].items():
      mark = "best" if opt in best and fmt_lr(best[opt]) == lr else ""
      if mark and edge.get(opt):
        mark += " (at the grid's edge: widen the grid)"
      text = "—" if v is None else ("diverged" if not math.isfinite(v) else f"{v:.4f}")
      lines.append(f"| {opt} | {lr} | {text} | {mark} |")
  lines += ["", "## How it was run", "", *_how_it_ran(meta, data["runs"])]
  with open(os.path.join(plan.out, "lr_sweep.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  for opt in optimizers:
    if opt in best:
      note = "  <- at the grid's edge; widen the grid" if edge[opt] else ""
      say(f"best lr {opt}: {fmt_lr(best[opt])}{note}")
  return data


def report_sizes(args: argparse.Namespace) -> int:
  """The --size-report mode: reads each study's results.json, writes sizes.{md,json,png}."""
  dirs = [d for d in args.size_report.split(",") if d.strip()]
  if len(dirs) < 2:
    raise StudyError("--size-report: give at least two study directories, comma-separated")
  results = []
  for d in dirs:
    path = os.path.join(d, "results.json")
    try:
      with open(path) as f:
        results.append(json.load(f))
    except (OSError, ValueError) as e:
      raise StudyError(f"--size-report: cannot read {path} ({e}); run the study there first")
  summary = size_summary(results, dirs)
  os.makedirs(args.out, exist_ok=True)
  write_json(os.path.join(args.out, "sizes.json"), summary)
  plot_sizes(summary, os.path.join(args.out, "gap_vs_size.png"))
  table = size_table(summary)
  with open(os.path.join(args.out, "sizes.md"), "w") as f:
    f.write("# The delay's gap against model size\n\n" + table +
            "\n\n![gap against size](gap_vs_size.png)\n\nStudies: " + ", ".join(dirs) + "\n")
  say(table)
  say(f"wrote {os.path.join(args.out, 'sizes.md')}, sizes.json, gap_vs_size.png")
  return 0
