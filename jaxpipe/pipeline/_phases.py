"""The forward half of a tick, which the training step and the evaluation share.

`Phases` holds what one stage runs of a `StepPlan` before any backward: the
step's context (its weights as the stage computes with them, and stage 0's
embedded inputs, `_embedding`), the forward of the stage's blocks on its
input (stage 0: its embedded microbatch), the head of the last stage's
output, and the transfers to the neighbouring stages. `Engine` (`_engine`)
adds the stash, the backward and the gradients to make a training step;
`Evaluation` (`_evaluate`) runs the same forward, head and transfers with
the head's loss alone.

The head: with a split vocabulary the last stage's output is broadcast
(`psum`) and every stage computes the logits of its vocabulary slice and
their share of the loss (and, in the step, its gradient; the gradient with
respect to the hidden state comes back summed over stages;
`_vocab.cross_entropy`). With the embedding and head whole on every stage
(`pipeline.head`), the last stage computes them alone and nothing crosses
stages.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxpipe.pipeline import _vocab
from jaxpipe.pipeline._chunks import Chunks
from jaxpipe.pipeline._embedding import Embedding
from jaxpipe.pipeline._engine_split import SplitBackward
from jaxpipe.pipeline._engine_types import (PHASE, StageFns, StepContext, TickLoop,
                                            make_varying, only_if, vjp_layout)
from jaxpipe.pipeline._names import STAGE
from jaxpipe.pipeline._plan import StepPlan, TickKind
from jaxpipe.pipeline._split import forward_with_vjp

Tree = Any

__all__ = ["Phases"]


class Phases:
  """One stage's forward, head and transfers of a plan's ticks (inside `shard_map`)."""

  def __init__(self, fns: StageFns, plan: StepPlan, *, stash: Optional[str] = "inputs",
               solo_stage: Optional[int] = None, overlap: bool = False):
    """The phases of `plan` for the model's stage functions `fns`.

    `stash`: what a forward keeps for its backward ('inputs' or 'residuals',
    see `Engine`), or None for nothing (evaluation). `solo_stage` and
    `overlap`: as `Engine`'s.
    """
    self.fns, self.plan, self.stash_mode = fns, plan, stash
    self.solo_stage = solo_stage
    self.overlap = overlap and solo_stage is None and plan.num_stages > 1
    self.num_stages = plan.num_stages
    self.chunks = Chunks(plan.virtual_stages, plan.num_stages)
    self.embedding = Embedding(fns, plan)
    self.split = self.embedding.split
    self.step_embedding = self.embedding.table
    # Forwards the plan leaves empty write into a scratch slot past the ring.
    self.trash = plan.slots
    self.num_slots = plan.slots + int((plan.fwd < 0).any())
    # zb1: B and W of one stage's backward without recomputation (`_split`).
    self.split_backward = (SplitBackward(fns, plan, stash) if plan.split_backward
                           else None)

  def context(self, blocks_versions: tuple, shared_versions: tuple, tokens: jax.Array,
              targets: jax.Array, x_like, *, has_history=True, slot_base=0) -> StepContext:
    """What every tick of a step reads, stage 0's embedded inputs included.

    The blocks are prepared (`StageFns.prepare`) once per step; `x_like`
    (an activation or its shape) gives the stage's activation shape and dtype.
    """
    s = self._stage_index()
    blocks = tuple(make_varying(self.fns.prepare(b)) for b in blocks_versions)
    shared = tuple(make_varying(v) for v in shared_versions)
    layout = None
    if self.stash_mode == "residuals":
      layout, _ = vjp_layout(self.fns.stage, self.chunks.of(blocks[0], 0), x_like)
    offset = s * self.embedding.local_vocab(shared[0]) if self.split else jnp.int32(0)
    ctx = StepContext(stage=s, is_first=s == 0, is_last=s == self.num_stages - 1,
                      offset=offset, blocks=blocks, shared=shared, tokens=tokens,
                      targets=targets, has_history=jnp.asarray(has_history),
                      slot_base=jnp.asarray(slot_base), layout=layout, x0=None,
                      history=self.plan.history, slots=self.plan.slots, trash=self.trash)
    return ctx._replace(x0=self.embedding.inputs(ctx, x_like.dtype))

  # --- the forward ---------------------------------------------------------------

  def _forward(self, loop: TickLoop, ctx: StepContext, x_buf: jax.Array, row: dict):
    """(output, whether this stage's forward slot is filled, its stash entry) of the tick.

    `x_buf` is the activation received from stage s-1.
    """
    kind, s = loop.kind, ctx.stage
    f = row["fwd"][s]
    f_ok = ctx.valid(f)
    x_in = x_buf
    if kind.embed_version is not None:
      embeds = self.chunks.embeds(ctx.is_first, row, s)
      x_in = jnp.where(embeds, ctx.x0[row["embed_pos"]].astype(x_in.dtype), x_in)
    x_in = jnp.where(f_ok, x_in, jnp.zeros_like(x_in))
    chunk = self.chunks.fwd(row, s)

    def forward(blocks):
      return self._stage_forward(ctx, self.chunks.of(blocks, chunk), x_in)

    # An empty slot computes nothing: the stage's work is under a cond on
    # this stage's own validity (other stages may be busy this tick).
    compute = lambda: self._with_version(ctx.blocks, kind.fwd_version, row["fwd_version"][s],
                                         forward)
    with jax.named_scope(PHASE["forward"]):
      y, aux, entry = only_if(f_ok, compute) if loop.fwd_gap else compute()
    return y, f_ok, {**entry, "aux": aux}

  def _stage_forward(self, ctx: StepContext, blocks: Tree, x_in: jax.Array) -> tuple:
    """(output, aux loss, what the backward keeps) of the stage's `blocks` on `x_in`."""
    if self.stash_mode == "residuals" and self.split_backward is not None:
      return self.split_backward.forward(blocks, x_in)
    if self.stash_mode == "residuals":
      y, aux, kept, layout = forward_with_vjp(self.fns.stage, blocks, x_in, make_varying)
      assert layout.layout == ctx.layout.layout, "the stage traced differently"
      return y.astype(x_in.dtype), aux, {"res": kept}
    y, aux = self.fns.stage(blocks, x_in)
    return y.astype(x_in.dtype), aux, ({"x": x_in} if self.stash_mode == "inputs" else {})

  # --- the head ------------------------------------------------------------------

  def _head(self, kind: TickKind, ctx: StepContext, row: dict, y: jax.Array,
            objective: Callable) -> tuple[Any, jax.Array]:
    """The head of the last stage's forward microbatch: (objective's outputs, whether they count).

    `objective(ctx, shared, h, targets)` is `_loss` or `_loss_and_grads`.
    With a split vocabulary every stage computes its slice's logits (the last
    stage's output broadcast to all); otherwise the last stage alone.
    """
    last = row["fwd"][self.num_stages - 1]
    last_ok = ctx.valid(last)
    shared, targets = ctx.shared[kind.head_version], ctx.targets[jnp.maximum(last, 0)]
    # With v > 1 chunks the head runs when the last stage's forward is of the
    # last chunk (`Chunks.head_runs`), a cond that every stage takes alike.
    # zb1's ticks are all of one kind: the head runs when the last stage's
    # forward does, under a cond that every stage likewise takes alike.
    runs = self.chunks.head_runs(row)
    if runs is not None:
      last_ok = last_ok & runs
    elif self.split_backward is not None:
      runs = last >= 0
    if self.split:
      # psum of the last stage's output (zeros elsewhere): a broadcast that
      # also makes every stage's head wait for every stage's forward.
      def head():
        h = lax.psum(jnp.where(ctx.is_last, y, jnp.zeros_like(y)), STAGE)
        return objective(ctx, shared, h, targets)
      out = head() if runs is None else only_if(runs, lambda: make_varying(head()))
    else:
      on = ctx.is_last if runs is None else ctx.is_last & runs
      out = only_if(on, lambda: objective(ctx, shared, y, targets))
    return out, last_ok

  def _loss(self, ctx: StepContext, shared: Tree, h: jax.Array,
            targets: jax.Array) -> jax.Array:
    """Cross-entropy of one microbatch (summed over its tokens; this stage's vocabulary slice)."""
    return _vocab.chunked_cross_entropy(self.fns.logits, shared, h, targets, ctx.offset,
                                        self.fns.vocab_size, STAGE if self.split else None,
                                        self.fns.loss_chunk)

  def _loss_and_grads(self, ctx: StepContext, shared: Tree, h: jax.Array,
                      targets: jax.Array) -> tuple:
    """(loss, shared gradient (slice), gradient of h (summed over stages)) of one microbatch."""
    def objective(sh, h):
      return self._loss(ctx, sh, h, targets)

    loss, pull = jax.vjp(objective, shared, h)
    g_shared, g_h = pull(jnp.ones_like(loss))
    return loss, g_shared, g_h

  # --- the transfers -------------------------------------------------------------

  def _exchange(self, kind: TickKind, ctx: StepContext, held: tuple,
                sent: tuple) -> tuple[jax.Array, jax.Array]:
    """The tick's transfers: (activation from stage s-1, cotangent from stage s+1).

    `held`: the buffers as they are, kept in a direction the tick sends
    nothing in; `sent`: this tick's (activation, cotangent).
    """
    ring = self.chunks.exchange(kind, held, sent)
    if ring is not None:
      return ring
    (fwd_buf, bwd_buf), (send_f, send_b) = held, sent
    if self.num_stages == 2 and kind.fwd and kind.bwd:
      # Two stages: stage 0 sends its output up while stage 1 sends its input
      # cotangent down, one exchange. Each keeps the half it reads (stage 1
      # its forward input, stage 0 its backward cotangent); the other half is
      # never read (the first stage embeds, the last takes the head's).
      got = lax.ppermute(jnp.where(ctx.is_first, send_f, send_b), STAGE, [(0, 1), (1, 0)])
      return got, got
    to_next, to_prev = self._sends()
    if kind.fwd:
      fwd_buf = lax.ppermute(send_f, STAGE, to_next)
    if kind.bwd:
      bwd_buf = lax.ppermute(send_b, STAGE, to_prev)
    return fwd_buf, bwd_buf

  def _sends(self) -> tuple[list, list]:
    """ppermute pairs to the next and the previous stage (`Chunks.pairs`; none for a solo stage)."""
    if self.solo_stage is not None:
      return [], []
    return self.chunks.pairs()

  # --- where and with which weights ----------------------------------------------

  def _stage_index(self) -> jax.Array:
    """This stage's position: the mesh's, or the solo stage's constant."""
    if self.solo_stage is not None:
      return jnp.int32(self.solo_stage)
    return lax.axis_index(STAGE)

  @staticmethod
  def _with_version(versions: tuple, static: Optional[int], dynamic: jax.Array, fn):
    """fn(the weights of one version): a static choice is free; a per-stage one
    a `lax.switch`, each branch computing with its version's buffers in
    place (a select would copy the weights)."""
    if static is not None:
      return fn(versions[static])
    if len(versions) == 1:
      return fn(versions[0])
    index = jnp.clip(dynamic, 0, len(versions) - 1)
    return lax.switch(index, [functools.partial(fn, v) for v in versions])
