#!/usr/bin/env python3
"""What XLA's CPU buffers cost in page faults, alone: glibc's defaults against train.py's tuning.

A jitted function whose only large buffer is a temporary (the [n, n] float32
product t = x @ x.T of an [n, 8] input, of which it returns the sum of
t + t.T; XLA's temporary block for it is twice t) is called again and again on one
CPU device; each call's temporary is malloc'ed and freed by XLA's runtime.
For each size it runs in a fresh process three times: with glibc's malloc as
it comes, and as `train.py` sets it for a CPU run (`jaxpipe.accel.tune_cpu_malloc`)
in a process of one device (one arena for every thread) and of several (an
arena per thread).
It prints, per size and setting, the median time of a call and the median
page faults the process took per call (each a 4 KiB page the kernel zeroed).
A pipeline step does the same with its buffers (docs/benchmark.md).

  taskset -c 0 .venv/bin/python tools/bench_malloc.py --calls 20
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpipe.cli import Parser  # pylint: disable=g-import-not-at-top,wrong-import-position

# The mode's name, and `tune_cpu_malloc`'s one_arena (None: not tuned).
MODES = {"glibc defaults": None, "tuned, one arena": True, "tuned, an arena per thread": False}


def worker(size_mib: int, calls: int, mode: str) -> dict:
  """Runs in a fresh process: {"ms": median ms per call, "faults": median faults per call, ...}.

  `mode` is a key of MODES.
  """
  from jaxpipe import accel  # pylint: disable=g-import-not-at-top
  one_arena = MODES[mode]
  applied = None if one_arena is None else accel.tune_cpu_malloc(one_arena=one_arena)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  n = int((size_mib * 2**20 / 4) ** 0.5)
  x = jax.random.normal(jax.random.key(0), (n, 8), jnp.float32)

  def f(x):
    t = x @ x.T  # the dot's output is a buffer of its own: t + t.T reads it twice
    return (t + t.T).sum()
  f = jax.jit(f)
  for _ in range(3):
    f(x).block_until_ready()
  ms, faults = [], []
  for _ in range(calls):
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    f(x).block_until_ready()
    ms.append((time.perf_counter() - t0) * 1e3)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
  return {"size_mib": size_mib, "n": n, "tuned": applied, "ms": statistics.median(ms),
          "faults": statistics.median(faults)}


def measure(size_mib: int, calls: int, mode: str) -> dict:
  """`worker` in a fresh process (glibc's options are per process)."""
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                        json.dumps([size_mib, calls, mode])],
                       capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _sizes(text: str) -> list[int]:
  try:
    sizes = [int(v) for v in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected MiB sizes such as 16,48,96; got {text!r}")
  if not sizes or min(sizes) < 1:
    raise argparse.ArgumentTypeError(f"sizes must be >= 1 MiB, got {text!r}")
  return sizes


def main(argv=None) -> int:
  parser = Parser(prog="bench_malloc", description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", type=_sizes, default=[8, 16, 24, 48, 96],
                      help="MiB of t, comma-separated (default 8,16,24,48,96)")
  parser.add_argument("--calls", type=int, default=20, help="timed calls per process (default 20)")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    print(json.dumps(worker(*json.loads(args.worker))), flush=True)
    return 0
  if args.calls < 3:
    print(f"bench_malloc: --calls must be >= 3, got {args.calls}", file=sys.stderr)
    return 2
  print(f"load average: {'/'.join(f'{v:.2f}' for v in os.getloadavg())}; {args.calls} calls "
        "after 3 warm-up, one device, one XLA thread\n")
  print("| t (MiB) | malloc | ms per call (median) | page faults per call (median) | "
        "MiB faulted in per call |")
  print("|---:|---|---:|---:|---:|")
  for size in args.sizes:
    for mode in MODES:
      r = measure(size, args.calls, mode)
      print(f"| {size} | {mode} | {r['ms']:.2f} | {r['faults']:,.0f} | "
            f"{r['faults'] * 4096 / 2**20:.0f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
