#!/usr/bin/env python3
"""The delay study: synchronous, one-step-delayed and corrected training, per optimizer.

  python tools/delay_study.py --lr-sweep          # tune each optimizer's rate, synchronously
  python tools/delay_study.py --lr from-sweep     # the study: optimizers x settings x seeds
  python tools/delay_study.py --check-2bw         # one cell against a real 2bw pipeline
  python tools/delay_study.py --report            # tables and plots from the runs on disk

Every cell is an ordinary `train.py` run of `configs/delay_study.yaml` (or
`--config`) with a fixed token budget, in its own run directory
`OUT/<optimizer>-<setting>-s<seed>`, so `tools/plot_loss.py` reads it. The
settings are `sync` (no delay), `delay` (`optimizer.delay=1`: the one-step
gradient delay of PipeDream-2BW, simulated on one device) and `delay-ef` (the
same with the error-feedback correction, `optimizer.error_feedback=1`);
`--settings` adds `delay-wp` (the delay with weight prediction,
`optimizer.weight_prediction=1`: gradients taken at w + (w - w_prev)).

The study writes OUT/results.md and OUT/results.json (final validation loss
per optimizer and setting, the gap delayed - synchronous, the corrected gap,
and the share of the gap that the correction recovers,
(delayed - corrected) / (delayed - synchronous)), OUT/val_curves.png and
OUT/gap_vs_length.png (the gap at every evaluation, against tokens per
parameter). `--lr-sweep` writes OUT/lr_sweep.json, whose best rates
`--lr from-sweep` reads. `--check-2bw` trains one cell both in the simulation
and as a `pipeline.schedule=2bw` run on 2 emulated stages and compares their
per-step losses.

Running the same command again resumes: finished runs (their final validation
record exists) are kept, runs with a checkpoint continue from it through the
trainer's own resume, and the tool's own runs that left metrics but no
checkpoint start over. Exit status: 0 done, 1 some run failed or the 2bw check
disagreed, 2 bad input (one line on stderr), 130 interrupted (rerun to resume).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# pylint: disable=g-import-not-at-top,wrong-import-position
from jaxpipe import config as config_lib
from jaxpipe.errors import InputError
from jaxpipe.study import (
    CONTROLLED, DEFAULT_CONFIG, DEFAULT_LRS, DEFAULT_OPTIMIZERS, DEFAULT_SETTINGS, OPTIMIZERS,
    Plan, Runner, StudyError, cell_state, check_cells, compare_check, count_params,
    fmt_duration, fmt_lr, journal_update, markdown_table, parse_lrs, parse_optimizers,
    parse_settings, read_records, report_sizes, report_study, report_sweep, study_cells,
    sweep_cells, write_json, say, study_meta, fmt_num)
# pylint: enable=g-import-not-at-top,wrong-import-position


# --- command line -------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise StudyError(f"{message} (usage: python tools/delay_study.py [--lr-sweep | "
                     "--check-2bw | --report] [options] [key=value ...])")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  """The command line; see the module docstring."""
  p = _Parser(description=__doc__.split("\n\n")[0])
  mode = p.add_mutually_exclusive_group()
  mode.add_argument("--lr-sweep", action="store_true",
                    help="sweep each optimizer's rate (synchronous, seed 0, --sweep-steps)")
  mode.add_argument("--check-2bw", action="store_true",
                    help="compare one delayed+EF cell with a real 2bw run on 2 emulated stages")
  mode.add_argument("--report", action="store_true",
                    help="only rebuild the tables and plots from the runs on disk")
  mode.add_argument("--size-report", default="", metavar="OUT1,OUT2,...",
                    help="the gap against model size, from the results.json of studies of "
                         "several sizes (each its own --out); writes OUT/sizes.md, "
                         "sizes.json and gap_vs_size.png")
  p.add_argument("--config", default=DEFAULT_CONFIG, help="base config (model, data, schedule)")
  p.add_argument("--out", default=os.path.join("runs", "delay_study"),
                 help="directory of the run directories and results")
  p.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS),
                 help=f"comma-separated, of {', '.join(OPTIMIZERS)} (default "
                      f"{','.join(DEFAULT_OPTIMIZERS)})")
  p.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                 help="comma-separated, of sync, delay, delay-ef, delay-wp (weight prediction); "
                      f"default {','.join(DEFAULT_SETTINGS)}")
  p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 of every cell")
  p.add_argument("--steps", type=int, default=0, help="steps of a study run; 0 = the config's")
  p.add_argument("--evals", type=int, default=15,
                 help="validation passes per run (the points of the gap-vs-length curve)")
  p.add_argument("--lr", "--lrs", dest="lr", default="",
                 help="'from-sweep' (the best rates of --sweep-json) or optimizer=rate,... "
                      "(the others keep their defaults; in --lr-sweep mode, the grid centres)")
  p.add_argument("--sweep-json", default="", help="the sweep's JSON; default OUT/lr_sweep.json")
  p.add_argument("--sweep-points", type=int, default=5, help="rates per optimizer in the sweep")
  p.add_argument("--sweep-factor", type=float, default=2.0,
                 help="ratio between neighbouring rates of the sweep's log grid")
  p.add_argument("--sweep-steps", type=int, default=0,
                 help="steps of a sweep run; 0 = half the study's")
  p.add_argument("--check-steps", type=int, default=30, help="steps of the 2bw check")
  p.add_argument("--check-optimizer", default="muon", help="optimizer of the 2bw check")
  p.add_argument("--check-microbatches", type=int, default=2,
                 help="microbatches of both check runs (2bw on 2 stages needs >= 2)")
  p.add_argument("--check-rtol", type=float, default=1e-5,
                 help="largest relative difference of per-step losses that passes")
  p.add_argument("--jobs", type=int, default=2, help="training processes at a time")
  p.add_argument("--threads", type=int, default=-1, choices=(-1, 0, 1),
                 help="1 = each process single-threaded on its own core, 0 = XLA's default "
                      "(all cores); -1 = 1 when --jobs > 1, else 0")
  p.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. model.dim=32")
  args = p.parse_args(argv)
  if args.threads == -1:
    args.threads = 1 if args.jobs > 1 else 0
  for key, low in (("jobs", 1), ("seeds", 1), ("evals", 1), ("sweep_points", 1),
                   ("check_steps", 1), ("check_microbatches", 1)):
    if getattr(args, key) < low:
      raise StudyError(f"--{key.replace('_', '-')} must be >= {low}, got {getattr(args, key)}")
  if args.steps < 0 or args.sweep_steps < 0:
    raise StudyError("--steps and --sweep-steps must be >= 0")
  if not args.sweep_factor > 1:
    raise StudyError(f"--sweep-factor must be > 1, got {args.sweep_factor}")
  for item in args.overrides:
    key = item.split("=", 1)[0].strip()
    if key in CONTROLLED:
      raise StudyError(f"{key} is set by the study for every run; use the tool's own options "
                       "(--steps, --seeds, --lr, --optimizers, --evals) instead")
  return args


def resolve_lrs(args: argparse.Namespace, optimizers: Sequence[str], out: str) -> dict[str, float]:
  """The rate of each optimizer: defaults, explicit --lr, or the sweep's best."""
  lrs = dict(DEFAULT_LRS)
  if args.lr == "from-sweep":
    path = args.sweep_json or os.path.join(out, "lr_sweep.json")
    if not os.path.exists(path):
      raise StudyError(f"--lr from-sweep: {path} does not exist; run --lr-sweep first, "
                       "or pass --sweep-json")
    with open(path) as f:
      best = json.load(f).get("best", {})
    missing = [o for o in optimizers if o not in best]
    if missing:
      raise StudyError(f"--lr from-sweep: {path} has no best rate for {', '.join(missing)}; "
                       "sweep them too, or give --lr explicitly")
    lrs.update({o: float(best[o]) for o in optimizers})
  elif args.lr:
    lrs.update(parse_lrs(args.lr, optimizers))
  return lrs


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the mode that the command line asks for; returns the exit status."""
  t0 = time.time()
  try:
    args = parse_args(argv)
    if args.size_report:
      return report_sizes(args)
    optimizers = parse_optimizers(args.optimizers)
    settings = parse_settings(args.settings)
    config_path = os.path.abspath(args.config)
    base = config_lib.load(config_path, args.overrides)
    out = os.path.abspath(args.out)
    plan = Plan(config_path, base, tuple(args.overrides), out)
    steps = args.steps or base.run.steps
    if args.check_2bw and args.check_optimizer not in OPTIMIZERS:
      raise StudyError(f"--check-optimizer: unknown optimizer '{args.check_optimizer}'; "
                       f"choose from {', '.join(OPTIMIZERS)}")
    lrs = resolve_lrs(args, [args.check_optimizer] if args.check_2bw else optimizers, out)
    if args.check_2bw:
      cells = list(check_cells(plan, args.check_optimizer, lrs[args.check_optimizer],
                               args.check_steps, args.check_microbatches))
    elif args.lr_sweep:
      steps = args.sweep_steps or max(1, steps // 2)
      cells = sweep_cells(plan, optimizers, lrs, args.sweep_points, args.sweep_factor, steps,
                          args.evals)
    else:
      cells = study_cells(plan, optimizers, settings, range(args.seeds), lrs, steps, args.evals)
    for cell in cells:  # every run's config must load before anything starts
      config_lib.load(config_path, cell.overrides)
      cell_state(cell, config_path)
    params = count_params(base)
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  tokens = steps * plan.tokens_per_step()
  say(f"model: {params:,} parameters; {'sweep' if args.lr_sweep else 'study'} runs of "
       f"{steps} steps x {plan.tokens_per_step():,} tokens = {tokens / 1e6:.2f}M tokens = "
       f"{tokens / params:.1f} tokens per parameter" if not args.check_2bw else
       f"2bw check: {args.check_optimizer} lr {fmt_lr(lrs[args.check_optimizer])}, delayed + EF, "
       f"{args.check_steps} steps, M={args.check_microbatches}, simulated vs 2 emulated stages")
  outcome: dict[str, str] = {}
  result_path = os.path.join(out, "check_2bw.json" if args.check_2bw else
                             "lr_sweep.json" if args.lr_sweep else "results.json")
  if not args.report:
    journal_update(result_path, args, t0, {}, finished=False)
    runner = Runner(config_path, jobs=args.jobs, threads=args.threads,
                    cache_dir=os.path.join(out, ".jax_cache"),
                    on_progress=lambda o: journal_update(result_path, args, t0, o, False))
    try:
      outcome = runner.run(cells)
    except KeyboardInterrupt:
      journal_update(result_path, args, t0, runner.outcome, finished=False)
      return 130
    except InputError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  else:
    outcome = {c.name: "done" if c.steps in read_records(c.run_dir)[1] else "missing"
               for c in cells}
  failed = sorted(n for n, v in outcome.items() if v != "done")

  if args.check_2bw:
    sim, pipe = cells
    result = compare_check(sim, pipe, args.check_rtol)
    result["meta"] = study_meta(args, t0, outcome, plan, params, args.check_steps, result_path)
    os.makedirs(out, exist_ok=True)
    write_json(result_path, result)
    verdict = "PASS" if result["passed"] else "FAIL"
    say(f"2bw check: {args.check_steps} steps, largest relative difference of the per-step "
         f"losses {result['max_rel_diff']:.2e} (tolerance {args.check_rtol:.0e}); final val "
         f"{fmt_num(result['sim_val_loss'])} (simulated) vs {fmt_num(result['pipe_val_loss'])} (2bw): "
         f"{verdict}")
    return 0 if result["passed"] else 1
  if args.lr_sweep:
    report_sweep(args, plan, cells, optimizers, params, steps, t0, outcome)
    say(f"wrote {os.path.join(args.out, 'lr_sweep.json')} and lr_sweep.md in "
         f"{fmt_duration(time.time() - t0)}")
  else:
    result = report_study(args, plan, cells, optimizers, range(args.seeds), params, steps, t0,
                          outcome)
    say(markdown_table(result["summary"]))
    say(f"wrote {os.path.join(args.out, 'results.md')}, results.json, val_curves.png, "
         f"gap_vs_length.png in {fmt_duration(time.time() - t0)}")
  if failed and args.report:
    say(f"{len(failed)} run(s) not finished yet: {', '.join(failed[:6])}"
         + (" ..." if len(failed) > 6 else ""))
  elif failed:
    print(f"error: {len(failed)} run(s) did not finish: {', '.join(failed[:6])}"
          + (" ..." if len(failed) > 6 else ""), file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
