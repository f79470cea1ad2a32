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

Written by hand: no library provides a vocabulary-parallel cross-entropy for
`shard_map`. The technique is Megatron's vocabulary-parallel cross-entropy and
the pipeline form of Yeung et al., "Balancing Pipeline Parallelism with
Vocabulary Parallelism" (arXiv 2411.05288, 2024).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Tree = Any

__all__ = ["padded_vocab", "pad_vocab", "unpad_vocab", "cross_entropy", "masked_lookup"]


def padded_vocab(vocab_size: int, num_stages: int) -> int:
  """The vocabulary rounded up to a multiple of the stage count."""
  return num_stages * math.ceil(vocab_size / num_stages)


def _resize(x: jax.Array, axis: int, size: int) -> jax.Array:
  if x.shape[axis] == size:
    return x
  if x.shape[axis] > size:
    return lax.slice_in_dim(x, 0, size, axis=axis)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
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


def _stats(logits, targets, offset, vocab_size, axis):
  """Per token: the maximum, the sum of exp(z - max) and the target's logit, over stages."""
  cols = offset + jnp.arange(logits.shape[-1])
  z = jnp.where(cols < vocab_size, logits, -jnp.inf)   # padding columns never count
  local_max = jnp.max(z, axis=-1)
  # A slice of padding only (a tiny vocabulary over many stages) has max -inf
  # and sum 0; shifting it by 0 keeps exp(-inf - -inf) = NaN out.
  shift = jnp.where(jnp.isfinite(local_max), local_max, 0.0)
  local_sum = jnp.sum(jnp.exp(z - shift[..., None]), axis=-1)
  local_target = jnp.sum(jnp.where(cols == targets[..., None], z, 0.0), axis=-1)
  # One collective gathers the three per-token numbers of every stage.
  stats = lax.all_gather(jnp.stack([local_max, local_sum, local_target]), axis)  # [S, 3, ...]
  top = jnp.max(stats[:, 0], axis=0)
  total = jnp.sum(stats[:, 1] * jnp.exp(stats[:, 0] - top), axis=0)
  lse = top + jnp.log(total)
  return z, lse, jnp.sum(stats[:, 2], axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def cross_entropy(logits: jax.Array, targets: jax.Array, offset: jax.Array,
                  vocab_size: int, axis: str) -> jax.Array:
  """Mean next-token cross-entropy from this stage's slice of the logits.

  Args:
    logits: float32 [..., V/S] logits of vocabulary entries offset..offset+V/S-1.
    targets: int [...] target ids; an id outside [0, vocab_size) makes the
      loss and its gradient NaN, so bad data is caught by the non-finite
      guard, never ignored.
    offset: the first vocabulary entry of this stage's slice.
    vocab_size: the true vocabulary; columns at or beyond it are padding.
    axis: the mesh axis the vocabulary is split over.

  Returns:
    The mean over tokens of logsumexp(z) - z[target], the same on every stage.
  """
  return _ce_fwd(logits, targets, offset, vocab_size, axis)[0]


def _ce_fwd(logits, targets, offset, vocab_size, axis):
  z, lse, target_logit = _stats(logits, targets, offset, vocab_size, axis)
  bad = (targets < 0) | (targets >= vocab_size)
  loss = jnp.mean(jnp.where(bad, jnp.nan, lse - target_logit))
  return loss, (z, lse, targets, offset)


def _ce_bwd(vocab_size, axis, res, g):
  del axis
  z, lse, targets, offset = res
  cols = offset + jnp.arange(z.shape[-1])
  # d/dz of mean(lse - z_t): (softmax - onehot) / tokens; exp(-inf) is 0 on padding.
  grad = (jnp.exp(z - lse[..., None]) - (cols == targets[..., None])) * (g / lse.size)
  bad = (targets < 0) | (targets >= vocab_size)
  grad = jnp.where(bad[..., None], jnp.nan, grad)   # a bad target poisons its gradient too
  return grad.astype(z.dtype), None, None


cross_entropy.defvjp(_ce_fwd, _ce_bwd)
