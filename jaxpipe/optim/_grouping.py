"""Which parameters are hidden matrices: the rule for Muon and weight decay.

A parameter tree is classified leaf by leaf from its path (the dict keys or
attribute names that lead to it) and its shape:

1. A *vector*: a norm's scale or offset, or a bias. The leaf has fewer than two
   axes, or its last key is one of `VECTOR_NAMES` (`scale`, `bias`, ...), or a
   key on its path names a norm (contains `norm`, or is `ln` / starts `ln_`).
   Stacked norms and biases ([L, D], [L, F]) are vectors too: the names decide.
2. An *embedding or head*: some key on its path is one of `EMBEDDING_NAMES` or
   `HEAD_NAMES`, or has a `_`-separated word that is an embedding word
   (`embed_tokens`, `pos_embedding`). These matrices are lookup tables and
   classifiers rather than linear maps between hidden features, so
   orthogonalising them is not what Muon was designed for.
3. A *router*: some key is one of `ROUTER_NAMES`. A MoE router [D, E] has few
   columns and acts as a classifier over experts; AdamW is the usual choice.
4. Everything else with at least two axes is a *hidden matrix*. Its last two
   axes are (in, out), as in flax `kernel`s; leading axes are batch axes, so a
   stack of layers [L, D, F] or experts [L, E, D, F] is a stack of matrices.

Keys are compared in lower case with a trailing flax index removed, so
`Embed_0`, `LayerNorm_3` and `Dense_1` read as `embed`, `layernorm`, `dense`.
Whole keys are compared (not substrings), so `MultiHeadAttention` is not a
head.

Kernels whose input or output spans several axes (flax `DenseGeneral`, e.g. the
[D, H, hd] kernels of `nn.MultiHeadDotProductAttention`) cannot be told apart
from a stack of matrices by shape; pass `dimension_numbers` to `muon`, or your
own `param_labels`, for those.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax

__all__ = [
    "EMBEDDING_NAMES", "HEAD_NAMES", "ROUTER_NAMES", "VECTOR_NAMES",
    "param_kinds", "param_labels", "weight_decay_mask",
]

EMBEDDING_NAMES = (
    "embed", "embedding", "embeddings", "embedder", "wte", "wpe",
    "tok_embeddings", "token_embedding", "pos_embedding",
)
HEAD_NAMES = ("head", "lm_head", "output", "logits", "unembed", "out_head")
ROUTER_NAMES = ("router",)
VECTOR_NAMES = ("scale", "bias", "offset", "gamma", "beta")

_EMBEDDING_WORDS = frozenset({"embed", "embedding", "embeddings", "embeds"})
_FLAX_INDEX = re.compile(r"_\d+$")

# The four kinds a leaf can be.
MATRIX, EMBEDDING, HEAD, ROUTER, VECTOR = (
    "matrix", "embedding", "head", "router", "vector")


def _key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _normalise(name: str) -> str:
  return _FLAX_INDEX.sub("", name.lower())


def _is_norm(name: str) -> bool:
  return "norm" in name or name == "ln" or name.startswith("ln_")


def _kind(path: Sequence[Any], leaf: Any) -> str:
  names = [_normalise(_key_name(k)) for k in path]
  ndim = len(getattr(leaf, "shape", ()))
  if (ndim < 2 or (names and names[-1] in VECTOR_NAMES)
      or any(_is_norm(n) for n in names)):
    return VECTOR
  for n in names:
    if n in EMBEDDING_NAMES or _EMBEDDING_WORDS & set(n.split("_")):
      return EMBEDDING
  if any(n in HEAD_NAMES for n in names):
    return HEAD
  if any(n in ROUTER_NAMES for n in names):
    return ROUTER
  return MATRIX


def param_kinds(params: Any) -> Any:
  """Classifies every leaf as `matrix`, `embedding`, `head`, `router`, `vector`.

  The rule is the one in this module's docstring; `param_labels` and
  `weight_decay_mask` are both derived from it.

  Args:
    params: a pytree of arrays (or of `jax.ShapeDtypeStruct`s; only paths and
      shapes are read). Leaves that are `optax.MaskedNode`s are kept as they
      are, so the rule also works inside `optax.partition`.

  Returns:
    A pytree of strings with the structure of `params`.
  """
  return jax.tree_util.tree_map_with_path(_kind, params)


def param_labels(params: Any) -> Any:
  """Labels each leaf `'muon'` (hidden matrices) or `'adam'` (all others).

  Hidden matrices, stacked or not, go to Muon. Embeddings, output heads, MoE
  routers, norms and biases go to AdamW. On jaxpipe's own tree this gives Muon
  for `blocks/{attn,mlp,moe}/*/kernel` except `moe/router`, and AdamW for
  `embed/embedding`, `head/out/kernel` and every `*_norm/scale`. On a flax
  linen tree it gives Muon for `Dense_*/kernel` (also when `nn.scan` stacks
  them) and AdamW for `Embed_*/embedding` and all biases.

  To override the rule, pass your own function (or a label tree) as
  `param_labels=` to `jaxpipe.optim.muon`, e.g. one that calls this function
  and then edits the result.

  Args:
    params: a pytree of arrays or `jax.ShapeDtypeStruct`s.

  Returns:
    A pytree of `'muon'` / `'adam'` with the structure of `params`.

  References:
    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026 (Muon on hidden matrices,
    AdamW on embeddings, head, norms and biases).
  """
  return jax.tree.map(
      lambda kind: "muon" if kind == MATRIX else "adam", param_kinds(params))


def weight_decay_mask(params: Any) -> Any:
  """True for leaves that get decoupled weight decay: every matrix.

  Hidden matrices, embeddings, output heads and routers are decayed; norms'
  scales and biases (the `vector` kind, stacked or not) are not. Decaying the
  embedding follows GPT-2/nanoGPT and Llama practice; pass your own mask to
  exclude it.

  Args:
    params: a pytree of arrays or `jax.ShapeDtypeStruct`s.

  Returns:
    A pytree of bools with the structure of `params`.
  """
  return jax.tree.map(lambda kind: kind != VECTOR, param_kinds(params))


def resolve(tree_or_fn: Any | Callable[[Any], Any], params: Any) -> Any:
  """Calls `tree_or_fn` on `params` if it is callable, else returns it."""
  return tree_or_fn(params) if callable(tree_or_fn) else tree_or_fn
