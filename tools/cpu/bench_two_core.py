#!/usr/bin/env python3
"""The two-core measurement of `tools/cpu/bench_pipeline.py --two-core`: real parallelism.

A process per configuration, each pinned with taskset and with one XLA thread
per device: the one-device reference on one core; each schedule with S=2
stages on both cores; the no-collective ceiling (two devices of one process,
each running the reference's step on its own data) on both; 2bw and 1f1b as
two `jax.distributed` processes, a stage and a core each; and a twin of the
reference on the other core (the hardware row). bench_pipeline parses and
checks the command line and calls `run`; the pinned children re-enter this
file with one argument, their JSON spec (`worker`). See docs/benchmark.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from typing import Any, Mapping, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
from bench_common import (COUNT_FLAG, LABELS, CeilingRunner, ModelShape, Runner, free_port,
                          parse_label, write)
from bench_report import account_tables, load, machine, two_core_table
# pylint: enable=g-import-not-at-top,wrong-import-position

# Done-when targets of the two-core benchmark: {(schedule, vocab): speed-up}.
# They hold where the no-collective ceiling of the same run reaches 1.9x;
# below it they scale with it (`target`).
TWO_CORE_TARGETS = {("2bw", 257): 1.85, ("2bw", 50257): 1.80, ("1f1b", 257): 1.65,
                    ("1f1b", 50257): 1.65, ("gpipe", 257): 1.65, ("gpipe", 50257): 1.65,
                    ("2bw x2", 257): 1.7, ("2bw x2", 50257): 1.7}
CEILING_FULL = 1.9
# Where the ceiling is lower: 2bw must reach this share of it, a flushed
# schedule this share of its bubble bound times it.
SHARE_OF_CEILING = 0.95
SHARE_OF_BOUND = 0.93


def target(schedule: str, vocab: int, ceiling: Optional[float],
           bubble: float) -> Optional[float]:
  """The speed-up `schedule` must reach: the fixed target, scaled down with a low ceiling."""
  fixed = TWO_CORE_TARGETS.get((schedule, vocab))
  if schedule.startswith(("interleaved", "zb1")) and ceiling is not None:
    # 0.93 of its bubble bound times the ceiling of the same run.
    return SHARE_OF_BOUND * (1 - bubble) * ceiling
  if fixed is None or ceiling is None or ceiling >= CEILING_FULL:
    return fixed
  share = SHARE_OF_CEILING if bubble == 0 else SHARE_OF_BOUND * (1 - bubble)
  return min(fixed, share * ceiling)


# The suffix of the rows run with `--compare-xla-flags` or `--compare-env`.
COMPARED = " [B]"
# A worker reads the CPU tuning's own variables (tools/cpu/tuning.py), as a
# train.py run with run.launch_hooks=tools.cpu.tuning does: gloo's I/O thread
# left at the normal class with IO_THREAD_ENV=normal, the malloc arenas
# (ARENA_ENV: one or per_thread), whether XLA may split an operation over
# the threads (SPLIT_ENV: always or never); unset, "auto" (for --compare-env).
from tools.cpu.tuning import ARENA_ENV, IO_THREAD_ENV, SPLIT_ENV  # pylint: disable=wrong-import-position

# Marks the worker's replies on its stdout, where libraries (gloo) print too.
_REPLY = "@jaxpipe-bench"


def worker_xla_flags(devices: int, extra: str = "", *, distributed: bool = False) -> str:
  """The XLA_FLAGS of a pinned worker: `extra`, then one XLA thread per device, `devices`
  host devices and, as train.py sets them for a run of one process, its CPU flags
  (`jaxpipe.accel.cpu_xla_flags`), each unless `extra` sets it."""
  from jaxpipe import accel  # pylint: disable=g-import-not-at-top
  cpu = [] if distributed else accel.cpu_xla_flags()
  return accel.merge_xla_flags(extra, ["--xla_cpu_multi_thread_eigen=false",
                                       f"{COUNT_FLAG}={devices}", *cpu])


def worker(spec: dict[str, Any]) -> int:
  """Runs in a pinned child process: builds one configuration, then serves commands on stdin.

  `step` times one step and prints its seconds and the page faults the
  process took meanwhile; `account N` traces N steps and prints their
  account (`account.summarise` (tools/cpu/account.py)) as one JSON line. The child's XLA
  has one thread per device (`--xla_cpu_multi_thread_eigen=false`) and the
  devices of its configuration; with `dist` in the spec it is one of
  several `jax.distributed` processes (gloo collectives over loopback).
  Its malloc is tuned as train.py's launcher tunes it for a CPU run
  (`tuning.tune_cpu_malloc`; one arena where it has one device),
  unless its environment chooses, and its backend started as the launcher
  starts it (no loop operation partitioned over the threads where every core runs a
  device, `tuning.split_cpu_ops`).
  """
  from tools.cpu import tuning  # pylint: disable=g-import-not-at-top
  dist = spec.get("dist")
  devices = 1 if dist else spec["stages"] * spec["data"]
  tuning.tune_cpu_malloc(one_arena=tuning.one_malloc_arena(os.environ.get(ARENA_ENV, "auto"),
                                                            devices))
  os.environ["XLA_FLAGS"] = worker_xla_flags(devices, spec.get("xla_flags", ""),
                                             distributed=bool(dist))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # pylint: disable=g-import-not-at-top
  if dist:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=dist["coordinator"],
                               num_processes=dist["num_processes"],
                               process_id=dist["process_id"])
  # As the CPU tuning starts it (`tuning.backend_started`): no operation
  # split over the threads where every core runs a device.
  split = tuning.split_cpu_ops(os.environ.get(SPLIT_ENV, "auto"), devices, tuning.usable_cores())
  _, new_threads = tuning.start_backend(split_ops=split)
  if dist and os.environ.get(IO_THREAD_ENV) != "normal":
    tuning.idle_io_thread(new_threads, 1, dist["process_id"])  # as the CPU tuning does
  shape = ModelShape(**spec["shape"])
  if spec["schedule"] == "ceiling":
    r = CeilingRunner(shape, spec["microbatches"], spec["data"])
  else:
    r = Runner(shape, spec["schedule"], spec["stages"], spec["microbatches"], data=spec["data"])
  print(_REPLY, "ready", flush=True)
  for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "account":
      print(_REPLY, json.dumps(r.account(int(cmd[1]))), flush=True)
    else:
      # `step K`: K steps back to back, the last one timed (the others warm it).
      for _ in range(int(cmd[1]) if len(cmd) > 1 else 1):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds = r.step()[0]
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
      print(_REPLY, f"{seconds:.6f} {faults}", flush=True)
  if dist:
    jax.distributed.shutdown()
  return 0


class _Pinned:
  """A worker process pinned to `cores`; `step()` runs one step there and returns its time.

  `env` is added to the worker's environment; `faults` is the page faults of
  the last step it ran.
  """

  def __init__(self, label: str, spec: dict[str, Any], cores: str,
               env: Optional[Mapping[str, str]] = None):
    import subprocess  # pylint: disable=g-import-not-at-top
    self.label, self.cores, self.faults = label, cores, 0
    cmd = ["taskset", "-c", cores, sys.executable, os.path.abspath(__file__),
           json.dumps(spec)]
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, **env} if env else None)

  def ready(self) -> None:
    if self._line() != "ready":
      raise RuntimeError(f"{self.label}: worker failed to start")

  def send(self, command: str = "step") -> None:
    """Starts a command (one step, or `account N`) in the worker."""
    self.proc.stdin.write(command + "\n")
    self.proc.stdin.flush()

  def _line(self) -> str:
    """The worker's next reply (lines that are not replies are passed over)."""
    while True:
      line = self.proc.stdout.readline()
      if not line:
        self.proc.kill()
        raise RuntimeError(f"{self.label}: worker died (exit {self.proc.wait()})")
      if line.startswith(_REPLY + " "):
        return line[len(_REPLY) + 1:].strip()

  def receive(self) -> float:
    """Waits for the step started by `send` and returns its time (its page faults: `faults`)."""
    seconds, faults = self._line().split()
    self.faults = int(faults)
    return float(seconds)

  def step(self, back_to_back: int = 1) -> float:
    """Runs `back_to_back` steps there, one after the other; returns the last one's time."""
    self.send(f"step {back_to_back}")
    return self.receive()

  def account(self, steps: int) -> dict[str, dict[str, Any]]:
    """{label: the account of `steps` traced steps} (see `worker`)."""
    self.send(f"account {steps}")
    return {self.label: json.loads(self._line())}

  def close(self) -> None:
    """Ends the worker: at the end of its input, or killed if it does not end (a peer died)."""
    import subprocess  # pylint: disable=g-import-not-at-top
    try:
      self.proc.stdin.close()
    except OSError:
      pass
    try:
      self.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()


