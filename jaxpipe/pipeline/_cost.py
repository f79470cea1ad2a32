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
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxpipe.pipeline._engine import DATA, STAGE, Engine, StageFns
from jaxpipe.pipeline._timetable import StepPlan

Tree = Any

__all__ = ["stage_tick", "flops", "one_tick_plan"]

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
