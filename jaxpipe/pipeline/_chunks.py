"""Interleaved 1F1B's chunks: v slices of a stage's blocks, and the ring they go round.

With `plan.virtual_stages` v > 1, `blocks` holds the stage's v chunks of
L/(S v) blocks one after another (chunk j is the pipeline's virtual stage
j*S + s; `layer_order` in `_builders`). A forward or backward runs the chunk
the plan names. In the lockstep order stage s's chunk changes every S ticks,
offset by s, so no loop of ticks has one chunk on every stage and the choice
is made per tick: the chunk's blocks are sliced out of the stage's
(`lax.dynamic_slice`, a copy of 1/v of the stage's weights per use, which a
`lax.switch` over the chunks would trade for v copies of the stage's
program in every tick; `chunk_of` takes a static chunk as a static slice)
and its weight gradient is added into that chunk's rows of the accumulator
in place. Stage S-1's output goes round the ring to stage 0 (and stage 0's
input cotangent to stage S-1), so every stage both sends and receives in
both directions. The embedding feeds stage 0's forwards of chunk 0 and its
gradient takes their backwards; the head runs in the ticks in which the last
stage's forward is of chunk v-1 (under a `lax.cond` on the tick's chunk,
which every stage reads alike, so the steady state stays one loop).

`Chunks` answers each of those questions for the engine; with v = 1 every
answer is the plain pipeline's (the whole stage, a line of stages), and
traces nothing extra.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe.pipeline._names import STAGE
from jaxpipe.pipeline._plan import TickKind

Tree = Any

__all__ = ["Chunks", "chunk_of", "CHUNK_ROWS"]

# Plan arrays with one entry per (tick, stage) that the tick loops read with
# v > 1 chunks per stage: which chunk each forward and backward runs.
CHUNK_ROWS = ("fwd_chunk", "bwd_chunk")


def chunk_of(blocks: Tree, chunk, num_chunks: int) -> Tree:
  """Chunk `chunk` of a stage's stacked blocks (v = num_chunks chunks, one after another).

  A static chunk is a static slice; a traced one a `lax.dynamic_slice` (a
  copy of the chunk's 1/v of the stage's weights).
  """
  if num_chunks == 1:
    return blocks

  def one(w):
    size = w.shape[0] // num_chunks
    if isinstance(chunk, (int, np.integer)):
      return lax.slice_in_dim(w, int(chunk) * size, (int(chunk) + 1) * size, axis=0)
    return lax.dynamic_slice_in_dim(w, chunk * size, size, axis=0)
  return jax.tree.map(one, blocks)


class Chunks:
  """The chunks of blocks each stage holds (v of them) and the ring they make of the stages."""

  def __init__(self, num_chunks: int, num_stages: int):
    """v = `num_chunks` chunks per stage, on `num_stages` stages."""
    self.num, self.num_stages = num_chunks, num_stages
    self.rows = CHUNK_ROWS if num_chunks > 1 else ()

  def of(self, blocks: Tree, chunk) -> Tree:
    """Chunk `chunk` of the stage's blocks (`chunk_of`)."""
    return chunk_of(blocks, chunk, self.num)

  def add(self, acc: jax.Array, grad: jax.Array, chunk) -> jax.Array:
    """`acc` with `grad` (one chunk's rows) added into chunk `chunk`'s rows, in place."""
    if self.num == 1:
      return acc + grad.astype(acc.dtype)
    size = acc.shape[0] // self.num
    start = chunk * size
    rows = lax.dynamic_slice_in_dim(acc, start, size, axis=0)
    return lax.dynamic_update_slice_in_dim(acc, rows + grad.astype(acc.dtype), start, axis=0)

  def fwd(self, row: dict, stage: jax.Array):
    """The chunk this stage's forward runs in the tick (0 with one chunk)."""
    return row["fwd_chunk"][stage] if self.num > 1 else 0

  def bwd(self, row: dict, stage: jax.Array):
    """The chunk this stage's backward runs in the tick (0 with one chunk)."""
    return row["bwd_chunk"][stage] if self.num > 1 else 0

  def embeds(self, is_first: jax.Array, row: dict, stage: jax.Array) -> jax.Array:
    """Whether this stage's forward takes the embedding: stage 0's, of chunk 0."""
    return is_first if self.num == 1 else is_first & (row["fwd_chunk"][stage] == 0)

  def tops(self, is_last: jax.Array, chunk) -> jax.Array:
    """Whether this stage's backward of `chunk` takes the head's cotangent.

    The last stage's, of the last chunk; the others take the ring's.
    """
    return is_last if self.num == 1 else is_last & (chunk == self.num - 1)

  def head_runs(self, row: dict) -> Optional[jax.Array]:
    """Whether the tick's head runs: the last stage's forward is of the last chunk.

    The same on every stage (it is the tick's row), so a cond around
    collectives is one that every stage takes alike. None with one chunk
    (the head's validity alone decides).
    """
    if self.num == 1:
      return None
    return row["fwd_chunk"][self.num_stages - 1] == self.num - 1

  def pairs(self) -> tuple[list, list]:
    """ppermute pairs to the next and the previous stage.

    With v > 1 chunks the line closes into a ring: stage S-1 sends on to
    stage 0 (its output of chunk j is stage 0's input of chunk j+1), and
    stage 0 back to stage S-1.
    """
    n = self.num_stages
    wrap = self.num > 1 and n > 1
    return ([(i, i + 1) for i in range(n - 1)] + ([(n - 1, 0)] if wrap else []),
            [(i + 1, i) for i in range(n - 1)] + ([(0, n - 1)] if wrap else []))

  def exchange(self, kind: TickKind, held: tuple, sent: tuple) -> Optional[tuple]:
    """The ring's own transfers where it has them: (activation, cotangent) received, or None.

    `held` are the buffers as they are, `sent` this tick's (activation,
    cotangent). One stage: the ring is the stage itself. Two stages with
    both directions busy: both are the same swap, and each stage sends an
    activation and a cotangent, so one exchange carries both. Otherwise
    (and with one chunk) None: the plain sends along `pairs`.
    """
    (fwd_buf, bwd_buf), (send_f, send_b) = held, sent
    if self.num == 1:
      return None
    if self.num_stages == 1:
      return (send_f if kind.fwd else fwd_buf), (send_b if kind.bwd else bwd_buf)
    if self.num_stages == 2 and kind.fwd and kind.bwd:
      got = lax.ppermute(jnp.stack([send_f, send_b]), STAGE, [(0, 1), (1, 0)])
      return got[0], got[1]
    return None
