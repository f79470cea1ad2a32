"""A Llama-style decoder (SmolLM shapes) with its blocks stacked on a leading axis.

RMSNorm, rotary position embeddings, grouped-query attention, a SwiGLU MLP (or
a Mixture-of-Experts layer), pre-norm residual blocks. The parameter tree is

  {'embed':  {'embedding': [vocab, dim]},
   'blocks': {...every leaf stacked: [n_layers, ...]},
   'head':   {'norm': {'scale': [dim]}, 'out': {'kernel': [dim, vocab]}}}

('head/out' is absent with tied embeddings). The model is split into pure
functions so that a pipeline can give them to different stages: `embed` (a row
lookup, so a stage can hold some of the rows), `apply_blocks` on any slice of
the stacked blocks, and `logits` (the final norm and the output layer, on any
slice of the vocabulary); `vocab_axes` says which axis of each non-block leaf
is the vocabulary. The model knows nothing of meshes: a Mixture-of-Experts
layer given a slice of the experts sends tokens to them through an exchange
function its caller passes to `make_model` (expert parallelism).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpipe._vma import match_varying
from jaxpipe.model._config import DTYPE_NAMES, ModelConfig
from jaxpipe.model import _attention, _moe
# The one cross-entropy, shared with the pipeline (see jaxpipe/xent.py);
# `cross_entropy` is also this package's public name for it.
from jaxpipe.xent import chunked_cross_entropy, cross_entropy

Params = Any

__all__ = ["Model", "Block", "KVCache", "make_model", "ffn_dim", "dtype_of", "num_params",
           "output_logits", "flops_per_token", "token_flops", "TokenFlops", "cross_entropy",
           "block_matmul_params"]


def dtype_of(name: str) -> jnp.dtype:
  """Maps a config dtype name (one of `DTYPE_NAMES`) to a JAX dtype."""
  if name not in DTYPE_NAMES:
    raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
  return jnp.dtype(name)


def ffn_dim(cfg: ModelConfig) -> int:
  """The SwiGLU hidden size: cfg.ffn_dim, or 8/3 * dim rounded up to 32."""
  if cfg.ffn_dim:
    return cfg.ffn_dim
  return 32 * math.ceil(8 * cfg.dim / 3 / 32)


class RMSNorm(nn.Module):
  """x / rms(x) * scale, computed in float32."""
  eps: float
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rotary(x: jax.Array, theta: float, positions: jax.Array | None = None) -> jax.Array:
  """Rotates pairs (i, i + half) of each head by position-dependent angles.

  x: [batch, seq, heads, head_dim]; positions: int [batch, seq], or None for
  0..seq-1 in every row (training; decoding gives each token its own).
  """
  seq, head_dim = x.shape[1], x.shape[-1]
  half = head_dim // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if positions is None:
    positions = jnp.arange(seq, dtype=jnp.float32)[None, :]
  angle = positions.astype(jnp.float32)[..., None] * freq  # [batch or 1, seq, half]
  cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
  xf = x.astype(jnp.float32)
  a, b = xf[..., :half], xf[..., half:]
  return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(x.dtype)


class KVCache(NamedTuple):
  """One block's keys and values for decoding: slot j holds the token at position j.

  k, v: [batch, slots, n_kv_heads, head_dim] in the compute dtype (rotary
  already applied to k). Stacked over blocks, every leaf gets a leading
  [n_layers] axis, like params['blocks'].
  """
  k: jax.Array
  v: jax.Array


class Attention(nn.Module):
  """Causal grouped-query self-attention with rotary embeddings.

  The attention itself is the implementation `cfg.attention` selects
  (`_attention.select_attention`): XLA's, cuDNN's, or the blockwise one whose memory is
  linear in the sequence length.

  Called as (x, positions, cache) it decodes instead: the tokens of x sit at
  `positions` [batch, seq]; their keys and values are written into those
  slots of `cache` (a KVCache), every query reads the slots at or before its
  own position (`_attention.cached_attention`), and it returns (output,
  updated cache). The parameters are the same either way.
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions=None, cache=None):
    cfg = self.cfg
    head_dim = cfg.dim // cfg.n_heads
    dense = lambda n, name, std: nn.Dense(
        n, use_bias=False, name=name, dtype=dtype_of(cfg.compute_dtype),
        param_dtype=dtype_of(cfg.param_dtype), kernel_init=nn.initializers.normal(std))
    std_out = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    b, t, _ = x.shape
    q = dense(cfg.n_heads * head_dim, "q", cfg.init_std)(x).reshape(b, t, cfg.n_heads, head_dim)
    k = dense(cfg.n_kv_heads * head_dim, "k", cfg.init_std)(x).reshape(b, t, cfg.n_kv_heads, head_dim)
    v = dense(cfg.n_kv_heads * head_dim, "v", cfg.init_std)(x).reshape(b, t, cfg.n_kv_heads, head_dim)
    q, k = rotary(q, cfg.rope_theta, positions), rotary(k, cfg.rope_theta, positions)
    if cache is None:
      o = _attention.attention(q, k, v, cfg.attention)  # [b, t, n_heads, head_dim]
    else:
      rows = jnp.arange(b)[:, None]
      cache = KVCache(cache.k.at[rows, positions].set(k.astype(cache.k.dtype)),
                      cache.v.at[rows, positions].set(v.astype(cache.v.dtype)))
      o = _attention.cached_attention(q, cache.k, cache.v, positions)
    out = dense(cfg.dim, "o", std_out)(o.reshape(b, t, cfg.n_heads * head_dim))
    return out if cache is None else (out, cache)


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    dense = lambda n, name, std: nn.Dense(
        n, use_bias=False, name=name, dtype=dtype_of(cfg.compute_dtype),
        param_dtype=dtype_of(cfg.param_dtype), kernel_init=nn.initializers.normal(std))
    hidden = ffn_dim(cfg)
    h = nn.silu(dense(hidden, "gate", cfg.init_std)(x)) * dense(hidden, "up", cfg.init_std)(x)
    return dense(cfg.dim, "down", cfg.init_std / math.sqrt(2 * cfg.n_layers))(h)


