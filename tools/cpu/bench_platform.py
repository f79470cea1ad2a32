#!/usr/bin/env python3
"""What this machine's cores give, measured alone: a fixed program on one core, on the other, and on both at once.

  python tools/cpu/bench_platform.py                 # 25 rounds, about two and a half minutes
  python tools/cpu/bench_platform.py --rounds 60 --out-md /tmp/platform.md

Nothing of jaxpipe runs here. Each round starts the same single-threaded
program (a NumPy loop of `tanh(a @ b)` on 192 x 192 float32 matrices, one
BLAS thread, `--work` iterations; about 0.5 MB of matrices, within a
server core's L2 cache, so it measures the core rather than the memory)
three times: pinned alone to the first core, then alone to the second, then
two copies at once, one pinned to each, their clocks started together. It
prints each round, then the spread of the one-core times (the same work, so
any spread is the machine's) and the two-core speed-up per round: twice the
round's mean one-core time over the slower of the two copies. The alone
runs and the pair run at different moments, so where the cores' speed moves
between them a round's speed-up can exceed 2x: that is the spread, not
extra speed. A pipeline's speed-up over one core is a ratio of two such
draws, so this spread bounds how closely any single run of the pipeline
benchmarks can show a target on this machine.

Bad input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
from bench_common import two_cores, write
from bench_report import load
from jaxpipe.cli import Parser
# pylint: enable=g-import-not-at-top,wrong-import-position

# The program each core runs. It says "ready" once NumPy is imported and its
# matrices made, and starts its clock when told: copies started together then
# time the same seconds, not their imports. Its seconds on stdout.
PROGRAM = """
import sys
import time
import numpy as np
a = np.random.default_rng(0).random((192, 192), dtype=np.float32)
b = a.copy()
print("ready", flush=True)
sys.stdin.readline()
t = time.perf_counter()
for _ in range({work}):
  b = np.tanh(a @ b)
print(time.perf_counter() - t)
"""
# One BLAS thread, whichever BLAS NumPy was built with.
_ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_pinned(cores: Sequence[str], work: int) -> list[float]:
  """Seconds each copy of `PROGRAM` took, one copy pinned to each core of `cores`, timed together.

  If a copy fails, the others are stopped before the error is raised.
  """
  env = dict(os.environ, **_ONE_THREAD)
  procs = [subprocess.Popen(["taskset", "-c", c, sys.executable, "-c", PROGRAM.format(work=work)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
           for c in cores]
  try:
    for p in procs:
      if p.stdout.readline().strip() != "ready":
        raise RuntimeError(_failure(p))
    for p in procs:
      p.stdin.write("go\n")
      p.stdin.flush()
    out = []
    for p in procs:
      line = p.stdout.readline()
      if p.wait() != 0 or not line.strip():
        raise RuntimeError(_failure(p))
      out.append(float(line))
    return out
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
      for f in (p.stdin, p.stdout, p.stderr):
        f.close()


def _failure(p: subprocess.Popen) -> str:
  p.wait()
  tail = p.stderr.read().strip().splitlines()[-1:] or ["(no output)"]
  return f"the probe exited {p.returncode}: {tail[0]}"


def _load() -> str:
  """The 1-minute load average (of `bench_report.load`'s three)."""
  return load().split("/")[0]


def measure(rounds: int, cores: tuple[str, str], work: int,
            run: Callable[[Sequence[str], int], list[float]] = run_pinned,
            log=print) -> list[dict]:
  """Per round: {alone: [first core's s, second's], pair: [both at once], speedup, load}."""
  out = []
  for i in range(rounds):
    alone = [run([cores[0]], work)[0], run([cores[1]], work)[0]]
    pair = run(list(cores), work)
    r = {"alone": alone, "pair": pair,
         # The mean, not either core: each core's speed moves by itself (docs/benchmark.md).
         "speedup": 2 * statistics.mean(alone) / max(pair), "load": _load()}
    out.append(r)
    log(f"  round {i + 1}/{rounds} {time.strftime('%H:%M:%S')}: alone {alone[0]:.3f} / "
        f"{alone[1]:.3f} s, both at once {pair[0]:.3f} / {pair[1]:.3f} s, "
        f"two-core speed-up {r['speedup']:.2f}x (load {r['load']})")
  return out


def _spread(xs: list[float]) -> dict:
  q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
  return {"min": min(xs), "q1": q[0], "median": q[1], "q3": q[2], "max": max(xs)}


def summary(rows: list[dict]) -> dict:
  """The spread of the one-core times (both cores' runs alone) and of the two-core speed-up."""
  alone = [t for r in rows for t in r["alone"]]
  return {"alone": _spread(alone), "alone_max_over_min": max(alone) / min(alone),
          "speedup": _spread([r["speedup"] for r in rows]),
          "load": f"{rows[0]['load']}-{rows[-1]['load']}"}


def table(s: dict, rounds: int, work: int) -> str:
  """Markdown: the spreads of `summary`."""
  a, p = s["alone"], s["speedup"]
  return "\n".join([
      f"Fixed single-threaded program ({work} iterations), {rounds} rounds; "
      f"load {s['load']}",
      "",
      "| measure | min | quartile 1 | median | quartile 3 | max |",
      "|---|---:|---:|---:|---:|---:|",
      f"| one core alone, s | {a['min']:.3f} | {a['q1']:.3f} | {a['median']:.3f} | "
      f"{a['q3']:.3f} | {a['max']:.3f} |",
      f"| two cores at once, speed-up | {p['min']:.2f}x | {p['q1']:.2f}x | {p['median']:.2f}x | "
      f"{p['q3']:.2f}x | {p['max']:.2f}x |",
      "",
      f"The same work alone took up to {s['alone_max_over_min']:.2f} times its fastest run."])


def _fail(msg: str) -> None:
  print(f"bench_platform: {msg}", file=sys.stderr)
  sys.exit(2)


def main(argv: Optional[list[str]] = None) -> int:
  """Parses the command line, runs the rounds, prints and writes the table."""
  p = Parser(prog="bench_platform", description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=25, help="rounds (default 25)")
  p.add_argument("--work", type=int, default=10000,
                 help="iterations of the program (default 10000, about 1.5 s on one core)")
  p.add_argument("--cores", default="0,1", help="the two cores to pin to (default 0,1)")
  p.add_argument("--out-md", default=None, help="write the markdown table here")
  args = p.parse_args(argv)
  if args.rounds < 1:
    _fail(f"--rounds must be at least 1, got {args.rounds}")
  if args.work < 1:
    _fail(f"--work must be at least 1, got {args.work}")
  try:
    cores = two_cores(args.cores)
  except ValueError as e:
    _fail(str(e))
  print(f"load average at start: {_load()}", flush=True)
  try:
    rows = measure(args.rounds, cores, args.work)
  except (RuntimeError, ValueError, OSError) as e:
    _fail(str(e))
  out = table(summary(rows), args.rounds, args.work)
  print(out)
  write(out + "\n", args.out_md, print)
  return 0


if __name__ == "__main__":
  sys.exit(main())
