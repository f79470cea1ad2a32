"""Causal self-attention behind one switch: XLA's, cuDNN's, or a blockwise one.

`model.attention` picks the implementation:

  xla        jax.nn.dot_product_attention: one dense batched matmul that
             materialises the [batch, heads, seq, seq] probabilities and
             keeps them for the backward, so its memory grows with seq^2.
  cudnn      cuDNN's fused flash attention (NVIDIA GPUs, bfloat16 or float16
             only): memory linear in seq.
  blockwise  `blockwise_attention` below, written with lax loops: runs on any
             backend and dtype, memory linear in seq.
  auto       cudnn where it can run, otherwise blockwise for sequences of
             more than AUTO_BLOCKWISE_ABOVE tokens, otherwise xla.

`select_attention` makes that choice from plain values (backend name, dtype, sequence
length, head size) so that it can be tested on any machine; `attention` asks
the running backend and calls the implementation. `resolve_attention` is
what a run does once at start-up: where the choice is cuDNN it compiles and
runs cuDNN's forward and backward on the run's shapes (`cudnn_failure`), and
`auto` falls back to blockwise, with a line saying why, if anything fails.

Layout everywhere: q [batch, seq, n_heads, head_dim], k and v [batch, seq,
n_kv_heads, head_dim], query head h reading key/value head h // (n_heads /
n_kv_heads) (grouped-query attention, as in jax.nn.dot_product_attention).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe import _target
from jaxpipe.errors import ConfigError
from jaxpipe.model._config import ATTENTION_SETTINGS, ModelConfig

__all__ = ["SETTINGS", "BLOCK_SIZE", "AUTO_BLOCKWISE_ABOVE", "attention", "attention_backend",
           "blockwise_attention", "cached_attention", "cudnn_attention", "select_attention",
           "cudnn_failure", "resolve_attention"]

SETTINGS = ATTENTION_SETTINGS

# Query and key rows per block. The live working set of one step of the loops
# is a few [batch, heads, 128, 128] float32 score blocks (9 MiB each at 16
# sequences and 9 heads), small next to the activations at any sequence
# length, while 128 rows keep each matmul large enough to be efficient (a
# common tile size of flash-attention kernels too).
BLOCK_SIZE = 128

# `auto` without cuDNN. XLA keeps batch * heads * seq^2 * 4 bytes of
# probabilities per block for the backward: at 1024 tokens, 16 sequences and
# 9 heads that is 576 MiB a block, a price worth paying for one dense batched
# matmul (no loop, no recomputation) on an accelerator; at 2048 it is 2.3 GiB
# and grows fourfold with every doubling. Short sequences, the tests' and the
# small configs' included, keep XLA's attention as before. (On a CPU the
# blockwise loops were faster at every length measured, 128 tokens up:
# docs/accelerators.md; set model.attention=blockwise there.)
AUTO_BLOCKWISE_ABOVE = 1024

# cuDNN flash attention takes half precision only, and head sizes that are
# multiples of 8 up to 128 on every GPU it supports (256 from Hopper on; auto
# stays with the bound that holds everywhere, an explicit `cudnn` lets cuDNN
# judge).
_CUDNN_DTYPES = ("bfloat16", "float16")
_CUDNN_MAX_HEAD_DIM = 128


def attention_backend() -> str:
  """The platform attention is traced for, with NVIDIA GPUs told apart: cuda, rocm, cpu, tpu, ...

  The running backend's, or the target's of a step compiled ahead of time
  for other devices (`jaxpipe._target.compiling_for`).
  """
  return _target.platform()


def _cudnn_refusal(backend_name: str, dtype_name: str) -> str | None:
  """Why cuDNN attention cannot run here, or None where it can."""
  if backend_name != "cuda":
    return f"it needs an NVIDIA GPU with cuDNN, and this backend is {backend_name}"
  if dtype_name not in _CUDNN_DTYPES:
    return (f"cuDNN flash attention takes bfloat16 or float16, and model.compute_dtype is "
            f"{dtype_name}")
  return None


def select_attention(setting: str, *, backend: str, dtype, seq_len: int, head_dim: int) -> str:
  """The implementation (xla, blockwise or cudnn) that `model.attention=setting` means here.

  Args:
    setting: auto, xla, blockwise or cudnn.
    backend: a name as `attention_backend()` returns it ("cuda" for NVIDIA GPUs).
    dtype: the dtype of q, k and v (the compute dtype).
    seq_len: tokens per sequence.
    head_dim: size of one attention head.

  Returns:
    "xla", "blockwise" or "cudnn".

  Raises:
    ConfigError: for an unknown setting, or `cudnn` where cuDNN cannot run.
  """
  if setting not in SETTINGS:
    raise ConfigError(f"model.attention must be one of {', '.join(SETTINGS)}; got '{setting}'")
  dtype_name = jnp.dtype(dtype).name
  refusal = _cudnn_refusal(backend, dtype_name)
  if setting == "cudnn":
    if refusal:
      raise ConfigError(f"model.attention=cudnn cannot run: {refusal}; use model.attention="
                        "auto (which falls back to blockwise or xla), blockwise or xla")
    return "cudnn"
  if setting != "auto":
    return setting
  if refusal is None and head_dim % 8 == 0 and head_dim <= _CUDNN_MAX_HEAD_DIM:
    return "cudnn"
  return "blockwise" if seq_len > AUTO_BLOCKWISE_ABOVE else "xla"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, setting: str = "auto") -> jax.Array:
  """Causal softmax(q k^T / sqrt(head_dim)) v with the implementation `setting` selects here.

  q: [batch, seq, n_heads, head_dim]; k, v: [batch, seq, n_kv_heads,
  head_dim]; returns [batch, seq, n_heads, head_dim] in q's dtype.
  """
  impl = select_attention(setting, backend=attention_backend(), dtype=q.dtype,
                          seq_len=q.shape[1], head_dim=q.shape[-1])
  if impl == "blockwise":
    return blockwise_attention(q, k, v)
  if impl == "xla":
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  try:
    return cudnn_attention(q, k, v)
  except NotImplementedError as e:
    # cuDNN's own shape checks (head size, architecture) run while tracing.
    reason = " ".join(str(e).split())  # one line, as the trainer prints it
    raise ConfigError(f"model.attention=cudnn cannot run these shapes: {reason}; use "
                      "model.attention=blockwise or xla") from None


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """cuDNN's fused causal attention (JAX's `implementation="cudnn"`)."""
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _one_line(e: BaseException, limit: int = 300) -> str:
  """An exception as one line of at most `limit` characters (XLA's messages span many)."""
  text = " ".join(f"{type(e).__name__}: {e}".split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


@functools.lru_cache(maxsize=None)
def cudnn_failure(batch: int, seq_len: int, n_heads: int, n_kv_heads: int, head_dim: int,
                  dtype: str) -> Optional[str]:
  """Why cuDNN attention fails on these shapes here, in one line, or None where it works.

  Compiles and runs the forward and the backward of causal cuDNN attention
  once on zeros of the given shapes ([batch, seq_len, heads, head_dim] in
  `dtype`). Remembered per shape: a run tries once, at start-up.
  """
  # Every failure counts, not only the NotImplementedError of JAX's own
  # checks: cuDNN and XLA report an unsupported GPU, shape or library version
  # as compile or runtime errors of their own types.
  try:
    q = jnp.zeros((batch, seq_len, n_heads, head_dim), dtype)
    kv = jnp.zeros((batch, seq_len, n_kv_heads, head_dim), dtype)
    loss = lambda q, k, v: cudnn_attention(q, k, v).astype(jnp.float32).sum()
    jax.block_until_ready(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, kv, kv))
  except Exception as e:  # pylint: disable=broad-exception-caught
    return _one_line(e)
  return None


def resolve_attention(cfg: ModelConfig, rows: int,
                      seq_len: int) -> tuple[ModelConfig, Optional[str]]:
  """`cfg` with model.attention as it can run here on [rows, seq_len] inputs, and a note.

  Where `select_attention` picks cuDNN (an NVIDIA GPU, a half-precision compute dtype),
  cuDNN's forward and backward are tried once on these shapes
  (`cudnn_failure`). If they fail, `auto` becomes `blockwise` (memory linear
  in the sequence, like cuDNN's) and the note says why in one line; an
  explicit `cudnn` raises ConfigError instead. Elsewhere `cfg` comes back
  unchanged and the note is None.

  Args:
    cfg: the model's config.
    rows: sequences one device's attention sees at once (a microbatch's
      share of one data replica).
    seq_len: tokens per sequence.
  """
  head_dim = cfg.dim // cfg.n_heads
  dtype = jnp.dtype(cfg.compute_dtype).name
  impl = select_attention(cfg.attention, backend=attention_backend(), dtype=dtype,
                          seq_len=seq_len, head_dim=head_dim)
  if impl != "cudnn":
    return cfg, None
  why = cudnn_failure(rows, seq_len, cfg.n_heads, cfg.n_kv_heads, head_dim, dtype)
  if why is None:
    return cfg, None
  shape = f"{rows} x {seq_len} tokens, {cfg.n_heads} heads of {head_dim}, {dtype}"
  if cfg.attention == "cudnn":
    raise ConfigError(f"model.attention=cudnn cannot run on {shape}: {why}; use "
                      "model.attention=auto, blockwise or xla")
  return (dataclasses.replace(cfg, attention="blockwise"),
          f"model.attention=auto: cuDNN attention failed on {shape} ({why}); using "
          "blockwise attention")


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
  """softmax(q k^T / sqrt(head_dim)) v over the key slots at or before each query's position.

  The decoding counterpart of `attention`: k and v are a key-value cache
  whose slot j holds the token at position j, and a query at position p
  reads slots 0..p (so slots past p may hold anything). Every query row sees
  at least its own slot. XLA's dense attention with a mask, whatever
  model.attention says: one query per sequence needs neither cuDNN nor blocks.

  Args:
    q: [batch, seq, n_heads, head_dim], the queries at `positions`.
    k, v: [batch, slots, n_kv_heads, head_dim].
    positions: int [batch, seq], each below slots.

  Returns:
    [batch, seq, n_heads, head_dim] in q's dtype.
  """
  visible = jnp.arange(k.shape[1])[None, None, :] <= positions[:, :, None]  # [b, seq, slots]
  return jax.nn.dot_product_attention(q, k, v, mask=visible[:, None], implementation="xla")


# ---------------------------------------------------------------------------
# Blockwise attention.
#
# Queries and keys are cut into n blocks of B rows. Only the n(n+1)/2 block
# pairs (i, j) with key block j <= query block i are visited: the blocks
# above the diagonal are entirely in the future and are skipped, not masked.
# Each loop is one lax.scan over a static list of those pairs, so its trip
# count is known to XLA and to the FLOP counter of the planner.
#
# The forward folds pair (i, j) into query block i's running row maximum m,
# row sum l and weighted sum o, all in float32, or float64 for float64
# inputs (the online softmax of Milakov & Gimelshein, "Online normalizer
# calculation for softmax", arXiv:1805.02867, 2018), visiting each row's key
# blocks in order 0..i. It keeps only the output and each row's log-sum-exp,
# lse = m + log(l).
#
# The backward (as in Dao, "FlashAttention-2", arXiv:2307.08691, 2023)
# recomputes each visited block's probabilities exactly as p = exp(s - lse)
# and accumulates, pair by pair:
#   dv_j += p^T do_i;  dp = do_i v_j^T;  ds = p * (dp - delta_i);
#   dk_j += ds^T q_i * scale;  dq_i += ds k_j * scale,
# with delta = rowsum(do * o) computed once. Nothing of size seq^2 exists at
# any time; the residuals are q, k, v, o and lse, and the loops carry
# float32 accumulators the size of q, k and v.
#
# Masking: within a visited block, key position > query position gets -inf
# before the exponential (only diagonal blocks have such entries). A sequence
# that is not a multiple of B is padded at the end with zeros; a padded key
# comes after every real query, so the causal mask already hides it from
# them, and the padded query rows are cut from the output (and get a zero
# cotangent, so they add nothing to dk and dv). The first visited block
# (j = 0) has at least one visible key per row, so m is finite from the first
# step on and exp(m_old - m_new) never sees -inf - -inf.
# ---------------------------------------------------------------------------


def _num_blocks(seq_len: int, block_size: int) -> tuple[int, int]:
  """(rows per block, blocks): one block of seq_len rows when the sequence is shorter."""
  rows = min(block_size, seq_len)
  return rows, -(-seq_len // rows)


def _to_blocks(x: jax.Array, n: int, rows: int) -> jax.Array:
  """[b, t, h, d] -> [n, b, h, rows, d], zero-padding t to n * rows."""
  b, t, h, d = x.shape
  x = jnp.pad(x, ((0, 0), (0, n * rows - t), (0, 0), (0, 0)))
  return x.reshape(b, n, rows, h, d).transpose(1, 0, 3, 2, 4)


def _from_blocks(x: jax.Array, t: int) -> jax.Array:
  """[n, b, h, rows, d] -> [b, t, h, d], dropping the padding."""
  n, b, h, rows, d = x.shape
  return x.transpose(1, 0, 3, 2, 4).reshape(b, n * rows, h, d)[:, :t]


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
  """[n, b, H, rows, d] -> [n, b, K, H/K, rows, d]: query heads by their key/value head."""
  n, b, h, rows, d = x.shape
  return x.reshape(n, b, kv_heads, h // kv_heads, rows, d)


def _stats_dtype(dtype) -> jnp.dtype:
  """float32, or float64 for float64 inputs: the softmax's statistics and the sums."""
  return jnp.promote_types(dtype, jnp.float32)


def _zero(acc, *xs: jax.Array) -> jax.Array:
  """A scalar 0 of dtype acc that varies over whatever mesh axes the inputs vary over.

  Loop carries inside shard_map must have the type of what the loop body adds
  to them; a fresh jnp.zeros would be invariant, so the initial carries are
  built as zeros plus this.
  """
  return sum(jnp.zeros_like(x, acc, shape=()) for x in xs)


def _scores(qi: jax.Array, kj: jax.Array, i, j, scale: float, acc) -> jax.Array:
  """Masked scores of query block i against key block j: [b, K, G, rows, rows] in acc."""
  s = jnp.einsum("bkgqd,bkcd->bkgqc", qi, kj, preferred_element_type=acc) * scale
  rows = qi.shape[-2]
  q_pos = i * rows + lax.broadcasted_iota(jnp.int32, (rows, rows), 0)
  k_pos = j * rows + lax.broadcasted_iota(jnp.int32, (rows, rows), 1)
  return jnp.where(k_pos <= q_pos, s, -jnp.inf)


def _pairs(n: int, by_key: bool) -> tuple[jax.Array, jax.Array]:
  """(query block i, key block j) of every block pair with j <= i: n(n+1)/2 of them.

  Ordered by query block (forward) or by key block (backward). A static list
  makes one lax.scan of fixed length: no loop whose trip count depends on i,
  which XLA would run as a while loop of unknown length.
  """
  pairs = [(i, j) for i in range(n) for j in range(i + 1)]
  if by_key:
    pairs.sort(key=lambda p: (p[1], p[0]))
  i, j = np.array(pairs, np.int32).T
  return jnp.asarray(i), jnp.asarray(j)


def _forward(q, k, v, block_size):
  """(output [b, t, H, d] in q's dtype, lse [n, b, K, G, rows] in the statistics' dtype)."""
  t, d, kv_heads = q.shape[1], q.shape[-1], k.shape[2]
  rows, n = _num_blocks(t, block_size)
  scale = 1.0 / math.sqrt(d)
  acc = _stats_dtype(q.dtype)
  qb = _grouped(_to_blocks(q, n, rows), kv_heads)   # [n, b, K, G, rows, d]
  kb, vb = _to_blocks(k, n, rows), _to_blocks(v, n, rows)  # [n, b, K, rows, d]
  zero = _zero(acc, q, k, v)

  def pair(carry, ij):
    m, l, o = carry  # running max, sum and weighted sum of every query row
    i, j = ij
    s = _scores(qb[i], kb[j], i, j, scale, acc)
    m_new = jnp.maximum(m[i], s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    correction = jnp.exp(m[i] - m_new)
    # The probabilities meet v in v's dtype (bfloat16 on accelerators); the
    # sum stays in the statistics' dtype.
    pv = jnp.einsum("bkgqc,bkcd->bkgqd", p.astype(v.dtype), vb[j], preferred_element_type=acc)
    return (m.at[i].set(m_new), l.at[i].set(l[i] * correction + p.sum(-1)),
            o.at[i].set(o[i] * correction[..., None] + pv)), None

  stats = qb.shape[:-1]  # [n, b, K, G, rows]
  init = (jnp.full(stats, -jnp.inf, acc) + zero, jnp.zeros(stats, acc) + zero,
          jnp.zeros(qb.shape, acc) + zero)
  (m, l, o), _ = lax.scan(pair, init, _pairs(n, by_key=False))
  b, heads = q.shape[0], q.shape[2]
  o = (o / l[..., None]).astype(q.dtype).reshape(n, b, heads, rows, d)
  return _from_blocks(o, t), m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blockwise(q, k, v, block_size):
  return _forward(q, k, v, block_size)[0]


def _blockwise_fwd(q, k, v, block_size):
  o, lse = _forward(q, k, v, block_size)
  return o, (q, k, v, o, lse)


def _blockwise_bwd(block_size, residuals, do):
  q, k, v, o, lse = residuals
  t, d, kv_heads = q.shape[1], q.shape[-1], k.shape[2]
  rows, n = _num_blocks(t, block_size)
  scale = 1.0 / math.sqrt(d)
  acc = lse.dtype
  qb, ob, dob = (_grouped(_to_blocks(x, n, rows), kv_heads) for x in (q, o, do))
  kb, vb = _to_blocks(k, n, rows), _to_blocks(v, n, rows)
  # delta_i = rowsum(do * o) = rowsum(p * dp): the softmax's backward term.
  delta = jnp.sum(dob.astype(acc) * ob.astype(acc), axis=-1)
  zero = _zero(acc, q, k, v, do)

  def pair(carry, ij):
    dq, dk, dv = carry
    i, j = ij
    qi, doi, kj, vj = qb[i], dob[i], kb[j], vb[j]
    p = jnp.exp(_scores(qi, kj, i, j, scale, acc) - lse[i][..., None])
    dv = dv.at[j].add(jnp.einsum("bkgqc,bkgqd->bkcd", p.astype(do.dtype), doi,
                                 preferred_element_type=acc))
    dp = jnp.einsum("bkgqd,bkcd->bkgqc", doi, vj, preferred_element_type=acc)
    ds = (p * (dp - delta[i][..., None]) * scale).astype(q.dtype)
    dk = dk.at[j].add(jnp.einsum("bkgqc,bkgqd->bkcd", ds, qi, preferred_element_type=acc))
    dq = dq.at[i].add(jnp.einsum("bkgqc,bkcd->bkgqd", ds, kj, preferred_element_type=acc))
    return (dq, dk, dv), None

  init = tuple(jnp.zeros(x.shape, acc) + zero for x in (qb, kb, vb))
  (dq, dk, dv), _ = lax.scan(pair, init, _pairs(n, by_key=True))
  b, heads = q.shape[0], q.shape[2]
  dq = _from_blocks(dq.reshape(n, b, heads, rows, d), t)
  return (dq.astype(q.dtype), _from_blocks(dk, t).astype(k.dtype),
          _from_blocks(dv, t).astype(v.dtype))


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                        block_size: int = BLOCK_SIZE) -> jax.Array:
  """Causal softmax(q k^T / sqrt(head_dim)) v in blocks, with memory linear in seq.

  The same function as jax.nn.dot_product_attention(q, k, v, is_causal=True),
  computed block by block with an online softmax whose statistics are float32
  whatever the inputs' dtype (float64 for float64 inputs); its gradient
  recomputes the probabilities from the saved per-row log-sum-exp instead of
  storing them (see the comment above for the algorithm and the masking).
  Uses no collectives, so it runs per device inside shard_map; composes with
  jit, vmap, grad and checkpoint.

  Args:
    q: [batch, seq, n_heads, head_dim].
    k: [batch, seq, n_kv_heads, head_dim]; n_heads a multiple of n_kv_heads.
    v: like k.
    block_size: query and key rows per block; a sequence shorter than this is
      one block, a longer one not divisible by it is zero-padded at the end.

  Returns:
    [batch, seq, n_heads, head_dim] in q's dtype.

  Example:
    >>> q = jnp.ones((2, 300, 4, 16)); kv = jnp.ones((2, 300, 2, 16))
    >>> blockwise_attention(q, kv, kv).shape
    (2, 300, 4, 16)
  """
  if q.ndim != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or \
      k.shape[-1] != q.shape[-1] or q.shape[2] % k.shape[2]:
    raise ValueError(f"blockwise_attention: q {q.shape} and k, v {k.shape}, {v.shape} are not "
                     "[b, t, H, d] and [b, t, K, d] with H a multiple of K")
  if block_size < 1:
    raise ValueError(f"blockwise_attention: block_size must be >= 1, got {block_size}")
  return _blockwise(q, k, v, int(block_size))
