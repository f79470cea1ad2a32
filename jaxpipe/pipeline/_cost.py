"""What one stage's tick costs, measured on that stage's program alone.

A whole scanned step cannot say how work splits between stages: XLA's cost
analysis counts a loop body once, and a stage's position is only known at run
time. `stage_tick` builds the program of one steady-state tick of one stage
(`Engine(solo_stage=s)`: its position a constant, on a one-device mesh, with
this stage's slice of the weights and the vocabulary), and `flops` counts
the floating-point operations of a traced program, multiplying loop bodies by
their trip counts. The planner and the benchmarks read per-stage work from
here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxpipe.pipeline._engine import DATA, STAGE, Engine, StageFns, residual_shapes
from jaxpipe.pipeline._split import SplitStage
from jaxpipe.pipeline._timetable import StepPlan

Tree = Any

__all__ = ["stage_tick", "flops", "one_tick_plan", "MemoryTerm", "PHASES", "memory_terms",
           "memory_total"]

_PER_ROW = ("fwd", "bwd", "fwd_version", "bwd_version", "acc", "fwd_slot", "bwd_slot",
            "embed_version", "head_version", "head_acc", "embed_grad_version", "embed_acc",
            "fwd_chunk", "bwd_chunk", "wgt", "bwd_wslot", "wgt_slot")


def one_tick_plan(plan: StepPlan, tick: int) -> StepPlan:
  """The plan cut down to tick `tick` alone (same stages, versions, slots)."""
  cut = {k: getattr(plan, k)[tick:tick + 1] for k in _PER_ROW}
  return dataclasses.replace(plan, **cut)


def _local(tree: Tree, axes: Tree, num_stages: int) -> Tree:
  def one(x, a):
    shape = list(x.shape)
    if a is not None:
      shape[a] //= num_stages
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
  return jax.tree.map(one, tree, axes, is_leaf=lambda a: a is None)


def stage_tick(fns: StageFns, plan: StepPlan, stage: int, blocks: Tree, shared: Tree,
               tokens: jax.ShapeDtypeStruct, *, stash: str, tick: int = -1
               ) -> tuple[Callable, tuple]:
  """(function, abstract arguments) of stage `stage`'s work in one tick of `plan`.

  Args:
    fns: the model's stage functions.
    plan: the schedule's step plan; `tick` (default: the last, a steady-state
      tick) is the one costed.
    stage: which stage's program.
    blocks, shared: abstract parameters of the whole model (natural layout,
      vocabulary padded to a multiple of S); the stage's share is cut from them.
    tokens: abstract [b, t] token ids of one microbatch on one device.
    stash: 'inputs' or 'residuals'.

  The function takes (blocks, shared, tokens) with this stage's shapes and
  returns the tick's carry; it runs on a one-device mesh.
  """
  s_ = plan.num_stages
  tick = tick % plan.num_ticks
  engine = Engine(fns, one_tick_plan(plan, tick), stash=stash, solo_stage=stage)
  blocks_l = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // s_,) + x.shape[1:],
                                                         x.dtype), blocks)
  shared_l = _local(shared, fns.vocab_axes, s_)
  window = jax.ShapeDtypeStruct((plan.window,) + tokens.shape, tokens.dtype)
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), (STAGE, DATA),
              axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x_like = jax.eval_shape(fns.embed, shared_l, tokens)
  versions = plan.num_versions
  shared_versions = plan.num_shared_versions

  def body(blocks, shared, window):
    carry = engine.empty_carry(blocks, shared, x_like)
    carry = engine.run((blocks,) * versions, (shared,) * shared_versions, window, window,
                       carry, has_history=jnp.array(True), slot_base=jnp.int32(0))
    return jax.tree.map(lambda x: x[None, None], carry)

  fn = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(STAGE, DATA), check_vma=True)
  return jax.jit(fn), (blocks_l, shared_l, window)


# Primitives whose cost is their output size (one operation per element).
_ELEMENTWISE = {
    "add", "sub", "mul", "div", "neg", "max", "min", "exp", "exp2", "log", "log1p", "tanh",
    "logistic", "sqrt", "rsqrt", "pow", "integer_pow", "sin", "cos", "abs", "sign", "erf",
    "select_n", "reduce_sum", "reduce_max", "reduce_min", "cumsum", "square", "expm1",
}


def _size(aval) -> int:
  return int(np.prod(aval.shape)) if hasattr(aval, "shape") else 1


def _subjaxprs(eqn):
  for value in eqn.params.values():
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
      if isinstance(v, jax.extend.core.ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, jax.extend.core.Jaxpr):
        yield v


def _count(jaxpr) -> tuple[float, float]:
  matmul = other = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval
      k = int(np.prod([lhs.shape[d] for d in contract])) if contract else 1
      matmul += 2.0 * _size(eqn.outvars[0].aval) * k
      continue
    subs = list(_subjaxprs(eqn))
    if name == "scan":
      m, o = _count(eqn.params["jaxpr"].jaxpr)
      matmul += eqn.params["length"] * m
      other += eqn.params["length"] * o
    elif name == "cond":
      costs = [_count(b.jaxpr) for b in eqn.params["branches"]]
      matmul += max(c[0] for c in costs)
      other += max(c[1] for c in costs)
    elif name == "while":
      raise ValueError("flops: a while loop has no static trip count")
    elif subs:
      for sub in subs:
        m, o = _count(sub)
        matmul, other = matmul + m, other + o
    elif name in _ELEMENTWISE:
      other += sum(_size(v.aval) for v in eqn.outvars)
  return matmul, other


def flops(fn: Callable, *args) -> dict[str, float]:
  """Floating-point operations of `fn(*args)` from its jaxpr.

  Returns {'matmul': 2*M*N*K summed over every dot, 'elementwise': one per
  output element of arithmetic and reductions, 'total'}. Loop bodies count
  once per iteration; a cond counts its costlier branch.
  """
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  matmul, other = _count(jaxpr)
  return {"matmul": matmul, "elementwise": other, "total": matmul + other}


# --- memory per device -----------------------------------------------------------

# When each term is alive: 'state' the step's arguments (weights, optimizer,
# in-flight buffers, the token batch), held through the whole step; 'step'
# buffers alive from the first tick to the update; 'ticks' one tick loop's
# working set; 'update' the gradient reduction's and the optimizer's
# temporaries. The tick loops end before the update starts, so a step needs
# state + step + the larger of ticks and update.
PHASES = ("state", "step", "ticks", "update")


class MemoryTerm(NamedTuple):
  """One named part of a schedule's memory per device.

  Attributes:
    key: a short name ('weights', 'stash', 'head', ...), unique in a list.
    label: what the term counts, for a report.
    nbytes: bytes per device.
    phase: when it is alive (one of `PHASES`).
  """
  key: str
  label: str
  nbytes: int
  phase: str


def memory_total(terms: list[MemoryTerm]) -> int:
  """Bytes per device of a step: state + step + max(ticks, update) (see `PHASES`)."""
  by = {p: sum(t.nbytes for t in terms if t.phase == p) for p in PHASES}
  return by["state"] + by["step"] + max(by["ticks"], by["update"])


def _nbytes(tree: Tree) -> int:
  return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def _f32(tree: Tree) -> int:
  return sum(int(np.prod(x.shape, dtype=np.int64)) * 4 for x in jax.tree.leaves(tree))


def _narrow(tree: Tree) -> int:
  """Float32 bytes of the leaves narrower than float32 (0 when all are float32)."""
  return sum(int(np.prod(x.shape, dtype=np.int64)) * 4 for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.floating) and np.dtype(x.dtype).itemsize < 4)


def _shards(abstract: Tree, shardings: Tree) -> Tree:
  """Per-device shapes of `abstract` placed with `shardings`."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(s.shard_shape(x.shape), x.dtype),
                      abstract, shardings)


