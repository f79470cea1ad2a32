#!/usr/bin/env python3
"""When does 2BW pay? Time to a target validation loss per schedule and optimizer, on two cores.

  python tools/time_to_loss.py                         # the default study, ~20 min on 2 quiet cores
  python tools/time_to_loss.py --report --markdown docs/time_to_quality.md   # tables from the JSON
  python tools/time_to_loss.py --report --target 2.1   # another target, nothing rerun

Trains one model (`configs/delay_study.yaml`, 230,080 parameters) on the
same tokens in several cells, each a `train.py` process with
`pipeline.stages=2`, pinned to two cores with `taskset` (a stage per core,
one XLA thread per device: `XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`,
and the CPU tuning, `run.launch_hooks=tools.cpu.tuning`), as
`tools/cpu/bench_train_steps.py` runs train.py. A cell is
SCHEDULE-OPTIMIZER[-ef]: 1f1b, interleaved (v=2), zb1 and 2bw, each with
Muon and with AdamW, and 2bw with the error-feedback correction
(`optimizer.error_feedback=1`, the delay study's c) for both. Each optimizer
runs at the delay study's tuned rate for this model (`TUNED_LRS`,
docs/delay_study.md: AdamW and Muon 0.012); `--lr` overrides. Every run uses
`pipeline.microbatches` = --microbatches (8), `pipeline.stash=residuals`
and the study's batch (32 x 64 tokens).

The target (default) is the validation loss that the reference (1f1b-muon)
reaches after --steps steps, the mean over seeds: its final loss in a run of
--steps steps. Every run trains --overrun (2) times as long, so that cells
that need more steps (a delayed one) can reach it, at a constant rate after
a warmup of 5% of --steps: a run's first --steps steps are then exactly the
run of --steps steps. (The delay study decays its rate with a cosine; a
cosine spans the run, so a longer run would not contain the shorter one.)
Rounds run the cells once per seed, each round in an order rotated by one,
so that the machine's drift falls on every cell; JAX's compilation cache
(`run.compile_cache`) is shared, so the second seed compiles nothing.

Wall clock. A run's clock at an evaluation is the sum of the `step_time_s`
of the steps before it (`jaxpipe.time_to_loss.counted_step_times`): the
steps before step 3 (compilation, the first dispatches) and each step whose
interval holds an evaluation count as the run's median step. Start-up,
compilation and evaluations are left out: they cost every cell alike and
are not training. The time and the steps to the target are interpolated
linearly between evaluations (every --eval-every steps), per seed and on the
seeds' mean curve (mean loss and mean clock at each evaluation); the table
gives the mean curve's, each seed's, and the ratio to the reference.

Output in --out: OUT/CELL-sSEED/ (the runs), OUT/time_to_loss.json (every
run's step times and validation curve, the settings, the summary, the
projection to S = 2, 4, 8, 16 stages and M = S, 2S, 4S, 8S microbatches, and
the projection's check at the measured S=2), OUT/time_to_loss.md (the
tables) and OUT/time_to_loss.png (validation loss against the clock and
against steps; matplotlib is a dependency). `--report` recomputes all of it
from the JSON alone, `--markdown FILE` writes the tables into FILE between
its two marker lines (`jaxpipe.time_to_loss.BEGIN`, `END`).

Resuming: running the same command again keeps every run already in the
JSON (or finished in its folder) and trains only the others; a run killed
part-way starts over (its step times would include a second compilation).
A folder or JSON run made with other settings is refused.

Size of the default (estimated from one 80-step run of 1f1b-muon at this
shape, pinned to both cores of this 2-core machine on 2026-12-07, load
average 0.6-3.3 from other users): median step 0.157 s; 23 s for the first
step (compilation, cold cache); 14 s of start-up, evaluations and the final
save. A run of 200 steps: ~14 + 3 (20 evaluations) + 32 s of steps, plus
~23 s of compilation on the first seed and ~5 s on the second (cached): ~72
and ~54 s. 10 cells x 2 seeds: ~21 minutes on a quiet machine; 2bw's steps
are ~0.9 of 1f1b's, and other users' load lengthens it.

Bad input exits with status 2 and one line on stderr; a failed run, 1 (its
log is named); an interrupt, 130 (run the same command to go on).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu"))
# pylint: disable=g-import-not-at-top,wrong-import-position
from bench_common import two_cores
from jaxpipe import config as config_lib
from jaxpipe import runs as runs_lib
from jaxpipe import time_to_loss as ttl
from jaxpipe.cli import Parser
from jaxpipe.errors import InputError
from jaxpipe.study import git_commit, machine
# pylint: enable=g-import-not-at-top,wrong-import-position

DEFAULT_CELLS = ("1f1b-muon", "1f1b-adamw", "interleaved-muon", "interleaved-adamw", "zb1-muon",
                 "zb1-adamw", "2bw-muon", "2bw-adamw", "2bw-muon-ef", "2bw-adamw-ef")
# The delay study's rates for configs/delay_study.yaml, each tuned synchronously
# (docs/delay_study.md, "Results: seven optimizers").
TUNED_LRS = {"adamw": 0.012, "muon": 0.012, "mars": 0.012, "normuon": 0.012, "soap": 0.006,
             "adan": 0.048, "lion": 0.001}
# Keys the tool sets for every run; a positional override of one is refused.
CONTROLLED = ("run.dir", "run.steps", "run.seed", "run.compile_cache", "run.launch_hooks",
              "run.progress", "pipeline.schedule", "pipeline.stash",
              "pipeline.stages", "pipeline.microbatches", "pipeline.virtual_stages",
              "optimizer.name", "optimizer.lr", "optimizer.error_feedback", "optimizer.delay",
              "optimizer.schedule", "optimizer.warmup_steps", "eval.every", "checkpoint.every")
# The CPU tuning the two-core benchmark runs with (tools/cpu/tuning.py).
HOOKS = "tools.cpu.tuning"
MARKER = "time_to_loss_run.json"
RESULT = "time_to_loss.json"
VIRTUAL_STAGES = 2


class RunFailed(RuntimeError):
  """A train.py run exited with an error."""


def say(msg: str) -> None:
  print(msg, flush=True)


# --- the runs -------------------------------------------------------------------------


def run_overrides(args, cell: ttl.CellName, seed: int) -> list[str]:
  """The train.py overrides of one run, but its folder and cache (see `command`)."""
  lr = args.lrs.get(cell.optimizer)
  return [
      "pipeline.stages=2", f"pipeline.schedule={cell.schedule}",
      f"pipeline.microbatches={args.microbatches}", "pipeline.stash=residuals",
      f"pipeline.virtual_stages={VIRTUAL_STAGES if cell.schedule == 'interleaved' else 1}",
      f"optimizer.name={cell.optimizer}", *([f"optimizer.lr={lr:g}"] if lr else []),
      f"optimizer.error_feedback={1 if cell.error_feedback else 0}", "optimizer.delay=0",
      "optimizer.schedule=constant", f"optimizer.warmup_steps={math.ceil(0.05 * args.steps)}",
      f"run.steps={args.steps_per_run}", f"run.seed={seed}", "run.progress=false",
      f"eval.every={args.eval_every}", "checkpoint.every=0", f"run.launch_hooks={HOOKS}",
      *args.overrides]


def command(args, overrides: list[str], run_dir: str) -> tuple[list[str], dict[str, str]]:
  """(argv, environment) of a run pinned to the two cores, one XLA thread per device."""
  cmd = ["taskset", "-c", ",".join(args.cores), sys.executable, os.path.join(ROOT, "train.py"),
         "--config", args.config, *overrides, f"run.dir={run_dir}",
         f"run.compile_cache={os.path.join(args.out, '.jax_cache')}"]
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_multi_thread_eigen" not in flags:
    flags = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()
  return cmd, dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")


def read_run(run_dir: str, cell: str, seed: int, steps: int,
             overrides: list[str]) -> Optional[dict[str, Any]]:
  """A finished run's record for the JSON (step times, validation curve); None if unfinished."""
  times: list[Optional[float]] = [None] * steps
  val = []
  for rec in runs_lib.read_records(run_dir):
    if "val_loss" in rec:
      val.append([rec["step"], rec["val_loss"]])
    elif "loss" in rec and 0 <= rec["step"] < steps:
      times[rec["step"]] = rec.get("step_time_s")
  if not any(s == steps for s, _ in val):
    return None
  return {"cell": cell, "seed": seed, "steps": steps, "step_time_s": times,
          "val": sorted(val), "overrides": overrides}


