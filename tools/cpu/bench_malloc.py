#!/usr/bin/env python3
"""What XLA's CPU buffers cost in page faults, alone: glibc's defaults against train.py's tuning.

A jitted function whose only large buffer is a temporary (the [n, n] float32
product t = x @ x.T of an [n, 8] input, of which it returns the sum of
t + t.T; XLA's temporary block for it is twice t) is called again and again on one
CPU device; each call's temporary is malloc'ed and freed by XLA's runtime.
For each size it runs in a fresh process three times: with glibc's malloc as
it comes, and as `train.py` sets it for a CPU run (`tuning.tune_cpu_malloc`, with `run.launch_hooks=tools.cpu.tuning`)
in a process of one device (one arena for every thread) and of several (an
arena per thread).
It prints, per size and setting, the median time of a call and the median
page faults the process took per call (each a 4 KiB page the kernel zeroed).
A pipeline step does the same with its buffers (docs/benchmark.md).

  taskset -c 0 .venv/bin/python tools/cpu/bench_malloc.py --calls 20

`--memalign` shows, without XLA, why a tuned process's block can land on
fresh heap for its first few calls (`memalign_walk`).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxpipe.cli import Parser  # pylint: disable=g-import-not-at-top,wrong-import-position

# The mode's name, and `tune_cpu_malloc`'s one_arena (None: not tuned).
MODES = {"glibc defaults": None, "tuned, one arena": True, "tuned, an arena per thread": False}


def worker(size_mib: int, calls: int, mode: str, warmup: int = 12) -> dict:
  """Runs in a fresh process: {"ms": median ms per call, "faults": median faults per call, ...}.

  `mode` is a key of MODES; `warmup` calls come before the timed ones.
  """
  from tools.cpu import tuning  # pylint: disable=g-import-not-at-top
  one_arena = MODES[mode]
  applied = None if one_arena is None else tuning.tune_cpu_malloc(one_arena=one_arena)
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
  # Tuned, a block can still land on fresh heap for the first few calls
  # (glibc parks posix_memalign's leftover beside it in its thread cache, see
  # `memalign_walk`), three to six of them in measure_memalign's runs, and
  # more where other threads' small allocations churn that cache; it then
  # stays. The warm-up outlasts that, as a training run's first steps do.
  for _ in range(warmup):
    f(x).block_until_ready()
  ms, faults = [], []
  for _ in range(calls):
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    f(x).block_until_ready()
    ms.append((time.perf_counter() - t0) * 1e3)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
  return {"size_mib": size_mib, "n": n, "tuned": applied, "ms": statistics.median(ms),
          "faults": statistics.median(faults)}


def measure(size_mib: int, calls: int, mode: str, warmup: int = 12) -> dict:
  """`worker` in a fresh process (glibc's options are per process)."""
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                        json.dumps([size_mib, calls, mode, warmup])],
                       capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def memalign_walk(calls: int) -> list[int]:
  """glibc alone, tuned as `train.py` tunes a process of one device: where each call's block lands.

  Each call does what XLA's runtime does with a step's temporaries: a
  64-byte-aligned 32 MiB block (posix_memalign), a small allocation made
  while it is live that outlives it, then the block's free. Returns, per
  call, the block's offset in MiB from the first call's. glibc serves an
  aligned block by carving a larger chunk and freeing what is left beside
  it; that remainder goes to the thread's cache (tcache) and looks in use
  from there, so the freed block cannot merge with it, stays exactly its
  own size, and the next request (the size plus the alignment's slack)
  does not fit it: the block moves to fresh heap until the cache's bin is
  full. With GLIBC_TUNABLES=glibc.malloc.tcache_count=0 it moves once.
  """
  import ctypes  # pylint: disable=g-import-not-at-top
  libc = ctypes.CDLL(None)
  # By hand, through ctypes: no package binds posix_memalign or mallopt, and
  # `tune_cpu_malloc` sets nothing where GLIBC_TUNABLES is set (the cache-off run).
  libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  from tools.cpu import tuning  # pylint: disable=g-import-not-at-top
  for param, value in {**tuning.CPU_MALLOC, **tuning.ONE_ARENA}.values():
    libc.mallopt(param, value)
  libc.malloc.argtypes, libc.malloc.restype = (ctypes.c_size_t,), ctypes.c_void_p
  libc.free.argtypes = (ctypes.c_void_p,)
  libc.posix_memalign.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                  ctypes.c_size_t)
  # The cache's small bins as a busy process leaves them: emptied by its
  # allocations (seven entries a bin), so the leftovers go there.
  kept = [libc.malloc(n) for n in range(8, 120, 16) for _ in range(7)]
  where = []
  for _ in range(calls):
    block = ctypes.c_void_p()
    if libc.posix_memalign(ctypes.byref(block), 64, 32 << 20):
      raise MemoryError("posix_memalign failed")
    kept.append(libc.malloc(100))
    where.append(block.value)
    libc.free(block.value)
  return [round((w - where[0]) / 2**20) for w in where]


def measure_memalign(calls: int, tcache: bool) -> list[int]:
  """`memalign_walk` in a fresh process, with glibc's thread cache as it comes or off."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
  if not tcache:
    env["GLIBC_TUNABLES"] = "glibc.malloc.tcache_count=0"
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memalign-worker",
                        str(calls)], capture_output=True, text=True, check=True, env=env)
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
  parser.add_argument("--warmup", type=int, default=12,
                      help="untimed calls before them (default 12)")
  parser.add_argument("--memalign", action="store_true",
                      help="instead: where glibc places each call's aligned block, without XLA")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--memalign-worker", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    print(json.dumps(worker(*json.loads(args.worker))), flush=True)
    return 0
  if args.memalign_worker:
    print(json.dumps(memalign_walk(args.memalign_worker)), flush=True)
    return 0
  if args.calls < 3:
    print(f"bench_malloc: --calls must be >= 3, got {args.calls}", file=sys.stderr)
    return 2
  if args.warmup < 0:
    print(f"bench_malloc: --warmup must be >= 0, got {args.warmup}", file=sys.stderr)
    return 2
  if args.memalign:
    print(f"{args.calls} calls: a 32 MiB block aligned to 64 bytes, a 100-byte allocation "
          "kept, the block freed; the block's offset (MiB) from the first call's\n")
    for tcache in (True, False):
      walk = measure_memalign(args.calls, tcache)
      print(f"thread cache {'on (glibc default)' if tcache else 'off (tcache_count=0)'}: "
            f"{' '.join(map(str, walk))}; moved {sum(a != b for a, b in zip(walk, walk[1:]))} "
            "times", flush=True)
    return 0
  print(f"load average: {'/'.join(f'{v:.2f}' for v in os.getloadavg())}; {args.calls} calls "
        f"after {args.warmup} warm-up, one device, one XLA thread\n")
  print("| t (MiB) | malloc | ms per call (median) | page faults per call (median) | "
        "MiB faulted in per call |")
  print("|---:|---|---:|---:|---:|")
  for size in args.sizes:
    for mode in MODES:
      r = measure(size, args.calls, mode, args.warmup)
      print(f"| {size} | {mode} | {r['ms']:.2f} | {r['faults']:,.0f} | "
            f"{r['faults'] * 4096 / 2**20:.0f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
