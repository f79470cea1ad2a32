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

`chunked_cross_entropy` is the same loss computed a chunk of tokens at a time
(`lax.scan` over a `jax.checkpoint`ed chunk), so that the float32 logits of
a whole microbatch never exist at once: the forward keeps only each chunk's
inputs and the backward recomputes that chunk's logits.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Tree = Any

__all__ = ["padded_vocab", "pad_vocab", "unpad_vocab", "cross_entropy", "chunked_cross_entropy",
           "masked_lookup"]


def padded_vocab(vocab_size: int, num_stages: int) -> int:
  """The vocabulary rounded up to a multiple of the stage count."""
  return num_stages * math.ceil(vocab_size / num_stages)


def resize_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
  """`x` with its `axis` cut or zero-padded to `size`."""
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
  return jax.tree.map(lambda x, a: x if a is None else resize_axis(x, a, size), shared, vocab_axes,
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
  stats = jnp.stack([local_max, local_sum, local_target])
  # One collective gathers the three per-token numbers of every stage; with
  # no axis the slice is the whole vocabulary (one device).
  stats = stats[None] if axis is None else lax.all_gather(stats, axis)  # [S, 3, ...]
  top = jnp.max(stats[:, 0], axis=0)
  total = jnp.sum(stats[:, 1] * jnp.exp(stats[:, 0] - top), axis=0)
  lse = top + jnp.log(total)
  return z, lse, jnp.sum(stats[:, 2], axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _loss_sum(logits, targets, mask, offset, vocab_size, axis):
  """The sum over tokens where `mask` of logsumexp(z) - z[target]; NaN on a bad target.

  Masked tokens (a chunk's padding) contribute 0 to the sum and to the
  gradient; a bad target anywhere makes both NaN.
  """
  return _sum_fwd(logits, targets, mask, offset, vocab_size, axis)[0]


def _bad(targets, vocab_size):
  return (targets < 0) | (targets >= vocab_size)


def _sum_fwd(logits, targets, mask, offset, vocab_size, axis):
  z, lse, target_logit = _stats(logits, targets, offset, vocab_size, axis)
  per_token = jnp.where(mask, lse - target_logit, 0.0)
  loss = jnp.sum(jnp.where(_bad(targets, vocab_size), jnp.nan, per_token))
  return loss, (z, lse, targets, mask, offset)


def _sum_bwd(vocab_size, axis, res, g):
  del axis
  z, lse, targets, mask, offset = res
  cols = offset + jnp.arange(z.shape[-1])
  # d/dz of sum(lse - z_t): softmax - onehot per unmasked token; exp(-inf) is
  # 0 on padding columns.
  grad = (jnp.exp(z - lse[..., None]) - (cols == targets[..., None])) * jnp.where(
      mask, g, 0.0)[..., None]
  # A bad target poisons its gradient too.
  grad = jnp.where(_bad(targets, vocab_size)[..., None], jnp.nan, grad)
  return grad.astype(z.dtype), None, None, None


_loss_sum.defvjp(_sum_fwd, _sum_bwd)


def cross_entropy(logits: jax.Array, targets: jax.Array, offset: jax.Array,
                  vocab_size: int, axis: str | None) -> jax.Array:
  """Mean next-token cross-entropy from this stage's slice of the logits.

  Args:
    logits: float32 [..., V/S] logits of vocabulary entries offset..offset+V/S-1.
    targets: int [...] target ids; an id outside [0, vocab_size) makes the
      loss and its gradient NaN, so bad data is caught by the non-finite
      guard, never ignored.
    offset: the first vocabulary entry of this stage's slice.
    vocab_size: the true vocabulary; columns at or beyond it are padding.
    axis: the mesh axis the vocabulary is split over; None when `logits`
      hold the whole vocabulary (one device, no collective).

  Returns:
    The mean over tokens of logsumexp(z) - z[target], the same on every stage.
  """
  mask = jnp.ones(targets.shape, bool)
  return _loss_sum(logits, targets, mask, offset, vocab_size, axis) / targets.size


def _chunks(x: jax.Array, targets: jax.Array, chunk: int):
  """Tokens in [k, 1, chunk] groups: (x, targets, mask), the last group padded.

  Padding tokens have zero activations, target 0 (a valid id, so no NaN) and
  mask False, so they add nothing to a sum and count for nothing in a mean.
  """
  n = targets.size
  k = -(-n // chunk)
  pad = k * chunk - n
  x = jnp.pad(x.reshape(n, x.shape[-1]), ((0, pad), (0, 0)))
  t = jnp.pad(targets.reshape(n), (0, pad))
  mask = jnp.arange(k * chunk) < n
  # [k, 1, chunk, ...]: each chunk is a one-row batch, the shape a logits
  # function takes.
  return (x.reshape(k, 1, chunk, x.shape[-1]), t.reshape(k, 1, chunk), mask.reshape(k, 1, chunk))


def chunked_cross_entropy(logits_fn, shared: Tree, x: jax.Array, targets: jax.Array,
                          offset: jax.Array, vocab_size: int, axis: str | None,
                          chunk: int) -> jax.Array:
  """`cross_entropy(logits_fn(shared, x), targets, ...)` with at most `chunk` tokens' logits alive.

  The tokens of `x` [..., dim] (all leading axes flattened, row-major) go
  through `logits_fn` and the loss `chunk` at a time in a `lax.scan`; each
  chunk is `jax.checkpoint`ed, so its backward recomputes its logits (one
  more output-layer matmul per token) instead of keeping [tokens, V/S]
  float32 logits from the forward. With `axis` set, each chunk does its own
  `all_gather` of per-token statistics, and its recomputation in the
  backward another (a collective in a scan, never in a `cond`, is safe on
  every stage). A token count that `chunk` does not
  divide is padded with masked tokens that add 0 and count 0, so the result
  is the mean over the real tokens: (sum of the chunks' sums) / tokens.

  Args:
    logits_fn: (shared, x [1, c, dim]) -> float32 logits [1, c, V/S].
    shared: the parameters `logits_fn` reads (differentiable).
    x: [..., dim] hidden states; targets: int [...] of the same leading shape.
    offset, vocab_size, axis: as in `cross_entropy`.
    chunk: tokens per chunk; 0 computes all logits at once (`cross_entropy`).
  """
  if chunk <= 0:
    return cross_entropy(logits_fn(shared, x), targets, offset, vocab_size, axis)
  n = targets.size
  xs = _chunks(x, targets, min(chunk, n))

  def one(sh, xc, tc, mc):
    return _loss_sum(logits_fn(sh, xc), tc, mc, offset, vocab_size, axis)

  # Inside a scan the forward and the recomputation cannot be merged, so
  # `prevent_cse` would only cost optimisation barriers.
  one = jax.checkpoint(one, prevent_cse=False)

  # The chunk sums come out as the scan's outputs rather than a carry, so no
  # carry has to be typed as varying over the mesh like the sums are.
  _, sums = lax.scan(lambda c, xc: (c, one(shared, *xc)), None, xs)
  return jnp.sum(sums) / n