def existing(args, name: str, run_dir: str, overrides: list[str],
             done: dict[str, dict]) -> Optional[dict[str, Any]]:
  """A run already made with these overrides (in the JSON, or finished in its folder), or None.

  Raises InputError for a run or folder made otherwise; a folder of this
  tool's that did not finish is removed, to start over.
  """
  if name in done:
    if done[name].get("overrides") != overrides:
      raise InputError(f"{os.path.join(args.out, RESULT)} holds run {name} made with other "
                       "settings; use another --out")
    return done[name]
  if not os.path.isdir(run_dir):
    return None
  marker = os.path.join(run_dir, MARKER)
  if not os.path.isfile(marker):
    raise InputError(f"{run_dir} exists but was not made by this tool; use another --out")
  with open(marker) as f:
    if json.load(f).get("overrides") != overrides:
      raise InputError(f"{run_dir} was made with other settings; use another --out, or delete it")
  cell, _, seed = name.rpartition("-s")
  found = read_run(run_dir, cell, int(seed), args.steps_per_run, overrides)
  if found is None:
    shutil.rmtree(run_dir)
  return found


def train(args, name: str, run_dir: str, overrides: list[str]) -> dict[str, Any]:
  """Runs one train.py process to the end; its record for the JSON (RunFailed otherwise)."""
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, MARKER), "w") as f:
    json.dump({"tool": "tools/time_to_loss.py", "run": name, "overrides": overrides}, f)
  cmd, env = command(args, overrides, run_dir)
  log = os.path.join(run_dir, "train.log")
  t0 = time.time()
  with open(log, "w") as out:
    done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                          check=False)
  cell, _, seed = name.rpartition("-s")
  rec = read_run(run_dir, cell, int(seed), args.steps_per_run, overrides)
  if done.returncode != 0 or rec is None:
    with open(log) as f:
      tail = [l.strip() for l in f if l.strip()][-1:] or ["(no output)"]
    raise RunFailed(f"{name} exited {done.returncode}: {tail[0][:200]} (log {log})")
  rec["wall_s"] = round(time.time() - t0, 2)
  return rec


