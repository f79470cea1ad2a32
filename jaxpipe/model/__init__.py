"""A Llama-style decoder as pure functions over a stacked-block parameter tree."""

from jaxpipe.model._attention import blockwise_attention
from jaxpipe.model._llama import (Block, Model, build, cross_entropy, dtype_of, ffn_dim,
                                  flops_per_token, num_params, rotary)
from jaxpipe.model._moe import MoE, capacity

__all__ = ["Block", "Model", "MoE", "blockwise_attention", "build", "capacity", "cross_entropy",
           "dtype_of", "ffn_dim", "flops_per_token", "num_params", "rotary"]
