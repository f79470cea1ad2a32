"""A Mixture-of-Experts SwiGLU layer: top-k routing with a capacity per sequence.

Each sequence is its own routing group: expert capacity, token dropping and the
load-balancing loss are computed per sequence. The layer's output for a
sequence therefore does not depend on which other sequences share its
microbatch or its data-parallel shard, so every pipeline schedule and mesh
computes the same function as the one-device reference.

Expert weights are stacked along an expert axis ([experts, dim, hidden]), so
Muon, which treats leading axes as batch axes, orthogonalises each expert's
matrices on its own.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpipe.model._config import ModelConfig


def capacity(cfg: ModelConfig, seq_len: int) -> int:
  """Expert slots per sequence: ceil(capacity_factor * seq_len * top_k / experts)."""
  m = cfg.moe
  return max(1, math.ceil(m.capacity_factor * seq_len * m.top_k / m.num_experts))


class _Kernel(nn.Module):
  """Holds one weight as `{name: {'kernel': ...}}`, like nn.Dense would."""
  shape: tuple[int, ...]
  initializer: nn.initializers.Initializer
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self):
    return self.param("kernel", self.initializer, self.shape, self.param_dtype)


class MoE(nn.Module):
  """Top-k routed SwiGLU experts; returns (output, weighted load-balancing loss).

  Routing (float32): router probabilities p = softmax(x W_r); each token picks
  its top_k experts and their probabilities, renormalised to sum to one. Slots
  in an expert are filled in token order (so routing is causal); tokens past
  an expert's capacity are dropped for that expert (their residual stream
  passes through). The load-balancing loss is the Switch Transformer's
  E * sum_e f_e * P_e, where f_e is the share of routed assignments that chose
  expert e and P_e the mean router probability of e, times aux_loss_coeff.
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg, m = self.cfg, self.cfg.moe
    cd = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    compute, param = cd[cfg.compute_dtype], cd[cfg.param_dtype]
    e, k = m.num_experts, m.top_k
    hidden = m.ffn_dim or cfg.ffn_dim or 32 * math.ceil(8 * cfg.dim / 3 / 32)
    b, t, d = x.shape
    c = capacity(cfg, t)

    router = _Kernel((d, e), nn.initializers.normal(cfg.init_std), param, name="router")()
    logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    gate, expert = jax.lax.top_k(probs, k)                        # [b, t, k]
    gate = gate / jnp.sum(gate, axis=-1, keepdims=True)

    # Slot of each (token, choice) in its expert, filled in position order
    # (a token's choices by rank): a token's routing then depends only on the
    # tokens before it, so the decoder stays causal. Filling all first choices
    # before any second choice would let a later token evict an earlier
    # token's second choice, leaking the future into the past.
    choice = jax.nn.one_hot(expert, e, dtype=jnp.int32)           # [b, t, k, e]
    flat = choice.reshape(b, t * k, e)
    position = (jnp.cumsum(flat, axis=1) - flat).reshape(b, t, k, e)
    slot = jnp.sum(position * choice, axis=-1)                     # [b, t, k]
    kept = slot < c
    dispatch = (jax.nn.one_hot(expert, e, dtype=jnp.float32)[..., None]
                * jax.nn.one_hot(jnp.where(kept, slot, c), c, dtype=jnp.float32)[..., None, :])
    combine = jnp.sum(dispatch * gate[..., None, None], axis=2)   # [b, t, e, c]
    dispatch = jnp.sum(dispatch, axis=2)                          # [b, t, e, c]

    init = nn.initializers.normal(cfg.init_std)
    init_out = nn.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.n_layers))
    w_gate = _Kernel((e, d, hidden), init, param, name="gate")().astype(compute)
    w_up = _Kernel((e, d, hidden), init, param, name="up")().astype(compute)
    w_down = _Kernel((e, hidden, d), init_out, param, name="down")().astype(compute)

    xe = jnp.einsum("btec,btd->becd", dispatch.astype(compute), x.astype(compute))
    h = nn.silu(jnp.einsum("becd,edh->bech", xe, w_gate)) * jnp.einsum("becd,edh->bech", xe, w_up)
    ye = jnp.einsum("bech,ehd->becd", h, w_down)
    y = jnp.einsum("btec,becd->btd", combine.astype(compute), ye)

    share = jnp.mean(jnp.sum(jax.nn.one_hot(expert, e, dtype=jnp.float32), axis=2), axis=1) / k
    balance = e * jnp.sum(share * jnp.mean(probs, axis=1), axis=-1)  # [b]
    return y.astype(x.dtype), m.aux_loss_coeff * jnp.mean(balance)