def start_worker(label: str, spec: dict[str, Any], cores: str) -> _Pinned:
  """A worker process (`worker`) of `spec` pinned to `cores`, started (call `ready()`).

  Its `step()` runs one step and returns its seconds; `close()` ends it.
  """
  return _Pinned(label, spec, cores)


class _Group:
  """Processes that run one configuration together (a stage each); a step is the slowest's."""

  def __init__(self, label: str, members: Sequence[_Pinned]):
    self.label, self.members = label, list(members)

  @property
  def faults(self) -> int:
    """Page faults of the last step, all members' together."""
    return sum(m.faults for m in self.members)

  def ready(self) -> None:
    for m in self.members:
      m.ready()

  def step(self, back_to_back: int = 1) -> float:
    """`back_to_back` steps in every member at once; the slower one's time of the last."""
    for m in self.members:
      m.send(f"step {back_to_back}")
    return max(m.receive() for m in self.members)

  def account(self, steps: int) -> dict[str, dict[str, Any]]:
    """One account per member process, each for its own device."""
    for m in self.members:
      m.send(f"account {steps}")
    out = {}
    for i, m in enumerate(self.members):
      acc = json.loads(m._line())  # pylint: disable=protected-access
      # Each process traced its own device; name it by process.
      for key in ("devices", "transfers"):
        acc[key] = {f"p{i}": v for v in acc.get(key, {}).values()}
      prev = out.get(self.label, {})
      out[self.label] = {**(prev or acc), **{
          key: {**prev.get(key, {}), **acc[key]} for key in ("devices", "transfers")}}
    return out

  def close(self) -> None:
    # Every member's input ends first: their shutdowns wait for each other.
    for m in self.members:
      try:
        m.proc.stdin.close()
      except OSError:
        pass
    for m in self.members:
      m.close()


