"""The one cross-entropy: the model's loss, the one-device reference's and the pipeline head's.

`cross_entropy` takes the logits of a slice of the vocabulary (entries
offset .. offset + width - 1), the targets, the true vocabulary size and an
optional mesh axis that the vocabulary is split over. Per token it computes
three float32 statistics of its slice: the maximum, the sum of exp(z - max)
and the target's logit; with an axis one `all_gather` combines them across
the axis, without one the slice is the whole vocabulary and nothing crosses
devices. Columns at or beyond the vocabulary size (padding to a multiple of
the stage count) never count; a target outside [0, vocab_size) makes the
loss and its gradient NaN, so bad data is caught by the trainer's
non-finite guard, never ignored. The backward is written by hand
(softmax - onehot, local to each slice) and keeps no [tokens, V'] array
beyond the logits and their gradient.

`chunked_cross_entropy` is the one wrapper that computes a head's logits and
this loss a chunk of tokens at a time, so that the float32 logits of a
whole microbatch never exist at once.

Why a module of its own: `jaxpipe.model` (`Model.loss`, the reference every
pipeline must match) and `jaxpipe.pipeline` (the `none` schedule's
one-device loss and the vocabulary-parallel head) must compute the very same
loss, but the model knows nothing of meshes and the pipeline knows no model.
This module knows neither: it imports only JAX, so both layers import it.
The model calls it without an axis; only the pipeline passes one.

Written by hand: no library provides a vocabulary-parallel cross-entropy for
`shard_map`. The technique is Megatron's vocabulary-parallel cross-entropy
(Shoeybi et al., arXiv 1909.08053, 2019).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

Params = Any

__all__ = ["cross_entropy", "chunked_cross_entropy"]


def _masked(logits, offset, vocab_size, pad):
  """The logits with padding columns (vocabulary ids >= vocab_size) at -inf.

  `pad` False says the slice holds no padding (known before tracing): the
  logits come back as they are, so XLA has no masked copy of them to keep.
  """
  if not pad:
    return logits
  cols = offset + jnp.arange(logits.shape[-1])
  return jnp.where(cols < vocab_size, logits, -jnp.inf)


def _in_slice(targets, offset, width):
  """(each target's column in this slice, 0 where not in it; whether it is in it)."""
  local = targets - offset
  mine = (local >= 0) & (local < width)
  return jnp.where(mine, local, 0), mine


def _stats(logits, targets, offset, vocab_size, axis, pad):
  """(logsumexp, target logit) per token, combined over `axis`."""
  z = _masked(logits, offset, vocab_size, pad)   # padding columns never count
  local_max = jnp.max(z, axis=-1)
  # A slice of padding only (a tiny vocabulary over many stages) has max -inf
  # and sum 0; shifting it by 0 keeps exp(-inf - -inf) = NaN out.
  shift = jnp.where(jnp.isfinite(local_max), local_max, 0.0)
  local_sum = jnp.sum(jnp.exp(z - shift[..., None]), axis=-1)
  # A gather, not a one-hot sum: no [tokens, V'] temporary.
  col, mine = _in_slice(targets, offset, z.shape[-1])
  local_target = jnp.where(mine, jnp.take_along_axis(z, col[..., None], axis=-1)[..., 0], 0.0)
  stats = jnp.stack([local_max, local_sum, local_target])
  # One collective gathers the three per-token numbers of every slice; with
  # no axis the slice is the whole vocabulary and the "gather" is itself.
  stats = stats[None] if axis is None else lax.all_gather(stats, axis)  # [S, 3, ...]
  top = jnp.max(stats[:, 0], axis=0)
  total = jnp.sum(stats[:, 1] * jnp.exp(stats[:, 0] - top), axis=0)
  lse = top + jnp.log(total)
  return lse, jnp.sum(stats[:, 2], axis=0)


def _bad(targets, vocab_size):
  return (targets < 0) | (targets >= vocab_size)


# A hand-written backward: autodiff would transpose the `all_gather` into a
# reduce-scatter in every backward and differentiate through the maxima,
# while softmax - onehot needs only the gathered logsumexp, local to each slice.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _loss_sum(logits, targets, mask, offset, vocab_size, axis, pad):
  """The sum over tokens where `mask` of logsumexp(z) - z[target]; NaN on a bad target.

  Masked tokens (a chunk's padding) contribute 0 to the sum and to the
  gradient; a bad target anywhere makes both NaN. `pad`: whether the slice
  may hold padding columns (see `_masked`).
  """
  return _sum_fwd(logits, targets, mask, offset, vocab_size, axis, pad)[0]


def _sum_fwd(logits, targets, mask, offset, vocab_size, axis, pad):
  lse, target_logit = _stats(logits, targets, offset, vocab_size, axis, pad)
  per_token = jnp.where(mask, lse - target_logit, 0.0)
  loss = jnp.sum(jnp.where(_bad(targets, vocab_size), jnp.nan, per_token))
  # The logits themselves are kept, not a masked copy: the backward masks
  # them again inside its elementwise pass.
  return loss, (logits, lse, targets, mask, offset)


def _sum_bwd(vocab_size, axis, pad, res, g):
  del axis  # the gradient of a slice's logits needs only the gathered lse
  logits, lse, targets, mask, offset = res
  z = _masked(logits, offset, vocab_size, pad)
  # Each token's weight in the sum: g, 0 for a masked token, NaN for a bad
  # target, which poisons its whole row so that the non-finite guard sees
  # which parameters the bad batch reached.
  scale = jnp.where(_bad(targets, vocab_size), jnp.nan, jnp.where(mask, g, 0.0))
  # d/dz of sum(lse - z_t): (softmax - onehot) * scale. exp(-inf) is 0 on
  # padding columns. The one-hot part is a scatter-add into the softmax's
  # buffer rather than a second [tokens, V'] pass: one such array alive
  # besides the logits, as autodiff of a plain logsumexp has.
  soft = jnp.exp(z - lse[..., None]) * scale[..., None]
  col, mine = _in_slice(targets, offset, z.shape[-1])
  rows = soft.reshape(-1, z.shape[-1])
  rows = rows.at[jnp.arange(rows.shape[0]), col.reshape(-1)].add(
      jnp.where(mine, -scale, 0.0).reshape(-1))
  return rows.reshape(z.shape).astype(logits.dtype), None, None, None


_loss_sum.defvjp(_sum_fwd, _sum_bwd)


def _float32(logits: jax.Array) -> jax.Array:
  # The statistics in float32 whatever the logits' dtype: a bfloat16
  # logsumexp loses the loss's low bits.
  return logits if logits.dtype == jnp.float32 else logits.astype(jnp.float32)


def _may_pad(offset, width: int, vocab_size: int) -> bool:
  # A Python offset is known before tracing: the whole vocabulary on one
  # device (offset 0, width <= vocab_size) has no padding to mask. A traced
  # offset (a stage's slice) may.
  return not (isinstance(offset, int) and offset + width <= vocab_size)


def cross_entropy(logits: jax.Array, targets: jax.Array, offset: Any = 0,
                  vocab_size: Optional[int] = None, axis: Optional[str] = None) -> jax.Array:
  """Mean cross-entropy of integer targets, from all of the vocabulary's logits or a slice.

  Args:
    logits: [..., V'] logits of vocabulary entries offset .. offset+V'-1
      (computed in float32 here whatever their dtype).
    targets: int [...] target ids; an id outside [0, vocab_size) makes the
      loss and its gradient NaN.
    offset: the first vocabulary entry of the slice (an int, or a traced
      one: the stage index times the slice width).
    vocab_size: the true vocabulary; columns at or beyond it are padding and
      never count. None: V' (the logits are the whole vocabulary).
    axis: the mesh axis the vocabulary is split over, inside `shard_map`;
      None when `logits` hold the whole vocabulary (no collective).

  Returns:
    The mean over tokens of logsumexp(z) - z[target], the same on every
    device of `axis`.
  """
  vocab_size = logits.shape[-1] if vocab_size is None else vocab_size
  mask = jnp.ones(targets.shape, bool)
  pad = _may_pad(offset, logits.shape[-1], vocab_size)
  return _loss_sum(_float32(logits), targets, mask, offset, vocab_size, axis,
                   pad) / targets.size


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


def chunked_cross_entropy(logits_fn: Callable[[Params, jax.Array], jax.Array], params: Params,
                          x: jax.Array, targets: jax.Array, offset: Any = 0,
                          vocab_size: Optional[int] = None, axis: Optional[str] = None,
                          chunk: int = 0) -> jax.Array:
  """`cross_entropy(logits_fn(params, x), targets, ...)` with at most `chunk` tokens' logits alive.

  The tokens of `x` [..., dim] (all leading axes flattened, row-major) go
  through `logits_fn` and the loss `chunk` at a time in a `lax.scan`; each
  chunk is `jax.checkpoint`ed, so its backward recomputes its logits (one
  more output-layer matmul per token) instead of keeping [tokens, V']
  float32 logits from the forward. With `axis` set, each chunk does its own
  `all_gather` of per-token statistics, and its recomputation in the
  backward another (a collective in a scan, never in a `cond`, is safe on
  every device). A token count that `chunk` does not divide is padded with
  masked tokens that add 0 and count 0, so the result is the mean over the
  real tokens: (sum of the chunks' sums) / tokens, with the same NaN on a
  bad target.

  Args:
    logits_fn: (params, x [1, c, dim]) -> logits [1, c, V'] of the slice
      (with chunk 0: (params, x) -> [..., V']).
    params: what `logits_fn` reads (differentiable).
    x: [..., dim] hidden states; targets: int [...] of the same leading shape.
    offset, axis: as in `cross_entropy`.
    vocab_size: as in `cross_entropy`; required when chunking (a chunk's
      logits are not known before the scan).
    chunk: tokens per chunk (a chunk beyond the token count is cut to it);
      0 computes all logits at once (`cross_entropy`).
  """
  if chunk <= 0:
    return cross_entropy(logits_fn(params, x), targets, offset, vocab_size, axis)
  if vocab_size is None:
    raise ValueError("chunked_cross_entropy needs vocab_size when chunk > 0")
  n = targets.size
  xs = _chunks(x, targets, min(chunk, n))

  def one(p, xc, tc, mc):
    logits = logits_fn(p, xc)
    pad = _may_pad(offset, logits.shape[-1], vocab_size)
    return _loss_sum(_float32(logits), tc, mc, offset, vocab_size, axis, pad)

  # Inside a scan the forward and the recomputation cannot be merged, so
  # `prevent_cse` would only cost optimisation barriers.
  one = jax.checkpoint(one, prevent_cse=False)

  # The chunk sums come out as the scan's outputs rather than a carry, so no
  # carry has to be typed as varying over the mesh like the sums are.
  _, sums = lax.scan(lambda c, xc: (c, one(params, *xc)), None, xs)
  return jnp.sum(sums) / n
