"""What a value inside `jax.shard_map` varies over, read from its type on every JAX we support.

Inside `shard_map` each value's type says which mesh axes it varies over
(JAX 0.10 calls it `manual_axis_type.varying`, JAX 0.11 `vma`). The
pipeline marks its carries with it, and a custom derivative must give each
input a cotangent of the input's own type: `match_varying` makes operands
that vary over different axes vary alike before such a function, and JAX's
own transpose of that cast sums the cotangent over the axes it added.
Outside `shard_map` every value varies over nothing and both are no-ops.
"""

from __future__ import annotations

import jax
from jax import lax

__all__ = ["varying_axes", "match_varying"]


def varying_axes(x) -> frozenset:
  """The mesh axes a value inside `shard_map` varies over (its type, not its data)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def match_varying(*xs: jax.Array) -> tuple[jax.Array, ...]:
  """The arrays, each cast to vary over every axis any of them varies over."""
  union = frozenset().union(*(varying_axes(x) for x in xs))
  out = []
  for x in xs:
    missing = tuple(sorted(union - varying_axes(x)))
    out.append(lax.pcast(x, missing, to="varying") if missing else x)
  return tuple(out)