def _processes(label: str, base: dict[str, Any], schedule: str, cores: tuple[str, str],
               env: Optional[Mapping[str, str]] = None) -> _Group:
  """`schedule` with two stages as two jax.distributed processes, one per core."""
  coordinator = f"127.0.0.1:{free_port()}"
  members = [_Pinned(f"{label} p{i}", dict(base, schedule=schedule, stages=2, data=1, dist={
      "coordinator": coordinator, "num_processes": 2, "process_id": i}), core, env)
             for i, core in enumerate(cores)]
  return _Group(label, members)


def _start_set(base: dict[str, Any], schedules: Sequence[str], processes: Sequence[str],
               cores: tuple[str, str], both: str, compare_flags: str,
               compare_env: Optional[Mapping[str, str]], xla_flags: str
               ) -> tuple[list[Any], "_Pinned"]:
  """Starts one set of the configurations' processes (not yet ready) and the reference's twin."""
  workers: list[Any] = [
      _Pinned("none", dict(base, schedule="none", stages=1, data=1), cores[0]),
      _Pinned("ceiling", dict(base, schedule="ceiling", stages=1, data=2), both)]
  workers += [_Pinned(n, dict(base, schedule=n, stages=2, data=1), both) for n in schedules]
  other = base
  if compare_flags or compare_env:
    from jaxpipe import accel  # pylint: disable=g-import-not-at-top
    other = dict(base, xla_flags=accel.merge_xla_flags(compare_flags, xla_flags.split()))
    workers += [
        _Pinned(f"none{COMPARED}", dict(other, schedule="none", stages=1, data=1), cores[0],
                compare_env),
        _Pinned(f"ceiling{COMPARED}", dict(other, schedule="ceiling", stages=1, data=2), both,
                compare_env)]
    workers += [_Pinned(f"{n}{COMPARED}", dict(other, schedule=n, stages=2, data=1), both,
                        compare_env) for n in schedules]
  workers += [_processes(f"{n} x2", base, n, cores) for n in processes]
  if compare_flags or compare_env:
    workers += [_processes(f"{n} x2{COMPARED}", other, n, cores, compare_env)
                for n in processes]
  # A second reference on the other core: stepped together with the first,
  # it shows what the two cores give two processes that share nothing.
  twin = _Pinned("twin", dict(base, schedule="none", stages=1, data=1), cores[1])
  return workers, twin


