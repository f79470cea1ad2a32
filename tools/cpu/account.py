"""Where a step's time goes: a `jax.profiler` trace of training steps, accounted per device.

`profile_steps` runs a jitted step function a few times under
`jax.profiler` (with a Perfetto trace) and `account` reads the trace back.
Every operation XLA ran is an event with the device it ran for and its HLO
instruction's name; the compiled program's HLO text maps each instruction to
its opcode and to the `jax.named_scope` it was traced under, and the engine
traces each phase of a tick under its own scope (`jaxpipe.pipeline.PHASE`:
embedding, forward, head, backward, zb1's weight gradient, embedding
gradient, sends, the once-per-step gradient reduction and the optimizer
update). So each
microsecond of each device in a step falls in exactly one of:

- `<phase>`: an operation of that phase computing;
- `<phase> collective`: a collective of that phase (all-reduce, all-gather,
  collective-permute, all-to-all, reduce-scatter) moving data, and
  `<phase> wait`: the part of it spent waiting for the other devices to
  arrive (XLA's rendezvous);
- `idle`: inside the step, no operation of this device in flight (the
  runtime between operations, a thread not scheduled). An operation is in
  flight from its event's start until the runtime marks it complete, which
  for a dot is later than its event's end: XLA's CPU runtime splits every
  dot over the process's intra-op thread pool and runs the rest untraced
  (`_completed`); the account credits that time to the dot's phase, also
  where the rest waited for a pool thread busy with another device;
- `host gap`: between the end of the previous step on every device and the
  first operation of this one (the host preparing and dispatching it).

Beside the time, `account` counts each device's collectives per step by
kind, with their bytes (`hlo_transfers`): what a schedule moves point to
point (`collective-permute`) and in collectives, as executed (a collective
under a branch not taken is not counted).

The parts of a device add up to the interval between two steps'
completions, the same interval the trainer reports as `step_time_s`;
`account` also returns that interval as the host measured it, so a reader
can check the trace against the wall clock.

Written by hand: no library reads XLA's CPU trace by phase. The trace format
is the Chrome/Perfetto JSON that `jax.profiler.start_trace(...,
create_perfetto_trace=True)` writes; each operation event carries
`args.device_ordinal` and `args.hlo_op` (XLA's thunk executor on the CPU;
GPU traces name kernels instead, which this module does not read).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics
import time
from typing import Any, Callable, Iterable, Optional

from jaxpipe import hlo

__all__ = ["COLLECTIVES", "hlo_ops", "hlo_transfers", "read_trace", "account", "partitions_of",
           "profile_steps", "summarise"]

COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")
# Control flow: its events span the operations inside it, which are counted instead.
_CONTAINERS = ("while", "conditional", "call")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?(?<![\w.\-])([a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_PHASE = re.compile(r"pipe_([a-z_]+)")


def _instructions(hlo_text: str) -> Iterable[tuple[str, str, str]]:
  """(line, name, opcode) of each instruction of an HLO module's text."""
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      yield line, m.group(1), m.group(2)


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
  """{instruction name: (opcode, phase)} of a compiled module's HLO text.

  The phase is the outermost `pipe_<phase>` named scope in the instruction's
  metadata (a backward's operations carry the forward's scopes inside their
  `transpose(...)`), or 'other' where it has none.
  """
  out = {}
  for line, name, opcode in _instructions(hlo_text):
    meta = _OP_NAME.search(line)
    phases = _PHASE.findall(meta.group(1)) if meta else []
    out[name] = (opcode, phases[0] if phases else "other")
  return out


_PAIRS = re.compile(r"source_target_pairs=\{([^=]*)\}")


def hlo_transfers(hlo_text: str) -> dict[str, tuple[str, int, Optional[frozenset[int]]]]:
  """{instruction name: (kind, bytes, sources)} of each collective of a compiled module.

  `kind` is the collective's opcode without `-start`; `bytes` the size of
  its result (all of a tuple's arrays): for a `collective-permute` what each
  sending device sends, for the others what each device ends up holding.
  `sources` is the set of devices (partitions) a `collective-permute` sends
  from, None for the other kinds (every device takes part). A `-done` half
  of an asynchronous collective is left out, so that each counts once; a
  collective wrapped in a generic `async-start` (as a GPU compile may wrap
  all-to-all or reduce-scatter) is not read (XLA's CPU compile runs
  collectives synchronously).
  """
  out = {}
  for line, name, opcode in _instructions(hlo_text):
    kind = _base_opcode(opcode)
    if opcode.endswith("-done") or kind not in COLLECTIVES:
      continue
    result = line[line.index("=") + 1:line.index(f"{opcode}(")]
    arrays = hlo.arrays(result)
    if opcode in ("collective-permute-start", "all-gather-start"):
      # Their result is (operands, results, then u32[] contexts): the results alone.
      while len(arrays) > 2 and arrays[-1] == ("u32", ()):
        arrays.pop()
      arrays = arrays[len(arrays) // 2:]
    size = sum(hlo.array_bytes(t, dims) for t, dims in arrays)
    sources = None
    pairs = _PAIRS.search(line)
    if kind == "collective-permute" and pairs:
      sources = frozenset(int(a) for a, _ in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)))
    out[name] = (kind, size, sources)
  return out


