"""Kills training runs at random moments and checks that rerunning continues exactly.

  python tools/kill_stress.py --trials 9 --seed 0 [key=value ...]

Each trial runs the same train.py command (configs/tiny.yaml, 2bw on 2 stages,
Muon with the error-feedback correction, a checkpoint every 3 of 14 steps,
unless overridden), sends SIGKILL after 1 to 9 training records plus a random
delay of up to 0.6 s (a third of the trials are killed twice), then runs the
command again to the end and compares every training and validation loss
with an uninterrupted run's, bit for bit. It prints one line per trial and a
summary (trials that continued exactly, tracebacks seen, the load average);
the exit status is 1 if any trial did not continue exactly.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from jaxpipe import runs  # pylint: disable=g-import-not-at-top,wrong-import-position
BASE = ["run.steps=14", "checkpoint.every=3", "eval.every=7", "pipeline.schedule=2bw",
        "pipeline.stages=2", "optimizer.name=muon", "optimizer.error_feedback=1"]


def _command(run_dir: str, overrides: list[str]) -> list[str]:
  return [sys.executable, os.path.join(ROOT, "train.py"), "--config",
          os.path.join(ROOT, "configs", "tiny.yaml"), f"run.dir={run_dir}", *BASE, *overrides]


def _records(run_dir: str) -> list[dict]:
  return runs.read_records(run_dir)  # a line cut short by the kill is skipped


def _losses(run_dir: str) -> tuple[dict, dict]:
  recs = _records(run_dir)
  return ({r["step"]: r["loss"] for r in recs if "loss" in r},
          {r["step"]: r["val_loss"] for r in recs if "val_loss" in r})


def _killed_attempt(run_dir: str, overrides: list[str], after: int, delay: float) -> str:
  """Starts the command, SIGKILLs it `delay` s after its `after`-th new record; its stderr."""
  before = sum("loss" in r for r in _records(run_dir))
  with tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen(_command(run_dir, overrides), stdout=subprocess.DEVNULL,
                            stderr=err, text=True, cwd=ROOT)
    try:
      while proc.poll() is None:
        if sum("loss" in r for r in _records(run_dir)) >= before + after:
          time.sleep(delay)
          break
        time.sleep(0.005)
      if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
      proc.wait(timeout=120)
    finally:
      if proc.poll() is None:
        proc.kill()
    err.seek(0)
    return err.read()


def main(argv: list[str] | None = None) -> int:
  """Runs the trials and prints what each showed."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--trials", type=int, default=9)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--keep", default="",
                      help="copy the run directory and stderr of every failed trial here")
  parser.add_argument("overrides", nargs="*", help="config overrides for every run")
  args = parser.parse_args(argv)
  rng = random.Random(args.seed)
  work = tempfile.mkdtemp(prefix="kill_stress-")
  try:
    ref = os.path.join(work, "reference")
    p = subprocess.run(_command(ref, args.overrides), capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
      print(f"kill_stress: the uninterrupted run failed: {p.stderr.strip()[-500:]}",
            file=sys.stderr)
      return 2
    want = _losses(ref)
    exact = tracebacks = 0
    for t in range(args.trials):
      run_dir = os.path.join(work, f"trial{t}")
      kills = [(rng.randint(1, 9), rng.uniform(0, 0.6))]
      if t % 3 == 2:
        kills.append((rng.randint(1, 4), rng.uniform(0, 0.6)))
      errs = [_killed_attempt(run_dir, args.overrides, a, d) for a, d in kills]
      p = subprocess.run(_command(run_dir, args.overrides), capture_output=True, text=True,
                         cwd=ROOT)
      errs.append(p.stderr)
      same = p.returncode == 0 and _losses(run_dir) == want
      traced = any("Traceback" in e for e in errs)
      exact += same
      tracebacks += traced
      if args.keep and (traced or not same):
        kept = os.path.join(args.keep, f"trial{t}")
        shutil.copytree(run_dir, kept, dirs_exist_ok=True)
        for i, e in enumerate(errs):
          with open(os.path.join(kept, f"stderr{i}.txt"), "w") as f:
            f.write(e)
      how = ("resumed" if "resuming from" in p.stderr else
             "started over" if "starting over" in p.stderr else "?")
      print(f"trial {t}: killed after " + ", then ".join(f"{a} records + {d:.2f} s"
                                                         for a, d in kills)
            + f"; rerun {how}, exit {p.returncode}; "
            + ("exact" if same else "DIFFERENT") + ("; TRACEBACK" if traced else "")
            + ("" if p.returncode == 0 else f": {p.stderr.strip().splitlines()[-1][:300]}"),
            flush=True)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{exact} of {args.trials} trials continued bit-exactly; {tracebacks} with a "
          f"traceback; load average {load}")
    return 0 if exact == args.trials and not tracebacks else 1
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
