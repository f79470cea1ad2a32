#!/usr/bin/env python3
"""The two-core measurement of `tools/bench_pipeline.py --two-core`: real parallelism.

A process per configuration, each pinned with taskset and with one XLA thread
per device: the one-device reference on one core, each schedule with S=2
stages on both cores, the ceiling (two data replicas) on both, and a twin of
the reference on the other core. bench_pipeline parses and checks the
command line and calls `run`; the pinned children re-enter this file with one
argument, their JSON spec (`worker`). See docs/benchmark.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
from bench_pipeline import _COUNT_FLAG, SCHEDULES, ModelShape, Runner, _write
from bench_report import load, machine, two_core_table
# pylint: enable=g-import-not-at-top,wrong-import-position

# Done-when targets of the two-core benchmark: {(schedule, vocab): speed-up}.
TWO_CORE_TARGETS = {("2bw", 257): 1.8, ("2bw", 50257): 1.7, ("1f1b", 257): 1.6,
                    ("1f1b", 50257): 1.5, ("gpipe", 257): 1.6, ("gpipe", 50257): 1.5}


def worker(spec: dict[str, Any]) -> int:
  """Runs in a pinned child process: builds one schedule, then times a step per stdin line.

  The child's XLA has one thread per device (`--xla_cpu_multi_thread_eigen=false`)
  and `stages x data` emulated devices; `taskset` pins the process to that
  many cores (XLA still runs both devices' operations on one shared pool of
  host threads: docs/benchmark.md).
  """
  devices = spec["stages"] * spec["data"]
  os.environ["XLA_FLAGS"] = (f"--xla_cpu_multi_thread_eigen=false {_COUNT_FLAG}={devices}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  shape = ModelShape(**spec["shape"])
  r = Runner(shape, spec["schedule"], spec["stages"], spec["microbatches"], data=spec["data"])
  print("ready", flush=True)
  for _ in sys.stdin:
    print(f"{r.step()[0]:.6f}", flush=True)
  return 0


class _Pinned:
  """A worker process pinned to `cores`; `step()` runs one step there and returns its time."""

  def __init__(self, label: str, spec: dict[str, Any], cores: str):
    import subprocess  # pylint: disable=g-import-not-at-top
    self.label, self.cores = label, cores
    cmd = ["taskset", "-c", cores, sys.executable, os.path.abspath(__file__),
           json.dumps(spec)]
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

  def ready(self) -> None:
    line = self.proc.stdout.readline().strip()
    if line != "ready":
      raise RuntimeError(f"{self.label}: worker failed to start (exit {self.proc.wait()})")

  def send(self) -> None:
    """Starts one step in the worker."""
    self.proc.stdin.write("step\n")
    self.proc.stdin.flush()

  def receive(self) -> float:
    """Waits for the step started by `send` and returns its time."""
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"{self.label}: worker died (exit {self.proc.wait()})")
    return float(line)

  def step(self) -> float:
    """Runs one step there and returns its time."""
    self.send()
    return self.receive()

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait()


def _step_together(a: _Pinned, b: _Pinned) -> float:
  """Steps two workers at the same time; returns the slower one's step time."""
  a.send()
  b.send()
  return max(a.receive(), b.receive())