def two_core(shape: ModelShape, vocabs: Sequence[int], num_microbatches: int, *, pairs: int,
             warmup: int, cores: tuple[str, str], schedules: Sequence[str] = LABELS[1:],
             processes: Sequence[str] = ("2bw", "1f1b"), account_steps: int = 0,
             settle_s: float = 90.0, xla_flags: str = "", compare_flags: str = "",
             compare_env: Optional[Mapping[str, str]] = None, back_to_back: int = 1,
             instances: int = 1, log=print) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """Speed-up of S=2 pipelines on two cores over one device on one core, and their accounts.

  For each vocabulary it starts, each in its own process: the one-device
  reference (`none`, the global batch as M microbatches of gradient
  accumulation) pinned to the first core; the ceiling (two devices of one
  process, each running the reference's step on its own data, nothing
  exchanged) on both cores; every schedule with 2 stages on both cores; each
  schedule of `processes` as two jax.distributed processes ('S x2'), a stage
  and a core each. Then, `pairs` times, one step of each in turn (the order
  rotated), so that load from elsewhere hits all alike; the speed-up of a
  round is the reference's step time over the configuration's. Each round
  also steps the reference together with a copy of it pinned to the other
  core ('hardware': what the two cores give two processes that share
  nothing). With `account_steps`, each configuration then traces that many
  steps and accounts for their time (`tools/cpu/account.py`). Returns (one row
  per (vocabulary, configuration) with the median speed-up and its spread,
  {vocabulary: {configuration: account}}). Before timing it waits up to
  `settle_s` for the 1-minute load average to fall below 2.5. `xla_flags`
  are added to every process's XLA_FLAGS. With `compare_flags` (XLA flags)
  or `compare_env` (environment variables), the reference, the ceiling and
  each schedule of `schedules` also run with those on top (rows 'S [B]',
  without a target), in the same rounds as the rest; a [B] row's speed-up is
  over 'none [B]', and 'none [B]''s is the reference's own speed-up from B.
  Every row also gives the median page faults the process (both processes
  of an 'x2' row) took per timed step. With `back_to_back` > 1 each turn
  runs that many steps in a row and times the last: its caches are then
  warm from its own steps, not from the other processes'.

  With `instances` > 1 the rounds are split among that many sets of
  processes, started one set after the other (each set compiled afresh,
  warmed and settled as above): one process's step time stays off by a few
  percent for its whole life (the same configuration measured 0.155-0.176 s
  in ten processes on a quiet machine), so the medians of one set carry
  that process's luck. Each row pools all rounds and also gives each set's
  median speed-up (`per_instance`); with `account_steps` the last set is
  traced.
  """
  if not 1 <= instances <= pairs:
    raise ValueError(f"instances must be between 1 and pairs ({pairs}), got {instances}")
  rows, accounts = [], {}
  both = ",".join(cores)
  # Every set gets a share of the rounds, so each set's median is over rounds.
  shares = [pairs // instances + (k < pairs % instances) for k in range(instances)]
  for vocab in vocabs:
    sh = dataclasses.replace(shape, vocab=vocab)
    base = {"shape": dataclasses.asdict(sh), "microbatches": num_microbatches,
            "xla_flags": xla_flags}
    times: dict[str, list[float]] = {}
    faults: dict[str, list[int]] = {}
    labels: list[str] = []
    timing_load = ""
    for k, rounds in enumerate(shares):
      workers, twin = _start_set(base, schedules, processes, cores, both, compare_flags,
                                 compare_env, xla_flags)
      labels = [w.label for w in workers]
      try:
        for w in workers + [twin]:
          w.ready()
        # The compilations just before raise the 1-minute load average; let it
        # decay so that the load recorded is the timing's own.
        deadline = time.time() + settle_s
        while os.getloadavg()[0] > 2.5 and time.time() < deadline:
          time.sleep(5)
        timing_load = timing_load or load()
        log(f"  vocab {vocab}: {len(workers)} configurations compiled"
            + (f" (set {k + 1} of {instances})" if instances > 1 else "")
            + f"; timing {rounds} rounds (load {load()})")
        for w in workers:
          times.setdefault(w.label, [])
          faults.setdefault(w.label, [])
        times.setdefault("hardware", [])
        for i in range(warmup + rounds):
          order = workers[i % len(workers):] + workers[:i % len(workers)]
          for w in order:
            t = w.step(back_to_back)
            if i >= warmup:
              times[w.label].append(t)
              faults[w.label].append(w.faults)
          together = _Group("hardware", [workers[0], twin]).step(back_to_back)
          if i >= warmup:
            times["hardware"].append(together)
        if account_steps and k == instances - 1:
          log(f"  vocab {vocab}: tracing {account_steps} steps of each configuration")
          accounts[vocab] = {}
          for w in workers:
            accounts[vocab].update(w.account(account_steps))
      finally:
        for w in workers + [twin]:
          w.close()
    rows += _rows(vocab, labels + ["hardware"], times, faults, num_microbatches, timing_load,
                  shares)
  return rows, accounts


def _rows(vocab: int, names: Sequence[str], times: Mapping[str, list[float]],
          faults: Mapping[str, list[int]], num_microbatches: int,
          timing_load: str, shares: Sequence[int] = ()) -> list[dict[str, Any]]:
  """One row per configuration of one vocabulary: its speed-up over the reference and spread.

  A `[B]` row is against the reference run with B, and 'none [B]' against
  the plain reference; each `[B]` row's target is None. `shares` are the
  rounds of each set of processes, in order (`two_core`'s `instances`):
  each row's `per_instance` is the median speed-up of each set's rounds.
  """
  from jaxpipe.pipeline import facts  # pylint: disable=g-import-not-at-top
  rows: list[dict[str, Any]] = []
  ceilings: dict[str, float] = {}
  for name in names:
    # A [B] row against the reference run with B; 'none [B]' against the plain one.
    suffix = COMPARED if name.endswith(COMPARED) else ""
    ref = times["none" + suffix if name != f"none{COMPARED}" else "none"]
    rounds = [a / b for a, b in zip(ref, times[name])]
    ratio = sorted(rounds)
    plain = name.removesuffix(COMPARED).removesuffix(" x2")
    bub = 0.0
    if plain not in ("none", "ceiling", "hardware"):
      plain, v = parse_label(plain)
      bub = facts(plain, 2, num_microbatches, v).bubble
    # The ceiling's devices and the twin do the reference's work, so their
    # ratio is a parallel efficiency; 2x that is what two devices gave.
    scale = 2.0 if plain in ("ceiling", "hardware") else 1.0
    speedup = scale * statistics.median(ratio)
    per_instance, at = [], 0
    for n in shares if len(shares) > 1 else ():
      per_instance.append(scale * statistics.median(rounds[at:at + n]))
      at += n
    if plain == "ceiling":
      ceilings[suffix] = speedup
    ceiling = ceilings.get(suffix)
    rows.append({
        "vocab": vocab, "schedule": name, "ref_s": statistics.median(ref),
        "step_s": statistics.median(times[name]),
        "faults": statistics.median(faults[name]) if name in faults else None,
        "speedup": speedup, "low": scale * ratio[0],
        "high": scale * ratio[-1], "q1": scale * ratio[len(ratio) // 4],
        "q3": scale * ratio[(3 * len(ratio)) // 4],
        "bound": 1.0 if plain == "none" else 2.0 * (1.0 - bub),
        "ceiling": ceiling,
        "target": None if name.endswith(COMPARED) else target(name, vocab, ceiling, bub),
        "per_instance": per_instance, "times": times[name], "ref": ref,
        "load_before": timing_load, "load_after": load()})
  return rows


def run(args, shape: ModelShape) -> int:
  """The two-core measurement of `bench_pipeline --two-core`: prints (and writes) its tables.

  `args` are bench_pipeline's parsed, checked arguments; the tables come with
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
            f"pipeline.head {shape.head}; "
            "adamw; float32",
            f"one device pinned to core {args.cores.split(',')[0]}; 2 stages (or the ceiling's "
            f"2 devices) pinned to cores {args.cores}; one XLA thread per device; "
            f"{args.pairs} timed rounds"
            + (f" in {args.instances} sets of processes started one after the other, "
               f"{args.warmup} warm-up each" if args.instances > 1
               else f" after {args.warmup} warm-up")
            + (f", each turn {args.back_to_back} steps in a row, the last timed"
               if args.back_to_back > 1 else "")
            + f"; jax {jax.__version__}; "
            f"extra XLA flags: {args.xla_flags or 'none'}"
            + (f"; rows{COMPARED} also with "
               + " ".join(filter(None, (args.compare_xla_flags, args.compare_env)))
               if args.compare_xla_flags or args.compare_env else ""),
            f"load average (1/5/15 min) at start: {load_before}"]
  for line in header:
    log(line)
  try:
    rows, accounts = two_core(shape, args.vocab, m, pairs=args.pairs, warmup=args.warmup,
                              cores=tuple(c.strip() for c in args.cores.split(",")),
                              schedules=[n for n in dict.fromkeys(["2bw", *args.schedules])
                                         if n != "none"],
                              processes=args.processes, account_steps=args.account,
                              xla_flags=args.xla_flags,
                              compare_flags=args.compare_xla_flags,
                              compare_env=dict(v.split("=", 1) for v in args.compare_env.split()),
                              back_to_back=args.back_to_back, instances=args.instances, log=log)
  except RuntimeError as e:
    print(f"bench_pipeline: {e}", file=sys.stderr)
    return 1
  footer = [f"load average at end: {load()}; wall time {time.time() - started:.0f} s"]
  text = ("\n".join(header) + "\n\n### Two cores against one (S=2, M=" + str(m) + ")\n\n"
          + two_core_table(rows) + "\n")
  for vocab, acc in accounts.items():
    text += (f"\n### Where each step's time went, vocabulary {vocab} (ms per step, mean of "
             f"the {args.account - 1} traced steps after the first)\n\n"
             + account_tables(acc) + "\n")
  text += "\n" + "\n".join(footer) + "\n"
  print(text)
  write(text, args.out_md, log)
  if args.out_json:
    write(json.dumps({"header": header, "footer": footer, "rows": rows,
                      "accounts": {str(k): v for k, v in accounts.items()}}, indent=1),
          args.out_json, log)
  return 0


if __name__ == "__main__":
  sys.exit(worker(json.loads(sys.argv[1])))
