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
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpipe.model._config import ModelConfig


# The parameters stacked along the expert axis: {name: {'kernel': [experts, ...]}}.
EXPERT_MATRICES = ("gate", "up", "down")


def capacity(cfg: ModelConfig, seq_len: int) -> int:
  """Expert slots per sequence: ceil(capacity_factor * seq_len * top_k / experts)."""
  m = cfg.moe
  return max(1, math.ceil(m.capacity_factor * seq_len * m.top_k / m.num_experts))


class _Kernel(nn.Module):
  """Holds one weight as `{name: {'kernel': ...}}`, like nn.Dense would."""
  shape: tuple[int, ...]
  initializer: nn.initializers.Initializer
  param_dtype: jnp.dtype

  sliced: bool = False  # may hold a slice of its leading (expert) axis; see MoE

  @nn.compact
  def __call__(self):
    # flax checks a given parameter's shape against the initializer's; an
    # expert-parallel device is given E/n of the experts, so that check is
    # skipped for the expert matrices (MoE checks the count it gets).
    if self.sliced and self.has_variable("params", "kernel"):
      w = self.get_variable("params", "kernel")
      if w.shape[1:] != self.shape[1:] or not w.shape[0] or self.shape[0] % w.shape[0]:
        raise ValueError(f"MoE kernel {self.name}: expected {self.shape} or a slice of its "
                         f"experts, got {w.shape}")
      return w
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

  Dispatch is by index: each expert slot gathers the one token that fills it
  (an empty slot reads a zero row) and each token gathers its kept slots'
  outputs, so moving tokens costs O(slots x dim), not the
  O(tokens x slots x dim) of one-hot einsums.

  Expert parallelism: when the expert weights this layer is given hold fewer
  experts than `cfg.moe.num_experts` (inside `shard_map`, a slice of E/n
  consecutive experts on each of n devices), every device routes its own
  sequences, sends each expert's slots to the device that holds the expert
  and gets the outputs back, both through `exchange`. The layer knows no
  mesh: `exchange` is the caller's, a function of [n, ...] arrays that sends
  index j to device j and puts what device j sent at index j (an
  all-to-all, e.g. `jaxpipe.pipeline.expert_exchange`). The function of each
  sequence is unchanged.
  """
  cfg: ModelConfig
  exchange: Optional[Callable[[jax.Array], jax.Array]] = None

  @nn.compact
  def __call__(self, x):
    cfg, m = self.cfg, self.cfg.moe
    # JAX's names are the config's (`DTYPE_NAMES`, checked by the config).
    compute, param = jnp.dtype(cfg.compute_dtype), jnp.dtype(cfg.param_dtype)
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
    # Slot index in [0, e*c) of each kept choice; e*c (out of range) if dropped.
    where = jnp.where(kept, expert * c + slot, e * c).reshape(b, t * k)
    token = jnp.broadcast_to(jnp.arange(t * k, dtype=jnp.int32) // k, (b, t * k))
    # The token each slot holds, t (the zero row below) where a slot is empty.
    source = jax.vmap(lambda w, s: jnp.full((e * c,), t, jnp.int32).at[w].set(s, mode="drop"))(
        where, token)
    padded = jnp.concatenate([x.astype(compute), jnp.zeros((b, 1, d), compute)], axis=1)
    xe = jnp.take_along_axis(padded, source[..., None], axis=1)   # [b, e*c, d]

    init = nn.initializers.normal(cfg.init_std)
    init_out = nn.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.n_layers))
    w_gate = _Kernel((e, d, hidden), init, param, True, name="gate")().astype(compute)
    w_up = _Kernel((e, d, hidden), init, param, True, name="up")().astype(compute)
    w_down = _Kernel((e, hidden, d), init_out, param, True, name="down")().astype(compute)

    # _Kernel has checked that the local count divides e.
    local = w_gate.shape[0]
    n = e // local
    if n > 1 and self.exchange is None:
      raise ValueError(f"MoE: the layer holds {local} of {e} experts and has no exchange to "
                       "send tokens to the others")
    # [n, b, E/n, c, d]: the slots of the experts device j holds, at index j.
    xe = xe.reshape(b, n, local, c, d).swapaxes(0, 1)
    if n > 1:
      xe = self.exchange(xe)                                      # index j: device j's tokens
    h = nn.silu(jnp.einsum("nbecd,edh->nbech", xe, w_gate)) * jnp.einsum("nbecd,edh->nbech",
                                                                         xe, w_up)
    ye = jnp.einsum("nbech,ehd->nbecd", h, w_down)
    if n > 1:
      ye = self.exchange(ye)                                      # back: index j, expert group j
    ye = ye.swapaxes(0, 1).reshape(b, e * c, d)

    # Each token's kept outputs, weighted by its gates (in float32); a dropped
    # choice reads the zero row and weighs 0.
    ye = jnp.concatenate([ye, jnp.zeros((b, 1, d), ye.dtype)], axis=1)
    yk = jnp.take_along_axis(ye, where[..., None], axis=1).reshape(b, t, k, d)
    weight = jnp.where(kept, gate, 0.0)[..., None]
    y = jnp.sum(yk.astype(jnp.float32) * weight, axis=2)

    share = jnp.mean(jnp.sum(choice, axis=2).astype(jnp.float32), axis=1) / k
    balance = e * jnp.sum(share * jnp.mean(probs, axis=1), axis=-1)  # [b]
    return y.astype(x.dtype), m.aux_loss_coeff * jnp.mean(balance)
