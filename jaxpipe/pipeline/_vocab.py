"""Vocabulary parallelism: the embedding and the output layer split over the `stage` axis.

Every stage holds 1/S of the vocabulary rows of the embedding table and 1/S
of the output layer's columns (the vocabulary padded up to a multiple of S).
A lookup is a masked gather on each stage's rows and a `psum` over `stage`; the
loss of the microbatch leaving the last block is computed by all stages at
once, each from the logits of its own slice: the maximum, the sum of
exponentials and the target's logit are combined across stages, and the
gradient with respect to the hidden state is summed over stages (by the
transpose of the broadcast that brought it). So the output layer, which in
small language models costs as much as several blocks, is spread evenly over
the stages instead of making the last one the slowest, and its gradients
never leave the stage that owns the slice.

The loss itself is `jaxpipe.xent`'s, the one cross-entropy of the project:
the model's loss and the one-device reference call it without an axis, the
head here with `stage`, so a split vocabulary computes the same function as
the whole one. `cross_entropy` and `chunked_cross_entropy` are that
module's, named here beside the layout they serve. The technique is
Megatron's vocabulary-parallel cross-entropy and the pipeline form of Yeung
et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism"
(arXiv 2411.05288, 2024).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe.xent import chunked_cross_entropy, cross_entropy

Tree = Any

__all__ = ["padded_vocab", "pad_vocab", "unpad_vocab", "cross_entropy", "chunked_cross_entropy",
           "masked_lookup"]


def padded_vocab(vocab_size: int, num_stages: int) -> int:
  """The vocabulary rounded up to a multiple of the stage count."""
  return num_stages * math.ceil(vocab_size / num_stages)


def _resize(x: jax.Array, axis: int, size: int) -> jax.Array:
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, max(0, size - x.shape[axis]))
  if isinstance(x, np.ndarray):
    # Host arrays (weights read from disk) stay on the host, so that each
    # device can then be given only its shard.
    cut = [slice(None)] * x.ndim
    cut[axis] = slice(0, size)
    return np.pad(x[tuple(cut)], pad)
  if x.shape[axis] > size:
    return lax.slice_in_dim(x, 0, size, axis=axis)
  return jnp.pad(x, pad)


def pad_vocab(shared: Tree, vocab_axes: Tree, size: int) -> Tree:
  """Pads every vocabulary axis of `shared` with zeros up to `size` entries.

  Padded embedding rows are never looked up and padded logit columns are
  masked out of the loss, so their gradients are zero and they stay zero
  under every optimizer whose update of a zero gradient and zero weight is zero.
  """
  return jax.tree.map(lambda x, a: x if a is None else _resize(x, a, size), shared, vocab_axes,
                      is_leaf=lambda a: a is None)


def unpad_vocab(shared: Tree, vocab_axes: Tree, vocab_size: int) -> Tree:
  """Drops the padding `pad_vocab` added (the natural, checkpointed shapes)."""
  return pad_vocab(shared, vocab_axes, vocab_size)


def masked_lookup(embed, shared: Tree, tokens: jax.Array, offset: jax.Array,
                  rows: int) -> jax.Array:
  """This stage's share of an embedding lookup: its rows' embeddings, zeros elsewhere.

  `embed(shared, ids)` must be a row lookup (row v of the table gives token
  v's embedding); `shared` holds rows [offset, offset + rows) of it.
  """
  local = tokens - offset
  mine = (local >= 0) & (local < rows)
  x = embed(shared, jnp.where(mine, local, 0))
  return jnp.where(mine[..., None], x, jnp.zeros_like(x))