def run_all(args, result: dict[str, Any]) -> None:
  """Trains every run not done yet, round by round (a round per seed, its order rotated)."""
  cells = args.cells
  plan = []
  for seed in range(args.seeds):
    k = seed % len(cells)
    for cell in cells[k:] + cells[:k]:
      name = f"{cell.name}-s{seed}"
      overrides = run_overrides(args, cell, seed)
      run_dir = os.path.join(args.out, name)
      found = existing(args, name, run_dir, overrides, result["runs"])
      if found is not None:
        result["runs"][name] = found
      else:
        plan.append((name, run_dir, overrides))
  say(f"{len(cells) * args.seeds} runs of {args.steps_per_run} steps: "
      f"{len(cells) * args.seeds - len(plan)} done already, {len(plan)} to train")
  write_json(args.out, result)
  t0 = time.time()
  for i, (name, run_dir, overrides) in enumerate(plan, 1):
    rec = train(args, name, run_dir, overrides)
    result["runs"][name] = rec
    write_json(args.out, result)
    final = rec["val"][-1][1]
    say(f"[{i}/{len(plan)}] {name}: final val {final:.4f}, {rec['wall_s']:.0f} s "
        f"(elapsed {time.time() - t0:.0f} s)")


# --- the report -----------------------------------------------------------------------


def read_json(path: str) -> dict[str, Any]:
  """OUT/time_to_loss.json as written so far ({"runs": {}} when there is none yet)."""
  if not os.path.exists(path):
    return {"tool": "tools/time_to_loss.py", "runs": {}}
  try:
    with open(path) as f:
      result = json.load(f)
  except (OSError, ValueError) as e:
    raise InputError(f"{path} cannot be read as JSON ({e}); move it away to start over") \
        from None
  if not isinstance(result, dict) or not isinstance(result.get("runs"), dict):
    raise InputError(f"{path} is not this tool's JSON (no runs); use another --out")
  return result


