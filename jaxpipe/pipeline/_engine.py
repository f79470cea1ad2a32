"""Per-stage programs that run inside `jax.shard_map` over a ('stage', 'data') mesh.

Two engines:
- `tick_loop` executes a `StepPlan` tick by tick: each tick a stage runs one
  forward (sending its output to stage s+1 by `ppermute`) and one backward
  (a `jax.value_and_grad` of its slice of the model on the stashed input,
  sending the input cotangent to stage s-1). It serves 1f1b, 2bw and pipedream;
  they differ only in which weight version a microbatch uses, which
  microbatches are valid, and which accumulator a gradient goes to.
- `forward_loss` runs only the forward ticks of GPipe and returns this stage's
  share of the loss; `jax.grad` of it is GPipe's backward (its transpose runs
  the ticks in reverse, with `ppermute` transposed into the reverse shift).

Everything here sees per-device (local) shapes. Parameters arrive as
`(blocks, shared)`: `blocks` is this stage's slice of the stacked blocks,
`shared` every other parameter (embedding, final norm, head), replicated on
every stage; the embedding runs only on stage 0 and the head and loss only on
stage S-1 (each under a `lax.cond` on the stage index, so other stages skip
that work), and the stages' gradient contributions to `shared` are summed over
the `stage` axis once per step.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxpipe.pipeline._timetable import StepPlan

Tree = Any

__all__ = ["StageFns", "TickCarry", "tick_loop", "forward_loss", "varying", "fresh"]

STAGE, DATA = "stage", "data"


class StageFns(NamedTuple):
  """The model as the pipeline sees it: three pure functions.

  Attributes:
    embed: (shared, tokens [b, t]) -> activations [b, t, ...] (stage 0).
    stage: (blocks, x) -> (x, aux): applies a stacked slice of blocks; aux is
      a scalar auxiliary loss (0 for dense models) added to the objective.
    head: (shared, x, targets [b, t]) -> mean loss of the microbatch (stage S-1).
  """
  embed: Callable[[Tree, jax.Array], jax.Array]
  stage: Callable[[Tree, jax.Array], tuple[jax.Array, jax.Array]]
  head: Callable[[Tree, jax.Array, jax.Array], jax.Array]


def varying(tree: Tree, axes: tuple[str, ...]) -> Tree:
  """Marks an input that is replicated over `axes` as varying over them.

  Differentiating a replicated input inside `shard_map` makes JAX sum its
  cotangent over the replicas at every use (a psum per tick); as a varying
  value its gradient stays local, and the engine sums it once per step.
  """
  if not axes:
    return tree
  return jax.tree.map(lambda x: lax.pcast(x, axes, to="varying"), tree)


def fresh(tree: Tree) -> Tree:
  """Zeros shaped like `tree`, varying over both mesh axes (a new scan carry)."""
  return jax.tree.map(lambda x: lax.pcast(jnp.zeros_like(x), (STAGE, DATA), to="varying"), tree)


def _vzeros(shape, dtype) -> jax.Array:
  # Zeros typed as varying over the mesh, for a cond branch that skips work:
  # both branches of a cond inside shard_map must agree on what varies.
  return lax.pcast(jnp.zeros(shape, dtype), (STAGE, DATA), to="varying")


def _pick(tree: Tree, index: jax.Array) -> Tree:
  return jax.tree.map(lambda v: v[index], tree)


class TickCarry(NamedTuple):
  """What flows from tick to tick (and, in 2bw, from step to step).

  Attributes:
    fwd_buf: [b, t, ...] activation received from stage s-1 last tick.
    bwd_buf: [b, t, ...] cotangent received from stage s+1 last tick.
    stash: [R, b, t, ...] inputs of in-flight microbatches, by ring slot.
    acc: (blocks, shared) gradient sums with a leading accumulator axis.
    loss: [A] loss sums (cross-entropy on the last stage plus this stage's
      auxiliary losses), one per accumulator.
  """
  fwd_buf: jax.Array
  bwd_buf: jax.Array
  stash: jax.Array
  acc: Tree
  loss: jax.Array


def tick_loop(fns: StageFns, plan: StepPlan, versions: Tree, tokens: jax.Array,
              targets: jax.Array, carry: TickCarry, *,
              version_of: Callable[[jax.Array], jax.Array],
              valid_of: Callable[[jax.Array], jax.Array],
              acc_of: Callable[[jax.Array], jax.Array],
              slot_of: Callable[[jax.Array], jax.Array]) -> TickCarry:
  """Runs every tick of `plan` on this stage and returns the final carry.

  Args:
    fns: the model's stage functions.
    plan: the step plan; row t says which window microbatch this stage runs
      forward and backward at tick t.
    versions: (blocks, shared) with a leading weight-version axis.
    tokens, targets: [2M, b, t] window of the previous and current batch.
    carry: the incoming carry.
    version_of, valid_of, acc_of, slot_of: map a window index to its weight
      version, whether it exists, its gradient accumulator, its stash slot.
  """
  num_stages = plan.num_stages
  s = lax.axis_index(STAGE)
  is_first, is_last = s == 0, s == num_stages - 1
  to_next = [(i, i + 1) for i in range(num_stages - 1)]
  to_prev = [(i + 1, i) for i in range(num_stages - 1)]

  def tick(c: TickCarry, row):
    f_row, b_row = row
    fi, bi = f_row[s], b_row[s]
    f_ok, b_ok = valid_of(fi), valid_of(bi)
    fi, bi = jnp.maximum(fi, 0), jnp.maximum(bi, 0)

    # Forward: stage 0 embeds its microbatch, the others take what arrived.
    # The last stage skips it: its backward below recomputes the same forward.
    blocks_f, shared_f = _pick(versions, version_of(fi))
    x_in = lax.cond(is_first, lambda: fns.embed(shared_f, tokens[fi]).astype(c.fwd_buf.dtype),
                    lambda: c.fwd_buf)
    x_in = jnp.where(f_ok, x_in, jnp.zeros_like(x_in))
    y = lax.cond(is_last, lambda: _vzeros(x_in.shape, x_in.dtype),
                 lambda: fns.stage(blocks_f, x_in)[0].astype(x_in.dtype))
    slot = slot_of(fi)
    stash = c.stash.at[slot].set(jnp.where(f_ok, x_in, c.stash[slot]))

    # Backward: recompute the stage on the stashed input with the version the
    # forward used, then pull back the cotangent that stage s+1 sent (or, on
    # the last stage, the loss). Gradient of <y, g_out> + loss gives exactly
    # the vector-Jacobian product plus the loss gradient in one pass.
    blocks_b, shared_b = _pick(versions, version_of(bi))
    x_b, tok_b, tgt_b, g_out = stash[slot_of(bi)], tokens[bi], targets[bi], c.bwd_buf

    def objective(wb, ws, x):
      x = lax.cond(is_first, lambda: fns.embed(ws, tok_b).astype(x.dtype), lambda: x)
      y, aux = fns.stage(wb, x)
      head = lax.cond(is_last, lambda: fns.head(ws, y, tgt_b).astype(jnp.float32),
                      lambda: _vzeros((), jnp.float32))
      loss = head + aux.astype(jnp.float32)
      pull = jnp.sum(y.astype(jnp.float32) * g_out.astype(jnp.float32))
      return loss + pull, loss

    (_, loss_b), (g_blocks, g_shared, g_x) = jax.value_and_grad(
        objective, argnums=(0, 1, 2), has_aux=True)(blocks_b, shared_b, x_b)
    a = acc_of(bi)
    # Masks are `where`s, not products: 0 * NaN would poison the sums.
    acc = jax.tree.map(lambda acc, g: acc.at[a].add(jnp.where(b_ok, g, jnp.zeros_like(g))),
                       c.acc, (g_blocks, g_shared))
    loss = c.loss.at[a].add(jnp.where(b_ok, loss_b, 0.0))
    g_x = jnp.where(b_ok, g_x, jnp.zeros_like(g_x)).astype(c.bwd_buf.dtype)

    fwd_buf = lax.ppermute(jnp.where(f_ok, y, jnp.zeros_like(y)), STAGE, to_next)
    bwd_buf = lax.ppermute(g_x, STAGE, to_prev)
    return TickCarry(fwd_buf, bwd_buf, stash, acc, loss), None

  rows = (jnp.asarray(plan.fwd), jnp.asarray(plan.bwd))
  carry, _ = lax.scan(tick, carry, rows)
  return carry


def forward_loss(fns: StageFns, plan: StepPlan, blocks: Tree, shared: Tree, tokens: jax.Array,
                 targets: jax.Array, x_like: jax.Array, *, remat: bool = True) -> jax.Array:
  """GPipe's forward ticks on this stage; returns the stage's summed loss.

  The sum over microbatches of the last stage's cross-entropy plus this
  stage's auxiliary losses; summing it over `stage` gives the batch's total.
  With `remat`, only each tick's stage input is saved for the backward, and
  the stage is recomputed there (GPipe's rematerialisation).

  Args:
    plan: a gpipe plan; only its forward ticks are run.
    tokens, targets: [M, b, t] this batch's microbatches (window index - M).
    x_like: a zero activation [b, t, ...] (shape and dtype of the stream).
  """
  num_stages, m = plan.num_stages, plan.num_microbatches
  s = lax.axis_index(STAGE)
  is_first, is_last = s == 0, s == num_stages - 1
  to_next = [(i, i + 1) for i in range(num_stages - 1)]
  stage_fn = jax.checkpoint(fns.stage) if remat else fns.stage
  n_fwd = m + num_stages - 1

  def tick(c, f_row):
    buf, total = c
    f = f_row[s] - m
    ok = f >= 0
    f = jnp.maximum(f, 0)
    x = lax.cond(is_first, lambda: fns.embed(shared, tokens[f]).astype(buf.dtype), lambda: buf)
    x = jnp.where(ok, x, jnp.zeros_like(x))
    y, aux = stage_fn(blocks, x)
    head = lax.cond(is_last, lambda: fns.head(shared, y, targets[f]).astype(jnp.float32),
                    lambda: _vzeros((), jnp.float32))
    total = total + jnp.where(ok, head + aux.astype(jnp.float32), 0.0)
    buf = lax.ppermute(y.astype(buf.dtype), STAGE, to_next)
    return (buf, total), None

  init = (x_like, _vzeros((), jnp.float32))
  (_, total), _ = lax.scan(tick, init, jnp.asarray(plan.fwd[:n_fwd]))
  return total