class Block(nn.Module):
  """One pre-norm transformer block; returns (x, auxiliary loss).

  Called as (x, positions, cache) it decodes with a KVCache (see Attention)
  and returns (x, auxiliary loss, updated cache). `exchange`: see `MoE`.
  """
  cfg: ModelConfig
  exchange: Optional[Callable[[jax.Array], jax.Array]] = None

  @nn.compact
  def __call__(self, x, positions=None, cache=None):
    cfg = self.cfg
    pd = dtype_of(cfg.param_dtype)
    a = Attention(cfg, name="attn")(RMSNorm(cfg.norm_eps, pd, name="attn_norm")(x), positions,
                                    cache)
    if cache is not None:
      a, cache = a
    x = x + a
    h = RMSNorm(cfg.norm_eps, pd, name="mlp_norm")(x)
    if cfg.moe.num_experts:
      y, aux = _moe.MoE(cfg, self.exchange, name="moe")(h)
    else:
      y, aux = MLP(cfg, name="mlp")(h), jnp.zeros_like(h, jnp.float32, shape=())
    return (x + y, aux) if cache is None else (x + y, aux, cache)


class Model(NamedTuple):
  """The model as pure functions of parameter pytrees.

  Attributes:
    cfg: the model config (vocab_size resolved).
    init: rng -> params.
    embed: (params, tokens [b, t] int32) -> activations [b, t, dim]. Reads
      only params['embed'] and is a row lookup.
    apply_blocks: (blocks, x) -> (x, aux): runs every block of a stacked slice
      of params['blocks'] in order; aux is the sum of their auxiliary losses.
    logits: (params, x) -> float32 logits [b, t, V'] over the vocabulary
      entries the output layer in params holds (V' = V unless sliced). Reads
      params['head'] (and params['embed'] when tied).
    head_loss: (params, x, targets) -> mean next-token cross-entropy
      (`jaxpipe.xent.chunked_cross_entropy`, computed cfg.loss_chunk tokens at
      a time when that is set); a target outside the vocabulary makes it and
      its gradient NaN.
    loss: (params, tokens, targets) -> cross-entropy plus auxiliary losses of
      the whole model on one device: the reference every pipeline must match.
      Schedule `none` computes exactly this (the same functions in the same
      order), and the pipelines' vocabulary-parallel head the same
      cross-entropy over a split vocabulary.
    vocab_axes: like the non-block params: the vocabulary axis of each leaf,
      or None.
    compute_blocks: blocks -> the blocks with every matrix in the compute
      dtype (what the blocks cast them to anyway), for a pipeline to cast
      once per step; norm scales and the router stay as they are.
    expert_axes: blocks -> a tree like them giving each leaf's expert axis
      (1, after the layer axis, for the experts' matrices) or None; all None
      for a model built without an `exchange`, which cannot split them.
  """
  cfg: ModelConfig
  init: Callable[[jax.Array], Params]
  embed: Callable[[Params, jax.Array], jax.Array]
  apply_blocks: Callable[[Params, jax.Array], tuple[jax.Array, jax.Array]]
  logits: Callable[[Params, jax.Array], jax.Array]
  head_loss: Callable[[Params, jax.Array, jax.Array], jax.Array]
  loss: Callable[[Params, jax.Array, jax.Array], jax.Array]
  vocab_axes: Any
  compute_blocks: Callable[[Params], Params]
  expert_axes: Callable[[Params], Any]


