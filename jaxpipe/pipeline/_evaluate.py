"""Evaluation: the loss of a batch by forward ticks alone, with the step's own forward and head.

`Evaluation` runs the forward ticks of a flushed step (`forward_plan`:
GPipe's M+S-1; with v chunks, the forward halves of interleaved's Mv+S-1,
each group of S microbatches round the ring v times) through the very
phases the training step runs (`Phases`): stage 0's inputs embedded once
for the step, the stage's forward under a cond on its own slot, the head of
the last stage's output (its loss alone, no gradient), the transfers to the
next stage. Nothing is stashed and no gradient is taken. Cross-entropy is
counted on the last stage, auxiliary losses on each stage; summing over the
mesh gives the batch total.

The ticks are one loop: every tick carries the embedding and the head,
masked where the tick has none (as interleaved's steady state does), so the
program holds one copy of the stage.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxpipe.pipeline._builders import forward_plan
from jaxpipe.pipeline._engine_types import PHASE, StageFns, TickLoop, make_varying
from jaxpipe.pipeline._phases import Phases
from jaxpipe.pipeline._plan import TickKind

Tree = Any

__all__ = ["Evaluation"]

# Every evaluation tick's kind: forwards of the one weight version, the
# embedding and the head (each masked where the tick has none), no backward.
_KIND = TickKind(fwd=True, bwd=False, fwd_version=0, bwd_version=None, embed_version=0,
                 head_version=0, head_acc=0, embed_grad_version=None, embed_acc=None)


class Evaluation(Phases):
  """The evaluation ticks on one stage (inside `shard_map`); see the module docstring."""

  def __init__(self, fns: StageFns, num_stages: int, num_microbatches: int,
               virtual_stages: int = 1, *, solo_stage: Optional[int] = None):
    """Evaluation of M = `num_microbatches` microbatches on S stages of v chunks each."""
    super().__init__(fns, forward_plan(num_stages, num_microbatches, virtual_stages),
                     stash=None, solo_stage=solo_stage)

  def loss(self, blocks: Tree, shared: Tree, tokens: jax.Array, targets: jax.Array,
           x_like: jax.ShapeDtypeStruct) -> jax.Array:
    """This stage's summed loss of the [M, b, t] microbatches (no gradients).

    `blocks` and `shared` are the stage's parameters (one version), `x_like`
    the shape of one microbatch's activation on this device.
    """
    ctx = self.context((blocks,), (shared,), tokens, targets, x_like)
    loop = TickLoop(_KIND, fwd_gap=True, bwd_gap=False)
    xs = {k: jnp.asarray(getattr(self.plan, k)) for k in ("fwd", "fwd_version") + self.chunks.rows}
    xs["embed_pos"] = jnp.asarray(self.step_embedding.embed_pos)

    def tick(c, row):
      buf, total = c
      y, f_ok, entry = self._forward(loop, ctx, buf, row)
      with jax.named_scope(PHASE["head"]):
        loss, last_ok = self._head(_KIND, ctx, row, y, self._loss)
      total = (total + jnp.where(f_ok, entry["aux"], 0.0)
               + jnp.where(last_ok & ctx.is_last, loss, 0.0))
      send = jnp.where(f_ok, y, jnp.zeros_like(y)).astype(buf.dtype)
      with jax.named_scope(PHASE["send"]):
        buf, _ = self._exchange(_KIND, ctx, (buf, None), (send, None))
      return (buf, total), None

    init = make_varying((jnp.zeros(x_like.shape, x_like.dtype), jnp.zeros((), jnp.float32)))
    (_, total), _ = lax.scan(tick, init, xs)
    return total