def write_json(out: str, result: dict[str, Any]) -> None:
  """Writes OUT/time_to_loss.json atomically (a kill leaves the previous one)."""
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, RESULT)
  with open(path + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
  os.replace(path + ".tmp", path)


def report(result: dict[str, Any], reference: str, target: Optional[float]) -> None:
  """Fills the result's target, summary, S=2 check and projection from its runs."""
  s = result["settings"]
  if target is None:
    target = ttl.target_from(result["runs"], reference, s["steps"])
    seeds = len({r["seed"] for r in result["runs"].values() if r["cell"] == reference})
    result["target_source"] = (f"{reference}'s validation loss after {s['steps']} steps, mean of "
                               f"{seeds} seed{'s' if seeds > 1 else ''}: its final loss in a run "
                               f"of {s['steps']} steps")
  else:
    result["target_source"] = "given by --target"
  result["summary"] = ttl.summarize(result["runs"], target, reference)
  result["check"] = ttl.check_two_stages(result["summary"], s["microbatches"], VIRTUAL_STAGES)
  result["projection"] = ttl.project(result["summary"], ttl.default_points(),
                                     virtual_stages=VIRTUAL_STAGES)


def plot(result: dict[str, Any], path: str) -> None:
  """Validation loss against the clock (left) and steps (right): each seed thin, the mean thick."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(13, 5), dpi=110, sharey=True)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  by_cell: dict[str, list] = {}
  for run in result["runs"].values():
    by_cell.setdefault(run["cell"], []).append(ttl.curve(run))
  for i, (cell, curves) in enumerate(by_cell.items()):
    color, mean = colors[i % len(colors)], ttl.mean_curve(curves)
    style = "--" if ttl.CellName.parse(cell).delayed else "-"
    for ax, x in zip(axes, ("seconds", "steps")):
      for c in curves:
        ax.plot(getattr(c, x), c.val, color=color, alpha=0.3, linewidth=0.7, linestyle=style)
      ax.plot(getattr(mean, x), mean.val, color=color, linewidth=1.6, linestyle=style,
              label=cell)
  for ax, label in zip(axes, ("wall clock, s (counted step time)", "step")):
    ax.axhline(result["summary"]["target"], color="black", linewidth=0.8, linestyle=":")
    ax.set_xlabel(label)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("validation loss")
  low = result["summary"]["target"]
  axes[0].set_ylim(low - 0.3, low + 1.2)
  axes[1].legend(fontsize=8)
  fig.suptitle(f"time to val loss {low:.4f} (dotted), two cores, S=2")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def finish(args, result: dict[str, Any]) -> None:
  """Computes the report, writes the JSON, the tables (and --markdown), the plot; prints."""
  report(result, args.reference, args.target)
  if not args.report or "commit" not in result:
    # The runs' commit and machine: a --report, which trains nothing, keeps them.
    result["commit"], result["machine"] = git_commit(), machine()
  write_json(args.out, result)
  tables = ttl.markdown(result)
  with open(os.path.join(args.out, "time_to_loss.md"), "w") as f:
    f.write(tables + "\n")
  if args.markdown:
    write_markdown(args.markdown, tables)
  plot(result, os.path.join(args.out, "time_to_loss.png"))
  say(ttl.measured_table(result["summary"]) + "\n\n" + ttl.check_table(result["check"]))
  say(f"wrote {os.path.join(args.out, RESULT)}, time_to_loss.md, time_to_loss.png"
      + (f" and the tables of {args.markdown}" if args.markdown else ""))


def write_markdown(path: str, tables: str) -> None:
  """The tables into `path` between its marker lines, or a new file of them alone."""
  if os.path.exists(path):
    with open(path) as f:
      text = ttl.replace_tables(f.read(), tables)
  else:
    text = tables + "\n"
  with open(path, "w") as f:
    f.write(text)


# --- the command line -----------------------------------------------------------------


def parse_args(argv: Optional[list[str]]):
  """The command line (see the module docstring); InputError for bad values."""
  p = Parser(prog="time_to_loss", description=__doc__.split("\n")[0])
  p.add_argument("--out", default=os.path.join("runs", "time_to_loss"), help="runs and results")
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "delay_study.yaml"))
  p.add_argument("--cells", default=",".join(DEFAULT_CELLS),
                 help="comma-separated SCHEDULE-OPTIMIZER[-ef] (default: %(default)s)")
  p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 of every cell (default 2)")
  p.add_argument("--steps", type=int, default=100,
                 help="the reference's run length: the target is its loss there (default 100)")
  p.add_argument("--overrun", type=float, default=2.0,
                 help="every run trains this many times --steps (default 2)")
  p.add_argument("--eval-every", type=int, default=10, help="steps between evaluations (10)")
  p.add_argument("--microbatches", type=int, default=8, help="pipeline.microbatches (8)")
  p.add_argument("--cores", default="0,1", help="the two cores to pin to (default 0,1)")
  p.add_argument("--lr", default="", help="optimizer=rate,... over the tuned rates")
  p.add_argument("--reference", default=ttl.REFERENCE, help="the target's cell (1f1b-muon)")
  p.add_argument("--target", type=float, default=None, help="a target loss instead")
  p.add_argument("--report", action="store_true", help="only recompute the report from the JSON")
  p.add_argument("--markdown", default=None, help="write the tables into this file too")
  p.add_argument("overrides", nargs="*", help="config overrides (KEY=VALUE) for every run")
  args = p.parse_args(argv)
  _check(args)
  return args


def _check(args) -> None:
  """Validates and completes the parsed arguments (InputError for bad input)."""
  args.out, args.config = os.path.abspath(args.out), os.path.abspath(args.config)
  args.cells = [ttl.CellName.parse(c.strip()) for c in args.cells.split(",") if c.strip()]
  if not args.cells or len({c.name for c in args.cells}) != len(args.cells):
    raise InputError("--cells: name each cell once, at least one")
  for key, low in (("seeds", 1), ("eval_every", 1), ("microbatches", 2)):
    if getattr(args, key) < low:
      raise InputError(f"--{key.replace('_', '-')} must be >= {low}, got {getattr(args, key)}")
  if args.steps < ttl.FIRST_TIMED + 2 or args.steps % args.eval_every:
    raise InputError(f"--steps must be a multiple of --eval-every ({args.eval_every}) and at "
                     f"least {ttl.FIRST_TIMED + 2}, got {args.steps}")
  if not args.overrun >= 1:
    raise InputError(f"--overrun must be >= 1, got {args.overrun}")
  args.steps_per_run = math.ceil(args.steps * args.overrun / args.eval_every) * args.eval_every
  try:  # a --report trains nothing: any machine may write it
    args.cores = args.cores.split(",") if args.report else two_cores(args.cores)
  except ValueError as e:
    raise InputError(str(e)) from None
  bad = [o for o in args.overrides if "=" not in o or o.split("=", 1)[0].strip() in CONTROLLED]
  if bad:
    raise InputError(f"override {bad[0]!r} is not KEY=VALUE or is a key the tool sets "
                     "(use --steps, --microbatches, --lr, --cells, --eval-every)")
  if args.target is None and not args.report and args.reference not in {
      c.name for c in args.cells}:
    raise InputError(f"--reference {args.reference} is not among --cells; add it, name another "
                     "with --reference, or give --target")
  args.lrs = dict(TUNED_LRS)
  for item in filter(None, args.lr.split(",")):
    name, _, value = (x.strip() for x in item.partition("="))
    try:
      args.lrs[name] = float(value)
    except ValueError:
      raise InputError(f"--lr: {item!r} is not optimizer=rate") from None
    if name not in {c.optimizer for c in args.cells} or not args.lrs[name] > 0:
      raise InputError(f"--lr: {item!r} names no optimizer of --cells, or a rate <= 0")


def main(argv: Optional[list[str]] = None) -> int:
  """Trains what is missing (unless --report), then writes the report; the exit status."""
  try:
    args = parse_args(argv)
    result = read_json(os.path.join(args.out, RESULT))
    if args.report and not result["runs"]:
      raise InputError(f"--report: no runs in {os.path.join(args.out, RESULT)}; run the "
                       "study first")
    if not args.report:
      for cell in args.cells:  # every run's config must load before anything starts
        config_lib.load(args.config, run_overrides(args, cell, 0))
      result["settings"] = {
          "config": os.path.relpath(args.config, ROOT), "steps": args.steps,
          "steps_per_run": args.steps_per_run, "eval_every": args.eval_every,
          "microbatches": args.microbatches, "virtual_stages": VIRTUAL_STAGES,
          "lrs": args.lrs, "overrides": args.overrides, "cores": list(args.cores)}
      run_all(args, result)
    finish(args, result)
  except InputError as e:
    print(f"time_to_loss: {e}", file=sys.stderr)
    return 2
  except RunFailed as e:
    print(f"time_to_loss: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print("time_to_loss: interrupted; run the same command to go on", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