def _base_opcode(opcode: str) -> str:
  for suffix in ("-start", "-done"):
    if opcode.endswith(suffix):
      return opcode[:-len(suffix)]
  return opcode


def read_trace(trace_dir: str) -> list[dict[str, Any]]:
  """The complete ('X') events of the newest Perfetto trace under `trace_dir`."""
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                           recursive=True), key=os.path.getmtime)
  if not files:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  with gzip.open(files[-1], "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  return [e for e in events if e.get("ph") == "X"]


def _waits(events: list[dict[str, Any]]) -> dict[Any, list[tuple[float, float]]]:
  """Per thread, the intervals its rendezvous spent waiting for the other devices."""
  out: dict[Any, list[tuple[float, float]]] = collections.defaultdict(list)
  for e in events:
    if e["name"].startswith("Wait"):
      out[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
  for v in out.values():
    v.sort()
  return out


def _completed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The events, each operation's lasting until the runtime marked it complete.

  XLA's CPU runtime may complete an operation after its event ends: a dot
  (`DotThunk`) splits its matmul into tasks on the process's intra-op
  thread pool, whatever `--xla_cpu_multi_thread_eigen` says, and its event
  covers only the launch and the part the launching thread ran; the rest
  runs, untraced, on a pool thread, and the runtime records `end: <op>` when
  the last part is done. A device runs one instance of an operation at a
  time (a loop's next iteration waits for its body), so a mark belongs to
  the latest start of that operation on some device; of those, it is paired
  with the earliest on the mark's thread (where it nearly always lands),
  else on any thread. An operation whose mark comes after its event's end
  is extended to the mark, but never past the last event's end of its own
  step (`run_id`), so that a start whose mark the trace lost cannot stretch
  into a later step (copies; the input is not changed).
  """
  # {(operation, thread) or operation: {device: index of its latest unpaired start}}
  latest: dict[Any, dict[str, int]] = collections.defaultdict(dict)
  ends: dict[int, float] = {}
  step_end: dict[Any, float] = collections.defaultdict(float)
  for i in sorted(range(len(events)), key=lambda i: events[i]["ts"]):
    e = events[i]
    name, args = e.get("name", ""), e.get("args") or {}
    if "run_id" in args:
      step_end[args["run_id"]] = max(step_end[args["run_id"]], e["ts"] + e["dur"])
    if "hlo_op" in args:
      op, device = args["hlo_op"], args.get("device_ordinal")
      # The device has finished its earlier instance (a loop's next
      # iteration waits for its body), so only this start can take a mark.
      before = latest[op].get(device)
      if before is not None and latest[(op, events[before]["tid"])].get(device) == before:
        del latest[(op, events[before]["tid"])][device]
      latest[(op, e["tid"])][device] = i
      latest[op][device] = i
    elif name.startswith("end: "):
      op = name[5:]
      found = latest.get((op, e["tid"])) or latest.get(op)
      if not found:
        continue
      device, j = min(found.items(), key=lambda kv: events[kv[1]]["ts"])
      ends[j] = e["ts"]
      for key in ((op, events[j]["tid"]), op):
        if latest[key].get(device) == j:
          del latest[key][device]
  out = list(events)
  for i, end in ends.items():
    e = events[i]
    run = (e.get("args") or {}).get("run_id")
    if run is not None:
      end = min(end, step_end[run])
    if end > e["ts"] + e["dur"]:
      out[i] = dict(e, dur=end - e["ts"])
  return out


def _overlap(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
  total = 0.0
  for a, b in intervals:
    if a >= hi:
      break
    total += max(0.0, min(b, hi) - max(a, lo))
  return total


def _device_timeline(ops: list[dict[str, Any]], info: dict[str, tuple[str, str]],
                     waits) -> list[tuple[float, float, str]]:
  """A device's time as (start, end, part) pieces, the innermost operation winning.

  Operations of one device may nest (a loop's body inside the loop) or, where
  the runtime runs independent operations at once, overlap; each instant goes
  to the operation that started last among those running.
  """
  ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
  edges = sorted({e["ts"] for e in ops} | {e["ts"] + e["dur"] for e in ops})
  pieces = []
  active: list[dict[str, Any]] = []
  i = 0
  for lo, hi in zip(edges, edges[1:]):
    while i < len(ops) and ops[i]["ts"] <= lo:
      active.append(ops[i])
      i += 1
    active = [e for e in active if e["ts"] + e["dur"] > lo]
    if not active:
      continue
    e = active[-1]
    opcode, phase = info.get(e["args"]["hlo_op"], ("?", "other"))
    if _base_opcode(opcode) in COLLECTIVES:
      wait = _overlap(waits.get(e["tid"], []), lo, hi)
      if wait > 0:
        pieces.append((lo, lo + wait, f"{phase} wait"))
      if hi - lo - wait > 0:
        pieces.append((lo + wait, hi, f"{phase} collective"))
    else:
      pieces.append((lo, hi, phase))
  return pieces


def _transfers(ops: list[dict[str, Any]], sizes: dict[str, tuple[str, int, Any]],
               partition: int) -> dict[str, dict[str, float]]:
  """{kind: {"count", "bytes"}} of the collectives one device ran in a step.

  A collective-permute counts where the device's `partition` (its place in
  the program's mesh) is one of its sources.
  """
  out: dict[str, dict[str, float]] = {}
  for e in ops:
    found = sizes.get(e["args"]["hlo_op"])
    if found is None:
      continue
    kind, size, sources = found
    if sources is not None and partition not in sources:
      continue
    acc = out.setdefault(kind, {"count": 0, "bytes": 0})
    acc["count"] += 1
    acc["bytes"] += size
  return out


def account(events: list[dict[str, Any]], hlo_text: str,
            completions: Optional[list[float]] = None,
            partitions: Optional[dict[int, int]] = None) -> dict[str, Any]:
  """Each step's time per device and part, from a trace of consecutive steps.

  Args:
    events: the trace's complete events (`read_trace`).
    hlo_text: the compiled step's HLO (`compiled.as_text()`), which names
      each operation's opcode and phase.
    completions: the host's clock (seconds) when each traced step's results
      were ready, for the measured interval beside the trace's.
    partitions: {device ordinal in the trace: its place in the program's
      mesh}, for the senders of a collective-permute; by default each
      ordinal is its own place (one process, a mesh of `jax.devices()` in
      order). `partitions_of(mesh)` gives it for any mesh.

  Returns:
    {"steps": [{"span_us": ..., "host_gap_us": ..., "interval_us": ...,
    "measured_us": ..., "devices": {ordinal: {part: microseconds}},
    "transfers": {ordinal: {kind: {"count": n, "bytes": b}}}}], ...}:
    one entry per step after the first traced one (whose gap to its
    predecessor is unknown). A device's parts add up to interval_us =
    host_gap_us + span_us.
  """
  info = hlo_ops(hlo_text)
  sizes = hlo_transfers(hlo_text)
  waits = _waits(events)
  events = _completed(events)
  runs: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
  for e in events:
    args = e.get("args") or {}
    if "device_ordinal" in args and "hlo_op" in args and "run_id" in args:
      if info.get(args["hlo_op"], ("", ""))[0] in _CONTAINERS:
        continue
      runs[args["run_id"]].append(e)
  order = sorted(runs, key=lambda r: min(e["ts"] for e in runs[r]))
  steps, prev_end = [], None
  for n, run in enumerate(order):
    ops = runs[run]
    start = min(e["ts"] for e in ops)
    end = max(e["ts"] + e["dur"] for e in ops)
    if prev_end is not None:
      by_device: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
      for e in ops:
        by_device[int(e["args"]["device_ordinal"])].append(e)
      devices, transfers = {}, {}
      for d, dev_ops in sorted(by_device.items()):
        transfers[d] = _transfers(dev_ops, sizes, (partitions or {}).get(d, d))
        parts: dict[str, float] = collections.Counter()
        busy = 0.0
        for lo, hi, part in _device_timeline(dev_ops, info, waits):
          parts[part] += hi - lo
          busy += hi - lo
        parts["idle"] += (end - start) - busy
        parts["host gap"] += start - prev_end
        devices[d] = dict(parts)
      step = {"span_us": end - start, "host_gap_us": start - prev_end,
              "interval_us": end - prev_end, "devices": devices, "transfers": transfers}
      if completions is not None and n < len(completions):
        step["measured_us"] = (completions[n] - completions[n - 1]) * 1e6
      steps.append(step)
    prev_end = end
  return {"steps": steps}


def partitions_of(mesh: Any) -> dict[int, int]:
  """{this process's device, as a trace names it: its place in `mesh`'s devices}.

  XLA's CPU trace names a device by its id (2048 for the device of a
  second `jax.distributed` process here); the local hardware id is mapped
  too, for a runtime that names it so.
  """
  import jax  # pylint: disable=g-import-not-at-top
  place = {d.id: i for i, d in enumerate(mesh.devices.flat)}
  here = [d for d in jax.local_devices() if d.id in place]
  # Ids first: where a local hardware id equals another device's id, the id wins.
  return {**{d.local_hardware_id: place[d.id] for d in here},
          **{d.id: place[d.id] for d in here}}


def summarise(result: dict[str, Any]) -> dict[str, Any]:
  """The account per step, averaged over the traced steps: {device: {part: us}}, interval, gap.

  Each part is its mean over the steps, so a device's parts add up to the
  mean interval exactly (each step's do to its own; medians taken part by
  part would not, and the step of median interval alone carries that step's
  jitter between the trace's clock and the host's). `measured_us` is the
  host's clock over the same steps, per step: the first completion to the
  last, divided by the steps, so a late wake-up of the host counts once, not
  once per step. `median_interval_us` is the median step's interval, for
  the spread; `steps` is how many steps are accounted. `transfers`: each
  device's collectives per step by kind, count and bytes (their means).
  """
  steps = result["steps"]
  if not steps:
    return {"steps": 0, "interval_us": float("nan"), "median_interval_us": float("nan"),
            "measured_us": float("nan"), "span_us": float("nan"),
            "host_gap_us": float("nan"), "devices": {}, "transfers": {}}
  n = len(steps)
  mean = lambda key: sum(s[key] for s in steps) / n
  measured = [s["measured_us"] for s in steps if "measured_us" in s]
  devices: dict[Any, dict[str, float]] = {}
  for s in steps:
    for d, parts in s["devices"].items():
      acc = devices.setdefault(d, collections.Counter())
      for part, us in parts.items():
        acc[part] += us / n
  return {
      "steps": n,
      "interval_us": mean("interval_us"),
      "median_interval_us": statistics.median(s["interval_us"] for s in steps),
      "measured_us": sum(measured) / len(measured) if len(measured) == n else float("nan"),
      "span_us": mean("span_us"),
      "host_gap_us": mean("host_gap_us"),
      "devices": {d: dict(parts) for d, parts in sorted(devices.items())},
      "transfers": _mean_transfers(steps),
  }


def _mean_transfers(steps: list[dict[str, Any]]) -> dict[Any, dict[str, dict[str, float]]]:
  """{device: {kind: {"count", "bytes"}}}, each the mean per step."""
  out: dict[Any, dict[str, dict[str, float]]] = {}
  for s in steps:
    for d, kinds in s.get("transfers", {}).items():
      for kind, v in kinds.items():
        acc = out.setdefault(d, {}).setdefault(kind, {"count": 0.0, "bytes": 0.0})
        acc["count"] += v["count"] / len(steps)
        acc["bytes"] += v["bytes"] / len(steps)
  return {d: out[d] for d in sorted(out)}


def profile_steps(step: Callable[[], Any], ready: Callable[[Any], Any], num_steps: int,
                  trace_dir: str) -> list[float]:
  """Runs `step()` num_steps times under a trace, as a training loop does; returns completions.

  Each step is dispatched before the previous one's result is waited for
  (`ready(result)` blocks until a step's outputs exist), so the devices see
  steps back to back, as in `jaxpipe.trainer`. Returns the host clock
  (time.perf_counter) at each step's completion.
  """
  import jax  # pylint: disable=g-import-not-at-top
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  try:
    done, pending = [], None
    for _ in range(num_steps):
      out = step()
      if pending is not None:
        ready(pending)
        done.append(time.perf_counter())
      pending = out
    ready(pending)
    done.append(time.perf_counter())
  finally:
    jax.profiler.stop_trace()
  return done


def parts_in_order(parts: Iterable[str]) -> list[str]:
  """The parts of an account in reading order: phases of a tick, then the rest."""
  from jaxpipe.pipeline import PHASE  # pylint: disable=g-import-not-at-top
  phases = list(PHASE) + ["other"]
  rank = {}
  for i, p in enumerate(phases):
    for j, suffix in enumerate(("", " collective", " wait")):
      rank[f"{p}{suffix}"] = 3 * i + j
  rank["idle"], rank["host gap"] = 1000, 1001
  return sorted(parts, key=lambda p: rank.get(p, 999))