def two_core(shape: ModelShape, vocabs: Sequence[int], num_microbatches: int, *, pairs: int,
             warmup: int, cores: tuple[str, str], schedules: Sequence[str] = SCHEDULES[1:],
             settle_s: float = 90.0, log=print) -> list[dict[str, Any]]:
  """Speed-up of S=2 pipelines on two cores over one device on one core.

  For each vocabulary it starts, each in its own process: the one-device
  reference (`none`, the global batch as M microbatches of gradient
  accumulation) pinned to the first core; every schedule with 2 stages pinned
  to both cores; and `none` with 2 data replicas on both cores, each replica
  doing the reference's work (the platform's ceiling: two devices that never
  wait for each other). Then, `pairs` times, one step of each in turn (the
  order rotated), so that load from elsewhere hits all alike; the speed-up of
  a round is the reference's step time over the schedule's. Each round also
  steps the reference together with a copy of it pinned to the other core
  ('hardware': what the two cores give two processes that share nothing). Returns one row
  per (vocabulary, configuration) with the median speed-up and its spread.
  Before timing it waits up to `settle_s` for the 1-minute load average to fall
  below 2.5.
  """
  from jaxpipe.pipeline import facts  # pylint: disable=g-import-not-at-top
  rows = []
  both = ",".join(cores)
  for vocab in vocabs:
    sh = dataclasses.replace(shape, vocab=vocab)
    base = {"shape": dataclasses.asdict(sh), "microbatches": num_microbatches}
    workers = [_Pinned("none", dict(base, schedule="none", stages=1, data=1), cores[0]),
               _Pinned("ceiling", dict(base, schedule="none", stages=1, data=2), both)]
    workers += [_Pinned(n, dict(base, schedule=n, stages=2, data=1), both) for n in schedules]
    # A second reference on the other core: stepped together with the first,
    # it shows what the two cores give two processes that share nothing.
    twin = _Pinned("twin", dict(base, schedule="none", stages=1, data=1), cores[1])
    try:
      for w in workers + [twin]:
        w.ready()
      # The compilations just before raise the 1-minute load average; let it
      # decay so that the load recorded is the timing's own.
      deadline = time.time() + settle_s
      while os.getloadavg()[0] > 2.5 and time.time() < deadline:
        time.sleep(5)
      timing_load = load()
      log(f"  vocab {vocab}: {len(workers)} workers compiled; timing {pairs} rounds "
          f"(load {timing_load})")
      times: dict[str, list[float]] = {w.label: [] for w in workers}
      times["hardware"] = []
      for i in range(warmup + pairs):
        order = workers[i % len(workers):] + workers[:i % len(workers)]
        for w in order:
          t = w.step()
          if i >= warmup:
            times[w.label].append(t)
        together = _step_together(workers[0], twin)
        if i >= warmup:
          times["hardware"].append(together)
    finally:
      for w in workers + [twin]:
        w.close()
    ref = times["none"]
    for name in [w.label for w in workers[1:]] + ["hardware"]:
      ratio = sorted(a / b for a, b in zip(ref, times[name]))
      bub = 0.0 if name in ("ceiling", "hardware") else facts(name, 2, num_microbatches).bubble
      # The ceiling replica and the twin do the reference's work, so their
      # ratio is a parallel efficiency; 2x that is what two devices gave.
      scale = 2.0 if name in ("ceiling", "hardware") else 1.0
      rows.append({
          "vocab": vocab, "schedule": name, "ref_s": statistics.median(ref),
          "step_s": statistics.median(times[name]),
          "speedup": scale * statistics.median(ratio), "low": scale * ratio[0],
          "high": scale * ratio[-1], "q1": scale * ratio[len(ratio) // 4],
          "q3": scale * ratio[(3 * len(ratio)) // 4], "bound": 2.0 * (1.0 - bub),
          "target": TWO_CORE_TARGETS.get((name, vocab)), "times": times[name], "ref": ref,
          "load_before": timing_load, "load_after": load()})
  return rows


def run(args, shape: ModelShape) -> int:
  """The two-core measurement of `bench_pipeline --two-core`: prints (and writes) its table.

  `args` are bench_pipeline's parsed, checked arguments; the table comes with
  the machine, the model and the load average before and after.
  """
  import jax  # pylint: disable=g-import-not-at-top
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  started, load_before = time.time(), load()
  m = args.microbatches
  header = [f"machine: {machine(emulated=False)}",
            f"model: {shape.layers} blocks, width {shape.dim}, {shape.heads} heads "
            f"({shape.kv_heads} kv), seq {shape.seq_len}; M={m} microbatches of "
            f"{shape.micro_rows} sequences; remat {shape.remat}; pipeline.stash {shape.stash}; "
            "adamw; float32",
            f"one device pinned to core {args.cores.split(',')[0]}; 2 stages (or 2 data "
            f"replicas) pinned to cores {args.cores}; one XLA thread per device; "
            f"{args.pairs} timed rounds after {args.warmup} warm-up; jax {jax.__version__}",
            f"load average (1/5/15 min) at start: {load_before}"]
  for line in header:
    log(line)
  try:
    rows = two_core(shape, args.vocab, m, pairs=args.pairs, warmup=args.warmup,
                    cores=tuple(c.strip() for c in args.cores.split(",")), log=log)
  except RuntimeError as e:
    print(f"bench_pipeline: {e}", file=sys.stderr)
    return 1
  footer = [f"load average at end: {load()}; wall time {time.time() - started:.0f} s"]
  text = ("\n".join(header) + "\n\n### Two cores against one (S=2, M=" + str(m) + ")\n\n"
          + two_core_table(rows) + "\n\n" + "\n".join(footer) + "\n")
  print(text)
  _write(text, args.out_md, log)
  if args.out_json:
    _write(json.dumps({"header": header, "footer": footer, "rows": rows}, indent=1),
           args.out_json, log)
  return 0


if __name__ == "__main__":
  sys.exit(worker(json.loads(sys.argv[1])))