def _expert_axes(blocks: Params) -> Any:
  def axis(path, _):
    names = [getattr(k, "key", None) for k in path]
    return 1 if "moe" in names and names[-2] in _moe.EXPERT_MATRICES else None
  return jax.tree_util.tree_map_with_path(axis, blocks)


def output_logits(h: jax.Array, w: jax.Array) -> jax.Array:
  """float32 logits h @ w of compute-dtype operands, whose backward runs in their dtype.

  h: [..., dim], w: [dim, vocab] in the compute dtype; the product is
  accumulated and returned in float32 (a bfloat16 softmax loses the loss's
  low bits). Differentiated as written, the product's float32 cotangent
  would make both backward matmuls float32 ones, which a GPU runs at half
  its bfloat16 rate (TF32), or slower: here the cotangent is cast to the
  operands' dtype first, and each matmul accumulates in float32, as every
  other matmul of the model does. With float32 operands nothing changes.
  Inside `shard_map` (a pipeline's head: h whole, w a vocabulary slice) the
  operands are first typed alike, so that each cotangent has its operand's
  type (`jaxpipe._vma`).
  """
  return _output_logits(*match_varying(h, w))


@jax.custom_vjp
def _output_logits(h: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.dot(h, w, preferred_element_type=jnp.float32)


def _output_logits_fwd(h, w):
  return _output_logits(h, w), (h, w)


def _output_logits_bwd(res, g):
  h, w = res
  g = g.astype(h.dtype)
  lead = tuple(range(h.ndim - 1))
  g_h = jnp.dot(g, w.T, preferred_element_type=jnp.float32).astype(h.dtype)
  g_w = jnp.tensordot(h, g, axes=(lead, lead),
                      preferred_element_type=jnp.float32).astype(w.dtype)
  return g_h, g_w


_output_logits.defvjp(_output_logits_fwd, _output_logits_bwd)


def make_model(cfg: ModelConfig,
          exchange: Optional[Callable[[jax.Array], jax.Array]] = None) -> Model:
  """Returns the model's pure functions for a config whose vocab_size is set.

  `exchange` is how a Mixture-of-Experts layer given a slice of the experts
  sends token slots to the devices that hold the others (see `MoE`); with
  whole expert weights it is not called.
  """
  if cfg.vocab_size <= 0:
    raise ValueError("model.vocab_size must be resolved (> 0) before building the model")
  cd, pd = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
  block = Block(cfg, exchange)
  norm = RMSNorm(cfg.norm_eps, pd)

  def init(rng):
    k_embed, k_blocks, k_head = jax.random.split(rng, 3)
    embedding = (cfg.init_std * jax.random.normal(k_embed, (cfg.vocab_size, cfg.dim))).astype(pd)
    x = jnp.zeros((1, 2, cfg.dim), cd)
    blocks = jax.vmap(lambda k: block.init(k, x)["params"])(
        jax.random.split(k_blocks, cfg.n_layers))
    head = {"norm": norm.init(k_head, x)["params"]}
    if not cfg.tie_embeddings:
      head["out"] = {"kernel": (cfg.init_std * jax.random.normal(
          k_head, (cfg.dim, cfg.vocab_size))).astype(pd)}
    return {"embed": {"embedding": embedding}, "blocks": blocks, "head": head}

  def embed(params, tokens):
    return jnp.take(params["embed"]["embedding"], tokens, axis=0).astype(cd)

  def one_block(carry, p):
    x, aux = carry
    y, a = block.apply({"params": p}, x)
    return (y, aux + a), None

  policies = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
  body = one_block if cfg.remat == "none" else jax.checkpoint(one_block,
                                                               policy=policies[cfg.remat])

  def apply_blocks(blocks, x):
    # zeros_like keeps x's type inside shard_map (what varies over the mesh),
    # so the scan carry's type does not change when a block adds its loss.
    (x, aux), _ = jax.lax.scan(body, (x, jnp.zeros_like(x, jnp.float32, shape=())), blocks)
    return x, aux

  def logits(params, x):
    h = norm.apply({"params": params["head"]["norm"]}, x)
    if cfg.tie_embeddings:
      w = params["embed"]["embedding"].astype(cd).T
    else:
      w = params["head"]["out"]["kernel"].astype(cd)
    return output_logits(h, w)

  def head_loss(params, x, targets):
    # The call a pipeline's one-device reference makes too (StageFns.loss):
    # the same function of the same arguments, so `none` trains on this loss.
    return chunked_cross_entropy(logits, params, x, targets, offset=0,
                                 vocab_size=cfg.vocab_size, axis=None, chunk=cfg.loss_chunk)

  def loss(params, tokens, targets):
    x, aux = apply_blocks(params["blocks"], embed(params, tokens))
    return head_loss(params, x, targets) + aux

  vocab_axes = {"embed": {"embedding": 0}, "head": {"norm": {"scale": None}}}
  if not cfg.tie_embeddings:
    vocab_axes["head"]["out"] = {"kernel": 1}

  def compute_blocks(blocks):
    def cast(path, x):
      names = [getattr(k, "key", None) for k in path]
      if names[-1] == "kernel" and "router" not in names and x.dtype != cd:
        return x.astype(cd)
      return x
    return jax.tree_util.tree_map_with_path(cast, blocks)

  expert_axes = _expert_axes if exchange else lambda b: jax.tree.map(lambda _: None, b)
  return Model(cfg, init, embed, apply_blocks, logits, head_loss, loss, vocab_axes,
               compute_blocks, expert_axes)


def num_params(params: Params) -> int:
  """Counts the scalar parameters of a tree."""
  return sum(int(x.size) for x in jax.tree.leaves(params))


class TokenFlops(NamedTuple):
  """Forward FLOPs of one token through each part of the model (a multiply-add is 2).

  Per token of a sequence of T tokens, summed over the n_layers blocks; a
  training step costs 3 times the forward (the backward is twice it).

  Attributes:
    dense: the blocks' matmuls with weights other than the experts: q, k, v,
      o and the SwiGLU MLP (or, in a Mixture-of-Experts block, the router).
    experts: the top_k experts a token is routed to (0 for a dense model).
    expert_slots: what the expert kernels compute per token: every slot of
      their fixed capacity, filled or not (about capacity_factor x experts).
    attention: scores q k^T and their use p v under the causal mask, counted
      as half of the full [T, T] products (2 * L * heads * head_dim * T), the
      convention of FlashAttention's benchmarks: a causal kernel skips the
      masked half.
    attention_full: the same without the mask's saving (PaLM's 12LDT, /3).
    head: the output layer, 2 * dim * vocab.
  """
  dense: float
  experts: float
  expert_slots: float
  attention: float
  attention_full: float
  head: float


def block_matmul_params(cfg: ModelConfig) -> int:
  """The matmul parameters one token passes through in one block.

  Attention's projections (q, k, v, o) and the MLP's three matrices, times
  top_k for an MoE model (its router left out). `jaxpipe.config.vocab_parallel`
  weighs a stage's blocks by it against the output layer's dim x vocab.
  """
  head_dim = cfg.dim // cfg.n_heads
  attn = cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
  hidden = cfg.moe.ffn_dim or ffn_dim(cfg) if cfg.moe.num_experts else ffn_dim(cfg)
  return attn + 3 * cfg.dim * hidden * (cfg.moe.top_k if cfg.moe.num_experts else 1)


def token_flops(cfg: ModelConfig, seq_len: int) -> TokenFlops:
  """The forward FLOPs of one token, part by part (see `TokenFlops`)."""
  head_dim = cfg.dim // cfg.n_heads
  attn_proj = cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
  experts = slots = 0.0
  if cfg.moe.num_experts:
    hidden = cfg.moe.ffn_dim or ffn_dim(cfg)
    mlp = cfg.dim * cfg.moe.num_experts  # the router
    one = 2.0 * cfg.n_layers * 3 * cfg.dim * hidden  # one expert's matmuls for one token
    experts = one * cfg.moe.top_k
    # Every expert runs over all its slots of every sequence, per token of it.
    slots = one * cfg.moe.num_experts * _moe.capacity(cfg, seq_len) / seq_len
  else:
    mlp = 3 * cfg.dim * ffn_dim(cfg)
  # Query heads times head size: the width the scores are computed over.
  width = cfg.n_heads * head_dim
  full = 4.0 * cfg.n_layers * width * seq_len
  return TokenFlops(dense=2.0 * cfg.n_layers * (attn_proj + mlp), experts=experts,
                    expert_slots=slots, attention=full / 2, attention_full=full,
                    head=2.0 * cfg.dim * cfg.vocab_size)


def flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
  """Model FLOPs of one training token (forward and backward): what MFU divides by.

  3 x the forward of `token_flops`: 6 x the matmul parameters a token passes
  through (attention projections, the MLP or its top_k experts and router,
  the output head) plus attention's scores and weighted values. With
  `causal` (the default) attention counts half of the [T, T] products, 6 x
  layers x width x T, as a causal kernel computes; `causal=False` counts
  all of them, 12 x layers x width x T (PaLM's convention; peers differ, so
  tools print both). Rematerialisation and the pipeline's recomputation are
  not counted: MFU measures useful work (`jaxpipe.accel.step_flops` counts
  what the hardware does).
  """
  f = token_flops(cfg, seq_len)
  return 3.0 * (f.dense + f.experts + f.head + (f.attention if causal else f.attention_full))
