"""A compiled GPU program read as a GPU would run it: collectives, overlap, a projected step.

`read_program(module, ...)` walks the scheduled HLO of a step compiled for
GPUs (`jaxpipe.hlo.Module`) in its program order, as one stream of kernels
beside asynchronous transfers, and projects each device's step time with a
model stated here in full:

- a kernel (a fusion, a cuBLAS or Triton GEMM, a cuDNN attention, a copy)
  lasts max(its matmul FLOPs at the GPU's dense peak for their element
  type, the bytes it reads and writes at the memory's bandwidth) plus
  `KERNEL_OVERHEAD_S`, the time between two kernels of a stream. bfloat16
  and float16 matmuls run at the bfloat16 peak, float32 ones at half of
  it (TF32, XLA's default precision on NVIDIA GPUs), 8-bit ones at twice;
  a fusion that reads a slice of an operand, or updates one in place,
  counts the slice;
- a `while` loop costs its trip count times its body and condition; a
  `conditional` costs its slowest branch: every stage runs the same
  program, each takes its own branch, and a tick, which ends in a transfer
  between stages, lasts as long as its slowest stage;
- a collective moves bytes over NVLink within a node and over the network
  (`network_gbps` per GPU) across nodes: a permute sends its operand, an
  all-reduce moves 2(n-1)/n of it (a ring), an all-gather (n-1) times its
  operand, a reduce-scatter and an all-to-all (n-1)/n of it; each costs
  `LATENCY_S` (within a node) or `NETWORK_LATENCY_S` (across) on top.
  A synchronous collective stops the stream; an asynchronous one
  (`-start` ... `-done`) runs beside the kernels scheduled between its
  start and its done, and only what is left of it when the done is reached
  is added (the exposed time).

It is a projection, not a measurement: no cache effects, no contention
between a transfer and the kernels it overlaps, no host. Each collective
site is reported with its count per step, bytes, whether it is
asynchronous and crosses nodes, and (for the tick loops' stage-to-stage
transfers) the matmul FLOPs scheduled between its start and its done: what
it can hide behind.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional

from jaxpipe import hlo

__all__ = ["KERNEL_OVERHEAD_S", "LATENCY_S", "NETWORK_LATENCY_S", "Links", "Transfer",
           "ProgramCost", "read_program", "attention_kernels"]

# Round figures, stated rather than measured here (no GPU is lent to this
# project): the gap between two kernels on one CUDA stream without a graph,
# and NCCL's latency for a small message inside a node and across nodes.
KERNEL_OVERHEAD_S = 2e-6
LATENCY_S = 10e-6
NETWORK_LATENCY_S = 20e-6

# Ops that launch no kernel: they name, split or join buffers.
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                   "partition-id", "replica-id", "after-all", "opt-barrier", "add-dependency",
                   "domain", "send", "send-done"})
# An operand read only through these is read in part (the slice's bytes).
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
_PHASE = re.compile(r"pipe_([a-z_]+)")
_TICKS = re.compile(r"ticks_([fbw]+)")
# The phases whose matmuls are the blocks' (`jaxpipe.pipeline.PHASE`).
_BLOCK_PHASES = frozenset({"forward", "backward", "weight_grad"})
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_PEAK_FACTOR = {"bf16": 1.0, "f16": 1.0, "f32": 0.5, "tf32": 0.5, "f8e4m3fn": 2.0,
                "f8e5m2": 2.0, "s8": 2.0, "f64": 1 / 15}


@dataclasses.dataclass(frozen=True)
class Links:
  """What the projection assumes of the GPUs and the wires between them.

  Attributes:
    peak_flops: dense bfloat16 FLOP/s of one GPU.
    memory_bandwidth: bytes per second of its memory.
    link_bandwidth: bytes per second one GPU sends to another of its node.
    network_bandwidth: bytes per second one GPU sends to a GPU of another node.
    node_of: the node of each device of the program, by its id (its place
      in the program's device assignment).
  """
  peak_flops: float
  memory_bandwidth: float
  link_bandwidth: float
  network_bandwidth: float
  node_of: tuple[int, ...]


@dataclasses.dataclass
class Transfer:
  """One collective of the program, as one site of its text.

  Attributes:
    name: the instruction (its `-start` where asynchronous).
    kind: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, ...
    count: how many times a step runs it (loops' trips multiplied in).
    bytes: what each device puts in, each time.
    asynchronous: whether it runs beside kernels (`-start` ... `-done`).
    across_nodes: whether some group (or pair) spans two nodes.
    group_size: devices per group (2 for a permute's pair).
    phase: the outermost `pipe_<phase>` scope of its metadata ('send' for
      the stage-to-stage transfers of a tick), else 'other'.
    in_loop: whether it runs inside a `while` loop (the tick loops).
    ticks: the work of the tick loop it runs in, from the loop's named
      scope ('fb': a forward and a backward, the steady ticks of 1f1b, 2bw,
      pipedream and interleaved; 'fbw': zb1's; 'f', 'b': fill, drain and
      gpipe's), or None outside the tick loops.
    seconds: its duration by the model, each time.
    hidden_flops: matmul FLOPs scheduled between its start and done, each
      time (0 for a synchronous one).
    hidden_block_flops: the part of them that is the blocks' (the forward,
      backward and weight-gradient phases, not the head's).
    hidden_s: the kernels' time between its start and done, each time.
    exposed_s: what of `seconds` the stream waits for, each time.
  """
  name: str
  kind: str
  count: int
  bytes: int
  asynchronous: bool
  across_nodes: bool
  group_size: int
  phase: str
  in_loop: bool
  ticks: Optional[str]
  seconds: float
  hidden_flops: float = 0.0
  hidden_block_flops: float = 0.0
  hidden_s: float = 0.0
  exposed_s: float = 0.0

  def as_json(self) -> dict[str, Any]:
    """The fields under the names the planner's JSON uses."""
    return {"name": self.name, "kind": self.kind, "count": self.count, "bytes": self.bytes,
            "async": self.asynchronous, "across_nodes": self.across_nodes,
            "group_size": self.group_size, "phase": self.phase, "in_loop": self.in_loop,
            "ticks": self.ticks, "seconds": self.seconds, "hidden_flops": self.hidden_flops,
            "hidden_block_flops": self.hidden_block_flops,
            "hidden_s": self.hidden_s, "exposed_s": self.exposed_s}


@dataclasses.dataclass
class ProgramCost:
  """A computation's projected cost for one run of it, on one device.

  Attributes:
    seconds: its projected duration.
    matmul_flops: {element type: FLOPs of its matrix multiplications}.
    block_flops: the part of them in the blocks' phases (not the head's).
    memory_bytes: bytes its kernels read and write.
    kernels: kernels it launches.
    transfers: {site name: Transfer} (counts per run of the computation).
    exposed_s: time the stream waits for transfers (synchronous ones whole).
  """
  seconds: float = 0.0
  matmul_flops: dict[str, float] = dataclasses.field(default_factory=dict)
  block_flops: float = 0.0
  memory_bytes: float = 0.0
  kernels: int = 0
  transfers: dict[str, Transfer] = dataclasses.field(default_factory=dict)
  exposed_s: float = 0.0

  @property
  def flops(self) -> float:
    """Matmul FLOPs of every element type."""
    return sum(self.matmul_flops.values())

  def add(self, other: "ProgramCost", times: int = 1) -> None:
    """Adds `times` runs of `other` (its duration included)."""
    self.seconds += times * other.seconds
    self.exposed_s += times * other.exposed_s
    self.memory_bytes += times * other.memory_bytes
    self.block_flops += times * other.block_flops
    self.kernels += times * other.kernels
    for t, f in other.matmul_flops.items():
      self.matmul_flops[t] = self.matmul_flops.get(t, 0.0) + times * f
    for name, tr in other.transfers.items():
      mine = self.transfers.get(name)
      if mine is None:
        self.transfers[name] = dataclasses.replace(tr, count=tr.count * times)
      else:
        mine.count += tr.count * times


@dataclasses.dataclass
class _Open:
  """An asynchronous start whose done is still ahead: when it began, and what it carries."""
  t0: float
  flops0: float
  block0: float
  transfer: Optional[Transfer] = None
  side_s: float = 0.0  # work on another stream (no transfer): its duration


def _phase(ins: hlo.Instruction) -> str:
  meta = _OP_NAME.search(ins.attrs)
  phases = _PHASE.findall(meta.group(1)) if meta else []
  return phases[0] if phases else "other"


def _ticks(ins: hlo.Instruction) -> Optional[str]:
  meta = _OP_NAME.search(ins.attrs)
  found = _TICKS.search(meta.group(1)) if meta else None
  return found.group(1) if found else None


def _kind(opcode: str) -> Optional[str]:
  base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
  return base if base in hlo.COLLECTIVE_KINDS else None


class _Reader:
  """Walks a module's computations and prices them (see the module's doc)."""

  def __init__(self, module: hlo.Module, links: Links):
    self.module, self.links = module, links
    self.memo: dict[tuple[str, bool], ProgramCost] = {}

  # -- kernels ------------------------------------------------------------------

  def _operand_bytes(self, comp: hlo.Computation, ins: hlo.Instruction) -> float:
    return sum(hlo.shape_bytes(self.module.shape_of(comp, o)) for o in ins.operands)

  def _fusion_bytes(self, comp: hlo.Computation, ins: hlo.Instruction) -> float:
    """Bytes a fusion reads and writes: slices where it reads or updates a slice."""
    sub = next((self.module.computations[n] for n in ins.called
                if n in self.module.computations), None)
    if sub is None:
      return self._operand_bytes(comp, ins) + ins.nbytes
    users: dict[str, list[hlo.Instruction]] = {}
    for inner in sub.instructions:
      for o in inner.operands:
        users.setdefault(o, []).append(inner)
    read = 0.0
    for p in (x for x in sub.instructions if x.opcode == "parameter"):
      uses = users.get(p.name, [])
      if uses and all(u.opcode in _SLICING and u.operands[0] == p.name for u in uses):
        read += sum(u.nbytes for u in uses)
      elif uses and all(u.opcode == "dynamic-update-slice" and u.operands[0] == p.name
                        for u in uses):
        pass  # updated in place: only the update moves
      else:
        read += p.nbytes
    written = 0.0
    roots = ([sub.by_name[o] for o in sub.root.operands if o in sub.by_name]
             if sub.root.opcode == "tuple" else [sub.root])
    for r in roots:
      if r.opcode == "dynamic-update-slice" and len(r.operands) > 1:
        written += hlo.shape_bytes(sub.by_name[r.operands[1]].shape) \
            if r.operands[1] in sub.by_name else r.nbytes
      else:
        written += r.nbytes
    return read + written

  def _kernel(self, comp: hlo.Computation, ins: hlo.Instruction) -> ProgramCost:
    flops, dtype = hlo.matmul_flops(self.module, comp, ins)
    if ins.opcode == "fusion":
      nbytes = self._fusion_bytes(comp, ins)
    elif ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
      nbytes = 2.0 * hlo.shape_bytes(self.module.shape_of(comp, ins.operands[1]))
    elif ins.opcode in _SLICING:
      nbytes = 2.0 * ins.nbytes
    else:
      nbytes = self._operand_bytes(comp, ins) + ins.nbytes
    peak = self.links.peak_flops * _PEAK_FACTOR.get(dtype, 1.0)
    seconds = max(flops / peak if flops else 0.0, nbytes / self.links.memory_bandwidth)
    cost = ProgramCost(seconds + KERNEL_OVERHEAD_S, memory_bytes=nbytes, kernels=1)
    if flops:
      cost.matmul_flops[dtype or "?"] = flops
      if _phase(ins) in _BLOCK_PHASES:
        cost.block_flops = flops
    return cost

  # -- collectives --------------------------------------------------------------

  def _transfer(self, comp: hlo.Computation, ins: hlo.Instruction, kind: str,
                asynchronous: bool, in_loop: bool) -> Transfer:
    groups = hlo.collective_groups(ins)
    nodes = self.links.node_of
    if kind in ("collective-permute", "send-recv"):
      size = 2
      across = any(nodes[a] != nodes[b] for a, b in groups if a < len(nodes) and b < len(nodes))
    else:
      if not groups:
        groups = [list(range(len(nodes)))]
      size = max(len(g) for g in groups)
      across = any(len({nodes[d] for d in g if d < len(nodes)}) > 1 for g in groups)
    if kind == "send-recv":  # (data, context, token): the data's bytes
      dtype, dims = hlo.arrays(ins.shape)[0]
      nbytes = math.prod(dims) * hlo.dtype_bits(dtype) // 8
    else:
      nbytes = int(self._operand_bytes(comp, ins))
    bandwidth = self.links.network_bandwidth if across else self.links.link_bandwidth
    share = {"collective-permute": 1.0, "send-recv": 1.0, "all-reduce": 2.0 * (size - 1) / size,
             "all-gather": float(size - 1)}.get(kind, (size - 1) / size)
    seconds = 0.0 if size <= 1 else (
        share * nbytes / bandwidth + (NETWORK_LATENCY_S if across else LATENCY_S))
    return Transfer(ins.name, kind, 1, nbytes, asynchronous, across, size, _phase(ins),
                    in_loop, _ticks(ins), seconds)

  # -- computations -------------------------------------------------------------

  def cost(self, name: str, in_loop: bool = False) -> ProgramCost:
    """The projected cost of one run of computation `name` (memoised)."""
    key = (name, in_loop)
    if key not in self.memo:
      self.memo[key] = self._walk(self.module.computations[name], in_loop)
    return self.memo[key]

  def _walk(self, comp: hlo.Computation, in_loop: bool) -> ProgramCost:
    total = ProgramCost()
    started: dict[str, _Open] = {}
    for ins in comp.instructions:
      op = ins.opcode
      if op in _FREE:
        continue
      if op == "while":
        body, cond = ins.attr("body"), ins.attr("condition")
        trips = hlo.trip_count(ins) or 1
        for sub in (body, cond):
          if sub:
            total.add(self.cost(sub.lstrip("%"), True), trips)
        continue
      if op == "conditional":
        branches = [self.cost(n, in_loop) for n in ins.called if n in self.module.computations]
        if branches:
          total.add(max(branches, key=lambda c: c.seconds))
        continue
      if op == "call":
        for n in ins.called:
          if n in self.module.computations:
            total.add(self.cost(n, in_loop))
        continue
      kind = _kind(op)
      if op == "async-start":
        inner = [self.module.computations[n] for n in ins.called
                 if n in self.module.computations]
        wrapped = next((i for c in inner for i in c.instructions if _kind(i.opcode)), None)
        if wrapped is not None:
          tr = self._transfer(inner[0], wrapped, _kind(wrapped.opcode), True, in_loop)
          tr.name = ins.name
          started[ins.name] = _Open(total.seconds, total.flops, total.block_flops, tr)
        else:
          # Work on another stream: it ends by its done, at the latest.
          side = ProgramCost()
          for c in inner:
            side.add(self.cost(c.name, in_loop))
          started[ins.name] = _Open(total.seconds, total.flops, total.block_flops,
                                    side_s=side.seconds)
          total.add(dataclasses.replace(side, seconds=0.0))
        continue
      if kind is not None and op.endswith("-start"):
        tr = self._transfer(comp, ins, kind, True, in_loop)
        started[ins.name] = _Open(total.seconds, total.flops, total.block_flops, tr)
        continue
      if op.endswith("-done") or op == "recv-done":
        begun = started.pop(ins.operands[0], None) if ins.operands else None
        if begun is None:
          continue
        tr = begun.transfer
        if tr is None:
          total.seconds = max(total.seconds, begun.t0 + begun.side_s)
          continue
        tr.hidden_s = total.seconds - begun.t0
        tr.hidden_flops = total.flops - begun.flops0
        tr.hidden_block_flops = total.block_flops - begun.block0
        tr.exposed_s = max(0.0, tr.seconds - tr.hidden_s)
        total.seconds += tr.exposed_s
        total.exposed_s += tr.exposed_s
        total.transfers[tr.name] = tr
        continue
      if kind is not None:
        tr = self._transfer(comp, ins, kind, False, in_loop)
        tr.exposed_s = tr.seconds
        total.seconds += tr.seconds
        total.exposed_s += tr.seconds
        total.transfers[tr.name] = tr
        continue
      if op == "recv":
        # A permute XLA lowered to send and recv: the transfer runs from
        # the recv to its done (the send and its done launch nothing).
        started[ins.name] = _Open(total.seconds, total.flops, total.block_flops,
                                  self._transfer(comp, ins, "send-recv", True, in_loop))
        continue
      total.add(self._kernel(comp, ins))
    return total


def read_program(module: hlo.Module, links: Links) -> ProgramCost:
  """The projected cost of one run of the module's entry computation (one training step)."""
  return _Reader(module, links).cost(module.entry_name)


def attention_kernels(module: hlo.Module) -> dict[str, int]:
  """{custom-call target: instructions} of the fused attention kernels in the program (cuDNN's)."""
  out: dict[str, int] = {}
  for _, ins in module.walk():
    if ins.opcode == "custom-call":
      target = (ins.attr("custom_call_target") or "").strip('"')
      if "fmha" in target or "flash" in target.lower():
        out[target] = out.get(target, 0) + 1
  return out