def _state_terms(sched, state, batch_shape, opt_parts) -> list[MemoryTerm]:
  """The schedule's state as placed on one device, by kind of field, and the token batches."""
  per_device = _shards(state, sched.state_shardings(state))
  out: dict[str, int] = {}
  for field, kind in type(state).KINDS.items():
    value = getattr(per_device, field)
    if kind in ("params", "versions"):
      out["weights"] = out.get("weights", 0) + _nbytes(value)
    elif kind == "opt":
      nbytes = jax.tree.map(_nbytes, value)
      for k, v in (opt_parts(nbytes) if opt_parts else {"opt": sum(jax.tree.leaves(nbytes))}
                   ).items():
        out[k] = out.get(k, 0) + v
    elif kind == "inflight":
      out["inflight"] = _nbytes(value)
  labels = {"weights": "weights (x versions)", "opt": "optimizer state",
            "ef": "error-feedback buffer", "delay": "delay buffer",
            "inflight": "2bw in flight (stash, partial grads)"}
  terms = [MemoryTerm(k, labels.get(k, k), v, "state") for k, v in out.items()]
  m, b, t = batch_shape
  # The step's tokens and targets, rows split over 'data'.
  return terms + [MemoryTerm("batch", "token batches", 2 * m * (b // sched.num_data) * t * 4,
                             "state")]


def _head_bytes(fns: StageFns, shared_local: Tree, tokens: int) -> int:
  """The head's float32 logits of this device's vocabulary slice, twice, and its weight gradient.

  Per chunk of `fns.loss_chunk` tokens (a microbatch's when 0): the logits
  and their gradient (the softmax's exponentials are written over the
  logits), and the float32 gradient of the output layer's slice.
  """
  axes = jax.tree.leaves(fns.vocab_axes, is_leaf=lambda a: a is None)
  leaves = jax.tree.leaves(shared_local)
  vocab = max([x.shape[a] for x, a in zip(leaves, axes) if a is not None] or [fns.vocab_size])
  chunk = min(tokens, fns.loss_chunk) if fns.loss_chunk else tokens
  out_layer = max([int(np.prod(x.shape)) * 4 for x, a in zip(leaves, axes) if a is not None]
                  or [0])
  return 2 * chunk * vocab * 4 + out_layer


def memory_terms(sched, params: Tree, batch_shape: tuple[int, int, int], *,
                 opt_parts: Optional[Callable[[Tree], dict[str, int]]] = None
                 ) -> list[MemoryTerm]:
  """Named terms of a schedule's memory per device, from the plan it executes.

  Args:
    sched: a `Schedule` (a pipelined one's engine, plan, shardings and stage
      functions are what the terms are counted from; `none` runs the whole
      model a microbatch at a time).
    params: abstract natural parameters (`jax.eval_shape` of the model's init).
    batch_shape: (M, B/M, seq) of the global batches.
    opt_parts: splits a tree of per-leaf optimizer-state bytes into named
      parts ({'opt': ..., 'ef': ...}); by default one 'opt' term.

  Returns the terms (see `MemoryTerm`, `memory_total`): the state as placed
  on one device; inside the step the float32 gradient sums, the flushed
  schedules' stash ring (held in the state with `rings_in_state`), the
  step's embedding of stage 0's inputs and their cotangents, the
  compute-dtype copies of the weights, the version copies; one tick's
  working set (the head's logits, the stash entry written and the one read,
  the backward's float32 copies and weight gradient) and the update's
  temporaries. With v > 1 chunks per device (interleaved) a stash slot, the
  backward's read and its weight gradient are one chunk's, the ring has the
  engine's slot count, and a tick adds the copy of the chunk's weights that
  it slices out of the stage's. Nothing is compiled: every
  shape comes from `jax.eval_shape`.
  """
  state = jax.eval_shape(lambda p: sched.init(p, batch_shape), params)
  terms = _state_terms(sched, state, batch_shape, opt_parts)
  if not sched.pipelined:
    return terms + _unpipelined_terms(sched.fns, params, batch_shape, sched.num_data)
  engine, plan, fns = sched.engine, sched.plan, sched.fns
  s_, d_ = sched.num_stages, sched.num_data
  chunks = plan.virtual_stages   # per device (interleaved's v); a tick runs one

  padded = jax.eval_shape(sched.pad, params)
  blocks, shared = padded["blocks"], {k: v for k, v in padded.items() if k != "blocks"}
  # Weight-sized terms: one device's shard (its experts only, under expert
  # parallelism). Activations: the stage's blocks with every expert, since a
  # device routes as many token slots through its experts as through all.
  device = _shards(padded, sched.param_shardings(padded))
  one_version = _f32(device)
  blk_chunk = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((x.shape[0] // (s_ * chunks),) + x.shape[1:], x.dtype), blocks)
  shared_local = _local(shared, fns.vocab_axes, s_)
  m, b, t = batch_shape
  tokens = jax.ShapeDtypeStruct((b // d_, t), jnp.int32)
  x_like = jax.eval_shape(fns.embed, shared_local, tokens)
  act = _nbytes(x_like)
  # A stash entry and a backward hold one chunk's residuals (the stage's when v = 1).
  prepared = jax.eval_shape(fns.prepare, blk_chunk)
  residuals = residual_shapes(fns.stage, prepared, x_like)
  entry = (_nbytes(residuals) if sched.stash == "residuals" else act) + 4  # + the aux loss

  # Gradients are summed in float32, one accumulator per batch the loop adds
  # into: 2bw's loop carries batch k-1's (its state's, copied into the
  # carry) beside batch k's.
  step = [MemoryTerm("grads", "gradient accumulators (f32)",
                     plan.num_accumulators * one_version, "step")]
  if sched.name != "2bw":   # 2bw's ring is in its state (`inflight`)
    ring = engine.num_slots * (entry + (act if plan.head_stash else 0))
    if plan.split_backward:
      # zb1's second ring (and its scratch slot): what B keeps for W, per
      # weight use its input and its output cotangent (`SplitStage`).
      w_entry = SplitStage(fns.stage).w_stash_shapes(prepared, x_like)[1]
      ring += (plan.w_slots + 1) * _nbytes(w_entry)
    # With `rings_in_state` the rings are state (`FlushedState`);
    # `_state_terms` leaves that field to this term.
    step.append(MemoryTerm("stash", "stash ring (slots x entry; zb1: and W's ring)", ring,
                           "state" if sched.keeps_rings else "step"))
  # The step's embedding (`Embedding.inputs`): stage 0's inputs of every
  # microbatch it starts, looked up in the table's dtype, then cast; and the
  # stage-0 input cotangents that the longest loop with a backward stacks.
  e = engine.step_embedding
  lookup = jax.eval_shape(fns.embed, shared_local, tokens)
  table_dtype = jax.tree.leaves(shared_local)[0].dtype
  wide = (_nbytes(lookup) // np.dtype(lookup.dtype).itemsize * np.dtype(table_dtype).itemsize
          if np.dtype(table_dtype) != np.dtype(lookup.dtype) else 0)
  embed = len(e.forwards) * (act + wide)
  longest_bwd = max([t1 - t0 for kind, t0, t1 in plan.segments() if kind.bwd] or [0])
  step.append(MemoryTerm("embed", "step embedding (inputs, both dtypes; cotangents per tick)",
                         embed + longest_bwd * act, "step"))
  # `fns.prepare`'s compute-dtype copies of the blocks, one per version.
  mine = device["blocks"]
  cast = sum(_nbytes(p) for p, w in zip(jax.tree.leaves(jax.eval_shape(fns.prepare, mine)),
                                        jax.tree.leaves(mine)) if p.dtype != w.dtype)
  copies = plan.num_versions * cast
  if sched.name == "pipedream":
    # Inside the step the stage's own version and the shared ones, picked
    # from the ring; beside it the newest version, picked for the update.
    copies += _nbytes(device["blocks"]) + 2 * _nbytes(shared_local) + _nbytes(device)
  # 2bw copies none: v[k] becomes `prev` where it lies (`Schedule.donation_order`).
  step.append(MemoryTerm("copies", "weight copies (compute dtype, versions)", copies, "step"))

  # The tick's weight gradient: as the backward makes it (in the compute
  # dtype) and its float32 cast, added into the accumulator; one chunk's.
  grad_cast = (_f32(mine) + cast) // chunks
  # With v > 1 a tick's forward and backward each slice their chunk out of
  # the stage's prepared blocks with a traced index (`chunk_of`): a copy.
  chunk_copy = _nbytes(jax.eval_shape(fns.prepare, mine)) // chunks if chunks > 1 else 0
  ticks = _tick_terms(sched, fns, plan, shared_local, residuals, entry, act, grad_cast,
                      b // d_ * t, chunk_copy)
  update = [MemoryTerm("update", "reduced grads + update", one_version, "update")]
  return terms + step + ticks + update


def _unpipelined_terms(fns: StageFns, params: Tree, batch_shape: tuple[int, int, int],
                       num_data: int) -> list[MemoryTerm]:
  """Inside the step of `none`: the whole model's gradient sums and one microbatch's backward."""
  blocks = params["blocks"]
  shared = {k: v for k, v in params.items() if k != "blocks"}
  _, b, t = batch_shape
  tokens = jax.ShapeDtypeStruct((b // num_data, t), jnp.int32)
  x_like = jax.eval_shape(fns.embed, shared, tokens)
  act = _nbytes(x_like)
  residuals = residual_shapes(fns.stage, jax.eval_shape(fns.prepare, blocks), x_like)
  return [
      MemoryTerm("grads", "gradient accumulators (f32)", _f32(params), "step"),
      MemoryTerm("read", "a microbatch's residuals", _nbytes(residuals), "ticks"),
      MemoryTerm("head", "head: f32 logits x2 per chunk, output-layer grad",
                 _head_bytes(fns, shared, b // num_data * t), "ticks"),
      MemoryTerm("wgrad", "weight gradient (f32), activations", _f32(blocks) + 2 * act,
                 "ticks"),
      MemoryTerm("update", "reduced grads + update", _f32(params), "update")]


def _tick_terms(sched, fns, plan, shared_local, residuals, entry, act, wgrad, tokens,
                chunk_copy) -> list[MemoryTerm]:
  """One tick's working set: the largest over the plan's loops, and the other loops' extra.

  The step runs one loop per run of ticks of one kind (`Engine.run`).
  Forward-only loops keep a working set of their own; loops with a backward
  share one when it reads residuals and keep one each when it recomputes.
  The head's buffers are counted once, however many loops run it: with
  v > 1 chunks it runs in forward-only loops and in loops with a backward,
  and XLA's buffer assignment keeps one set for both (interleaved's
  temporaries on the benchmark shapes with GPT-2's vocabulary exceed
  1f1b's by the chunk copy alone, not by a second head). With v > 1 chunks
  both a forward and a backward compute with `chunk_copy` bytes of one
  chunk's weights sliced out of the stage's.
  """
  recompute = _nbytes(residuals)
  head = _head_bytes(fns, shared_local, tokens)
  read = entry if sched.stash == "residuals" else recompute + act
  # The backward reads its entry in the compute dtype and XLA's CPU backend
  # runs a bfloat16 matmul in float32: a float32 copy of what it reads.
  widened = _narrow(residuals)
  parts = {"written": entry + 2 * act, "read": read, "widened": widened, "wgrad": wgrad + 2 * act}
  classes: dict[Any, int] = {}
  for kind, _, _ in plan.segments():
    fwd = parts["written"] + chunk_copy if kind.fwd else 0
    bwd = parts["read"] + parts["widened"] + parts["wgrad"] + chunk_copy if kind.bwd else 0
    ws = max(fwd, bwd)
    key = kind.bwd if sched.stash == "residuals" or not kind.bwd else (kind.fwd, kind.bwd)
    classes[key] = max(classes.get(key, 0), ws)
  if not any(kind.head_version is not None for kind in plan.kinds()):
    head = 0
  own = read + widened + parts["wgrad"] + chunk_copy
  return [
      MemoryTerm("head", "head: f32 logits x2 per chunk, output-layer grad", head, "ticks"),
      MemoryTerm("read", "backward's stash read (or recompute)", read, "ticks"),
      MemoryTerm("widened", "f32 copy of bf16 stash read (CPU matmuls)", widened, "ticks"),
      MemoryTerm("wgrad", "weight gradient (+ its f32 cast), activations", parts["wgrad"],
                 "ticks"),
      MemoryTerm("chunk", "a chunk's weights sliced for the tick (v > 1)", chunk_copy,
                 "ticks"),
      MemoryTerm("loops", "other tick loops' working sets",
                 max(0, sum(classes.values()) - own), "ticks"),
  ]
