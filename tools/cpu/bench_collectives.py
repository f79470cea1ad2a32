#!/usr/bin/env python3
"""What one collective costs on the CPU: two devices of one process against two gloo processes.

  python tools/cpu/bench_collectives.py                     # the two-core benchmark's tick shapes
  python tools/cpu/bench_collectives.py --reps 200 --out-md /tmp/collectives.md

A program that does only collectives, nothing else: each of `ppermute`
(stage to stage, the pipeline's send), `psum` (an all-reduce) and
`all_gather`, on arrays of the two-core benchmark's sizes (a microbatch's
activation, 2 x 64 x 256 float32 = 128 KiB; the softmax statistics of a
microbatch, 2 x 64 x 3; a block's weight gradient, 256 x 704 = 704 KiB),
jitted under `shard_map` over two devices and timed `--reps` times
(median and quartiles of the wall time of one call, `block_until_ready`
included). It runs three times, each time pinned to two cores with one XLA
thread per device: two emulated devices in one process (XLA's in-process CPU
collectives), and twice two `jax.distributed` processes, one device and one
core each, on loopback (gloo, as in the benchmark's 'x2' rows): with gloo's
I/O thread at the normal scheduling class, as JAX leaves it, and idle-class,
as train.py's launcher sets it for a process per core
(`tuning.idle_io_thread`). Bad input exits with status 2 and one
line on stderr.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
from bench_common import free_port, two_cores
from jaxpipe.cli import Parser
# pylint: enable=g-import-not-at-top,wrong-import-position

# (name, shape): the pipeline's per-tick and per-step payloads at the benchmark's shape.
PAYLOADS = (("activation 2x64x256", (2, 64, 256)), ("softmax stats 2x64x3", (2, 64, 3)),
            ("weight gradient 256x704", (256, 704)))
OPS = ("ppermute", "psum", "all_gather")


def _worker(spec: dict) -> None:
  """In a pinned child: times every (op, payload) and prints one JSON line."""
  dist = spec.get("dist")
  count = 1 if dist else 2
  os.environ["XLA_FLAGS"] = ("--xla_cpu_multi_thread_eigen=false "
                             f"--xla_force_host_platform_device_count={count}")
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tools.cpu import tuning  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  if dist:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=dist["coordinator"], num_processes=2,
                               process_id=dist["process_id"])
  devices, new_threads = tuning.start_backend()
  mesh = Mesh(np.array(devices[:2]), ("stage",))
  if dist and dist.get("idle_io"):
    tuning.idle_io_thread(new_threads, 1, dist["process_id"])  # as the CPU tuning does
  split = NamedSharding(mesh, P("stage"))
  bodies = {"ppermute": lambda x: jax.lax.ppermute(x, "stage", [(0, 1), (1, 0)]),
            "psum": lambda x: jax.lax.psum(x, "stage"),
            "all_gather": lambda x: jax.lax.all_gather(x, "stage", tiled=True)}
  result = {}
  for op in OPS:
    for name, shape in PAYLOADS:
      fn = jax.jit(jax.shard_map(bodies[op], mesh=mesh, in_specs=P("stage"),
                                 out_specs=P("stage"), check_vma=False))
      global_shape = (2 * shape[0], *shape[1:])
      x = jax.make_array_from_callback(global_shape, split,
                                       lambda idx: np.ones(global_shape, np.float32)[idx])
      jax.block_until_ready(fn(x))
      times = []
      for _ in range(spec["reps"]):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
      times.sort()
      result[f"{op} | {name}"] = [times[len(times) // 4] * 1e6, statistics.median(times) * 1e6,
                                  times[(3 * len(times)) // 4] * 1e6]
  if jax.process_index() == 0:
    print("@collectives " + json.dumps(result), flush=True)
  if dist:
    jax.distributed.shutdown()


def _run(cores: tuple[str, str], reps: int, processes: bool, idle_io: bool = False) -> dict:
  """{op | payload: [q1, median, q3] microseconds}, one process or two.

  `idle_io`: the two processes run gloo's I/O thread idle-class, as train.py
  does for a process per core (`tuning.idle_io_thread`).
  """
  me = os.path.abspath(__file__)
  if processes:
    coordinator = f"127.0.0.1:{free_port()}"
    specs = [({"reps": reps, "dist": {"coordinator": coordinator, "process_id": i,
                                      "idle_io": idle_io}}, core)
             for i, core in enumerate(cores)]
  else:
    specs = [({"reps": reps}, ",".join(cores))]
  procs = [subprocess.Popen(["taskset", "-c", core, sys.executable, me, json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for spec, core in specs]
  outs = [p.communicate(timeout=1200) for p in procs]
  for p, (_, err) in zip(procs, outs):
    if p.returncode != 0:
      raise RuntimeError(f"a timing process exited {p.returncode}: "
                         f"{(err.strip().splitlines() or ['(no output)'])[-1]}")
  for out, _ in outs:
    for line in out.splitlines():
      if line.startswith("@collectives "):
        return json.loads(line[len("@collectives "):])
  raise RuntimeError("no timing came back")


def main(argv: Optional[list[str]] = None) -> int:
  """Parses the command line, times both ways, prints (and writes) the table."""
  # Here, not at the top: it imports jax, which the timing children must
  # import only after setting their XLA_FLAGS and JAX_PLATFORMS.
  from bench_report import load  # pylint: disable=g-import-not-at-top
  p = Parser(prog="bench_collectives", description=__doc__.split("\n")[0])
  p.add_argument("--reps", type=int, default=100, help="timed calls per collective (default 100)")
  p.add_argument("--cores", default="0,1", help="the two cores to pin to (default 0,1)")
  p.add_argument("--out-md", default=None, help="write the markdown table here")
  args = p.parse_args(argv)
  if args.reps < 4:
    print(f"bench_collectives: --reps must be at least 4, got {args.reps}", file=sys.stderr)
    return 2
  try:
    cores = two_cores(args.cores)
  except ValueError as e:
    print(f"bench_collectives: {e}", file=sys.stderr)
    return 2
  load_at_start = load()
  try:
    one, two = _run(cores, args.reps, False), _run(cores, args.reps, True)
    idle = _run(cores, args.reps, True, idle_io=True)
  except (RuntimeError, subprocess.TimeoutExpired) as e:
    print(f"bench_collectives: {e}", file=sys.stderr)
    return 1
  lines = [f"{args.reps} calls each, pinned to cores {args.cores}; load average at start {load_at_start}, "
           f"at end {load()}", "",
           "| collective | payload | one process, 2 devices: median us (quartiles) "
           "| two gloo processes, I/O thread as it comes | ratio "
           "| two gloo processes, I/O thread idle-class (train.py) | ratio |",
           "|---|---|---:|---:|---:|---:|---:|"]
  for key, (q1, med, q3) in one.items():
    cells = []
    for other in (two, idle):
      g1, gmed, g3 = other[key]
      cells.append(f"{gmed:.0f} ({g1:.0f}-{g3:.0f}) | {gmed / med:.1f}x")
    op, payload = key.split(" | ")
    lines.append(f"| {op} | {payload} | {med:.0f} ({q1:.0f}-{q3:.0f}) | " + " | ".join(cells) + " |")
  text = "\n".join(lines)
  print(text)
  if args.out_md:
    with open(args.out_md, "w") as f:
      f.write(text + "\n")
    print(f"wrote {args.out_md}")
  return 0


if __name__ == "__main__":
  if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
    _worker(json.loads(sys.argv[1]))
  else:
    sys.exit(main())
