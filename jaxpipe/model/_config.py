"""The model's config section: `ModelConfig` (`model:` in a run's YAML) and its MoE part.

Plain dataclasses, no JAX: `jaxpipe.config` composes them with the other
sections (its `validate` calls this module's on the `model` section), and the
model builds from them.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from jaxpipe.errors import check_config as _check

__all__ = ["ModelConfig", "MoEConfig", "DtypeName", "RematPolicy", "AttentionSetting",
           "DTYPE_NAMES", "REMAT_POLICIES", "ATTENTION_SETTINGS", "validate"]

# The floating dtypes weights and activations may take, by JAX's names.
DtypeName = Literal["float32", "bfloat16", "float16"]
# What a block's backward recomputes: nothing kept but its input (full), or all but the matmuls (dots).
RematPolicy = Literal["none", "full", "dots"]
# The attention implementations `jaxpipe.model.select_attention` chooses among.
AttentionSetting = Literal["auto", "xla", "blockwise", "cudnn"]

DTYPE_NAMES: tuple[str, ...] = typing.get_args(DtypeName)
REMAT_POLICIES: tuple[str, ...] = typing.get_args(RematPolicy)
ATTENTION_SETTINGS: tuple[str, ...] = typing.get_args(AttentionSetting)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 0           # 0 = dense SwiGLU MLP in every block
  top_k: int = 2                 # experts per token
  capacity_factor: float = 1.25  # expert slots = capacity_factor * tokens * top_k / num_experts
  aux_loss_coeff: float = 0.01   # weight of the load-balancing loss
  ffn_dim: int = 0               # hidden size of one expert; 0 = model.ffn_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 0            # 0 = take it from the tokenizer
  dim: int = 64                  # residual width
  n_layers: int = 4              # transformer blocks, stacked along a leading axis
  n_heads: int = 4               # query heads
  n_kv_heads: int = 2            # key/value heads (grouped-query attention)
  ffn_dim: int = 0               # SwiGLU hidden size; 0 = 8/3 * dim rounded up to 32
  tie_embeddings: bool = False   # share the input embedding with the output head
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  init_std: float = 0.02
  remat: RematPolicy = "none"            # inside each block: none | full (recompute all) | dots (keep matmul outputs)
  param_dtype: DtypeName = "float32"   # master weights and optimizer state
  compute_dtype: DtypeName = "float32" # matmuls and activations (bfloat16 on accelerators)
  # xla keeps [batch, heads, seq, seq]
  # probabilities for the backward; blockwise and cudnn (NVIDIA GPUs, bf16/fp16)
  # keep memory linear in seq; auto = cudnn where it runs, else blockwise above
  # 1024 tokens, else xla (jaxpipe/model/_attention.py).
  attention: AttentionSetting = "auto"
  # Tokens whose float32 logits the head and loss compute at once; the
  # backward recomputes each chunk's. 0 = a whole microbatch's at once
  # (rows x seq x vocab x 4 bytes, kept for the backward).
  loss_chunk: int = 0
  # A Hugging Face Llama directory (config.json, model.safetensors) whose weights
  # a fresh run starts from instead of a random init; the model.* keys must
  # match its shape (docs/huggingface.md). A resumed run reads its own
  # checkpoint and never this directory again.
  init_from: str = ""
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)


def validate(m: ModelConfig) -> None:
  """Checks model.*: sizes, the head arithmetic, the MoE part; raises ConfigError.

  Each choice (remat, attention, the dtypes) is a `Literal`, checked where
  the config is read.
  """
  for key in ("dim", "n_layers", "n_heads", "n_kv_heads"):
    _check(getattr(m, key) >= 1, f"model.{key} must be >= 1, got {getattr(m, key)}")
  _check(m.dim % m.n_heads == 0,
         f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}")
  _check((m.dim // m.n_heads) % 2 == 0,
         f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even for rotary embeddings")
  _check(m.n_heads % m.n_kv_heads == 0,
         f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}")
  _check(m.loss_chunk >= 0, f"model.loss_chunk must be >= 0 (0 = no chunking), got {m.loss_chunk}")
  if m.moe.num_experts:
    _check(1 <= m.moe.top_k <= m.moe.num_experts,
           f"model.moe.top_k={m.moe.top_k} must be between 1 and model.moe.num_experts={m.moe.num_experts}")
    _check(m.moe.capacity_factor > 0, "model.moe.capacity_factor must be > 0")
