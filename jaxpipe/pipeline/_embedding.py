"""Stage 0's embedding in a step: every lookup before the first tick, every gradient after the last.

The embedding feeds stage 0's forwards (of chunk 0, with v > 1 chunks) and
its gradient takes their backwards' input cotangents. Both are done once per
step for all of the step's microbatches, not per tick: with a split
vocabulary each stage looks up its rows and one `psum` over 'stage'
assembles them, and after the last tick stage 0's input cotangents go to
every stage at once (one `psum`) and each scatters them into its rows of the
embedding's gradient. With the embedding whole on every stage
(`pipeline.head`), stage 0 looks up alone and nothing crosses stages.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe.pipeline import _vocab
from jaxpipe.pipeline._engine_types import (PHASE, StageFns, StepContext, TickCarry,
                                            make_varying, vocab_split)
from jaxpipe.pipeline._names import STAGE
from jaxpipe.pipeline._plan import StepPlan

Tree = Any

__all__ = ["StepEmbedding", "Embedding"]


class StepEmbedding(NamedTuple):
  """Which microbatches stage 0 embeds and pulls back in a step, read off the plan.

  The embedding's lookup and its gradient are done once per step for all of
  them, not per tick: with the vocabulary split over the stages each is a
  collective, and one per step is a barrier per step instead of two per tick.

  Attributes:
    forwards: window indices of stage 0's forwards, in tick order.
    version: the shared version they are embedded with (one per step).
    embed_pos: int32 [T]: each tick's position in `forwards` (0 where none).
    backwards: window indices of stage 0's backwards, in tick order.
    grad_ticks: the ticks those backwards run in.
    grad_accs: the accumulator each backward's embedding gradient goes to.
  """
  forwards: np.ndarray
  version: Optional[int]
  embed_pos: np.ndarray
  backwards: np.ndarray
  grad_ticks: np.ndarray
  grad_accs: np.ndarray

  @classmethod
  def of(cls, plan: StepPlan) -> "StepEmbedding":
    """The step's embedding work, from the plan's stage-0 columns (forwards and
    backwards of chunk 0: with v > 1 chunks the others take and give the ring's)."""
    fwd_ticks = np.flatnonzero((plan.fwd[:, 0] >= 0) & (plan.fwd_chunk[:, 0] == 0))
    versions = {int(v) for v in plan.embed_version[fwd_ticks]}
    if len(versions) > 1:
      raise ValueError(f"{plan.schedule}: stage 0 embeds with several shared versions in one "
                       f"step ({sorted(versions)}); the engine embeds a step's microbatches at once")
    pos = np.zeros(plan.num_ticks, np.int32)
    pos[fwd_ticks] = np.arange(len(fwd_ticks), dtype=np.int32)
    grad_ticks = np.flatnonzero((plan.bwd[:, 0] >= 0) & (plan.bwd_chunk[:, 0] == 0))
    return cls(plan.fwd[fwd_ticks, 0].astype(np.int32), versions.pop() if versions else None,
               pos, plan.bwd[grad_ticks, 0].astype(np.int32), grad_ticks.astype(np.int32),
               plan.embed_acc[grad_ticks].astype(np.int32))


class Embedding:
  """The step's embedding work on this stage (inside `shard_map`): lookups and gradients."""

  def __init__(self, fns: StageFns, plan: StepPlan):
    """The embedding of `fns` for the microbatches `plan` starts (`StepEmbedding.of`)."""
    self.fns, self.plan = fns, plan
    self.split = vocab_split(fns.vocab_axes)
    self.table = StepEmbedding.of(plan)

  def local_vocab(self, shared: Tree) -> int:
    """The vocabulary entries `shared` holds: a stage's slice with a split vocabulary, else all."""
    axes = jax.tree.leaves(self.fns.vocab_axes, is_leaf=lambda a: a is None)
    for leaf, a in zip(jax.tree.leaves(shared), axes):
      if a is not None:
        return leaf.shape[a]
    return self.fns.vocab_size

  def lookup(self, ctx: StepContext, shared: Tree, tokens: jax.Array) -> jax.Array:
    """Embeddings of `tokens`: with a split vocabulary, this stage's rows (zeros elsewhere)."""
    if not self.split:
      return self.fns.embed(shared, tokens)
    return _vocab.masked_lookup(self.fns.embed, shared, tokens, ctx.offset,
                                self.local_vocab(shared))

  def inputs(self, ctx: StepContext, dtype) -> Optional[jax.Array]:
    """[n, b, t, ...] stage 0's inputs of the step, embedded at once (see `StepEmbedding`)."""
    e = self.table
    if e.version is None:
      return None
    with jax.named_scope(PHASE["embed"]):
      tokens = ctx.tokens[jnp.asarray(np.maximum(e.forwards, 0))]
      x0 = self.lookup(ctx, ctx.shared[e.version], tokens)
      if self.split:
        # Each stage holds a slice of the rows: summing assembles them.
        x0 = lax.psum(x0, STAGE)
      return x0.astype(dtype)

  def add_grads(self, ctx: StepContext, carry: TickCarry, grads_x0: list) -> TickCarry:
    """The carry with the step's embedding gradients added, once for all of stage 0's backwards.

    `grads_x0` holds, per run of ticks, stage 0's input cotangent of each
    tick (None for runs without a backward). Each is scattered into the rows
    of its microbatch's tokens in the accumulator the plan names; with a
    split vocabulary, after one broadcast from stage 0 to every stage, each
    of which adds into its own rows.
    """
    e = self.table
    if not len(e.backwards):
      return carry
    with jax.named_scope(PHASE["embed_grad"]):
      starts = np.cumsum([0] + [t1 - t0 for _, t0, t1 in self.plan.segments()])
      pieces = []
      for t in e.grad_ticks:
        seg = int(np.searchsorted(starts, t, side="right") - 1)
        pieces.append(grads_x0[seg][t - starts[seg]])
      g0 = jnp.stack(pieces)                                          # [n, b, t, ...]
      if self.split:
        g0 = lax.psum(g0, STAGE)  # stage 0's cotangents, to every stage's rows
      tokens = ctx.tokens[jnp.asarray(np.maximum(e.backwards, 0))]

      def add_microbatch(acc, item):
        g, toks, mine = item
        # A lookup's gradient depends on the table's shape, not its values:
        # any version serves.
        _, pull = jax.vjp(lambda t: self.lookup(ctx, t, toks), ctx.shared[0])
        (g_e,) = pull(make_varying(jnp.where(mine, g, jnp.zeros_like(g))))
        # No validity mask: an empty slot's cotangent is zero, and
        # `acc + scatter(0)` is what XLA turns into a scatter-add in place.
        return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, g_e), None

      accs = list(carry.accs)
      for a in sorted({int(x) for x in e.grad_accs}):
        # One microbatch's rows at a time: a scatter-add's temporaries grow
        # with its update, and XLA's deterministic scatter on GPUs sorts the
        # whole update by row, through float32, int32 and predicate copies of
        # it (docs/accelerators.md measures what this saves).
        mine = jnp.asarray(e.grad_accs == a)
        shared_acc, _ = lax.scan(add_microbatch, accs[a][1], (g0, tokens, mine))
        accs[a] = (accs[a][0], shared_acc)
      return carry._replace(accs=tuple(accs))
