"""A Llama-style decoder as pure functions over a stacked-block parameter tree.

Its config section (`ModelConfig`) is plain dataclasses and loads without
JAX; the model itself (flax) loads on first use of a name below.
"""

import importlib

_LAZY = {
    "blockwise_attention": "_attention", "resolve_attention": "_attention",
    "select_attention": "_attention", "attention_backend": "_attention",
    "cudnn_attention": "_attention",
    "Block": "_llama", "KVCache": "_llama", "Model": "_llama", "make_model": "_llama",
    "cross_entropy": "_llama", "output_logits": "_llama",
    "dtype_of": "_llama", "ffn_dim": "_llama", "flops_per_token": "_llama",
    "token_flops": "_llama", "TokenFlops": "_llama", "block_matmul_params": "_llama",
    "num_params": "_llama", "rotary": "_llama",
    "MoE": "_moe", "capacity": "_moe",
    "ModelConfig": "_config", "MoEConfig": "_config", "DtypeName": "_config",
    "RematPolicy": "_config", "AttentionSetting": "_config", "DTYPE_NAMES": "_config",
    "REMAT_POLICIES": "_config", "ATTENTION_SETTINGS": "_config", "validate": "_config",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(f"jaxpipe.model.{_LAZY[name]}"), name)
  raise AttributeError(f"module 'jaxpipe.model' has no attribute {name!r}")
