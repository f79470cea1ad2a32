"""AdamW, Lion and SGD, and the pieces every optimizer here shares.

Each factory wraps optax's own transforms. What they add is the grouping of
`_grouping` (no weight decay on norms and biases; Muon only on hidden
matrices, stacked or not). The shared pieces: `with_adamw` (a matrix
optimizer beside an AdamW group, as Muon, NorMuon, MARS and SOAP are built),
`checked_labels`, the dtype guard `dtype_stable`, and the matrix-shape rules
(`dims_fn_of`, `fans`, `scale_by_shape`) by which stacked layers and experts
are treated matrix by matrix. Muon itself is in `_muon`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from jaxpipe.optim import _grouping

__all__ = ["adamw", "lion", "sgd"]

# Last two axes are (in, out) as in flax kernels; leading axes are batch axes.
_MATRIX_DIMS = MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)

Mask = Any | Callable[[optax.Params], Any]
ScalarOrSchedule = float | jax.Array | optax.Schedule


def dtype_stable(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Returns updates in the gradients' dtypes and state in its init dtypes.

  optax's moment updates promote a bf16 leaf to float32 when a hyperparameter
  arrives as a float32 array, which `optax.inject_hyperparams` does for trees
  of mixed dtypes. A state whose dtypes drift breaks `lax.cond` (as in
  `delay` and `optax.MultiSteps`) and scan carries, so cast back.
  """

  inner = optax.with_extra_args_support(inner)

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, new_state = inner.update(updates, state, params, **extra_args)
    new_updates = jax.tree.map(
        lambda u, g: u.astype(g.dtype), new_updates, updates)
    new_state = jax.tree.map(
        lambda new, old: new.astype(old.dtype), new_state, state)
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def mask_or_default(mask: Mask | None) -> Mask:
  """The weight-decay mask given, or the house's (no decay on norms and biases) for None."""
  return _grouping.weight_decay_mask if mask is None else mask


def wrap_axes(ndim: int, axes: int | Sequence[int]) -> tuple[int, ...]:
  """`axes` (one or several, negative allowed) as non-negative axes of a rank-`ndim` array."""
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return tuple(a % ndim for a in axes)


def fans(
    shape: tuple[int, ...], dims: MuonDimensionNumbers,
) -> tuple[int, int]:
  """(fan in, fan out) of a matrix-like leaf: its reduction and output axes' sizes multiplied."""
  fan_in = math.prod(shape[a] for a in wrap_axes(len(shape), dims.reduction_axis))
  fan_out = math.prod(shape[a] for a in wrap_axes(len(shape), dims.output_axis))
  return fan_in, fan_out


def dims_fn_of(dimension_numbers: Any) -> Callable[[Any], Any]:
  """A params -> per-leaf `MuonDimensionNumbers` rule from a rule, one value, or None (matrices)."""
  if dimension_numbers is None:
    dimension_numbers = _MATRIX_DIMS
  if callable(dimension_numbers):
    return dimension_numbers
  # The Muon branch of `optax.partition` sees the other branch's leaves as
  # `optax.MaskedNode`s, which have no leaves; tree.map keeps them as they are.
  return lambda tree: jax.tree.map(lambda _: dimension_numbers, tree)


def scale_by_shape(
    dims_fn: Callable[[Any], Any], consistent_rms: float | jax.Array | None,
) -> optax.GradientTransformation:
  """Multiplies each orthogonalised update by a factor from its matrix shape."""

  def scale(u, dims):
    fan_in, fan_out = fans(u.shape, dims)
    if consistent_rms is None:
      factor = math.sqrt(max(1.0, fan_out / fan_in))
    else:
      factor = consistent_rms * math.sqrt(max(fan_in, fan_out))
    return u * jnp.asarray(factor, u.dtype)

  def update_fn(updates, state, params=None):
    del params
    dims = dims_fn(updates)
    is_dims = lambda x: isinstance(x, MuonDimensionNumbers)
    return jax.tree.map(scale, updates, dims, is_leaf=is_dims), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def checked_labels(
    labels: Any, *, main: str = "muon",
    default: Callable[[Any], Any] = _grouping.param_labels,
) -> Callable[[Any], Any]:
  """Resolves a label tree or rule, refusing labels that no group serves."""
  labels = default if labels is None else labels

  def resolved(params):
    tree = _grouping.resolve(labels, params)

    def check(path, label, p):
      if label not in (main, "adam"):
        raise ValueError(f"param label {label!r} at "
                         f"{jax.tree_util.keystr(path)} is neither "
                         f"{main!r} nor 'adam'")
      if label == "muon" and p.ndim < 2:
        # Caught here, with the leaf's path, rather than as a reshape error
        # deep inside optax's Newton-Schulz.
        raise ValueError(f"Muon needs a matrix (or a stack of matrices) at "
                         f"{jax.tree_util.keystr(path)}, got shape {p.shape}")

    jax.tree_util.tree_map_with_path(check, tree, params)
    return tree

  return resolved


def with_adamw(
    main: optax.GradientTransformation,
    labels: Callable[[Any], Any],
    *,
    main_label: str,
    learning_rate: ScalarOrSchedule,
    adam_learning_rate: ScalarOrSchedule | None,
    b1: float | jax.Array,
    b2: float | jax.Array,
    eps: float | jax.Array,
    mu_dtype: Any | None,
    weight_decay: float | jax.Array,
    weight_decay_mask: Mask | None,
) -> optax.GradientTransformationExtraArgs:
  """`main` on leaves labelled `main_label`, Adam's direction on `'adam'` ones.

  Then the masked decoupled decay and each group's learning rate, so both
  groups are `W -= eta_group (direction + lambda W)`.
  """
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate
  direction = optax.partition(
      {
          main_label: main,
          "adam": optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype),
      },
      labels)
  step_size = optax.partition(
      {
          main_label: optax.scale_by_learning_rate(learning_rate),
          "adam": optax.scale_by_learning_rate(adam_learning_rate),
      },
      labels)
  return dtype_stable(optax.chain(
      direction,
      optax.add_decayed_weights(
          weight_decay, mask_or_default(weight_decay_mask)),
      step_size,
  ))


def adamw(
    learning_rate: ScalarOrSchedule,
    *,
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-8,
    weight_decay: float | jax.Array = 0.1,
    mu_dtype: Any | None = None,
    nesterov: bool = False,
    weight_decay_mask: Mask | None = None,
) -> optax.GradientTransformation:
  r"""AdamW with jaxpipe's decay mask (no decay on norms and biases).

  Update rule: `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g^2`, and
  `W -= eta (m_hat / (sqrt(v_hat) + eps) + lambda W)` with bias-corrected
  m_hat, v_hat; lambda applies where `weight_decay_mask` is true (default
  `jaxpipe.optim.weight_decay_mask`). This is `optax.adamw` with that mask and
  language-model defaults (b2 = 0.95, weight decay 0.1).

  State: optax's `(ScaleByAdamState, mask state, learning-rate state)`.
  Memory: two parameter-sized moments (the first in `mu_dtype`).

  In the paper AdamW is the optimizer most hurt by a one-step gradient delay;
  `error_feedback` recovers part of the gap.

  Args:
    learning_rate: a scalar or an `optax.Schedule`.
    b1: first-moment decay.
    b2: second-moment decay.
    eps: added to the denominator.
    weight_decay: decoupled decay, multiplied by the learning rate.
    mu_dtype: dtype of the first moment; None = the params'.
    nesterov: Nesterov-style (NAdamW) first moment.
    weight_decay_mask: a pytree of bools or a function of the params.

  Returns:
    An `optax.GradientTransformation`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpipe import optim
    >>> tx = optim.adamw(3e-3)
    >>> state = tx.init({'kernel': jnp.ones((2, 2)), 'bias': jnp.ones(2)})

  References:
    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026

    Loshchilov and Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019
  """
  return dtype_stable(optax.adamw(
      learning_rate, b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype,
      weight_decay=weight_decay, mask=mask_or_default(weight_decay_mask),
      nesterov=nesterov))


def lion(
    learning_rate: ScalarOrSchedule,
    *,
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.99,
    weight_decay: float | jax.Array = 0.1,
    mu_dtype: Any | None = None,
    weight_decay_mask: Mask | None = None,
) -> optax.GradientTransformation:
  r"""Lion with jaxpipe's decay mask (no decay on norms and biases).

  Update rule: `c = b1 m + (1-b1) g`, `W -= eta (sign(c) + lambda W)`,
  `m = b2 m + (1-b2) g`. Every coordinate moves by eta, so Lion wants a rate
  3-10x below AdamW's and a decay 3-10x above it (Chen et al. 2023) to keep
  eta * lambda the same. This is `optax.lion` with the mask.

  State: optax's `(ScaleByLionState, mask state, learning-rate state)`.
  Memory: one parameter-sized momentum (in `mu_dtype`).

  Args:
    learning_rate: a scalar or an `optax.Schedule`.
    b1: interpolation of the update direction.
    b2: momentum decay.
    weight_decay: decoupled decay, multiplied by the learning rate.
    mu_dtype: dtype of the momentum; None = the params'.
    weight_decay_mask: a pytree of bools or a function of the params.

  Returns:
    An `optax.GradientTransformation`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpipe import optim
    >>> tx = optim.lion(3e-4, weight_decay=1.0)
    >>> state = tx.init({'kernel': jnp.ones((2, 2))})

  References:
    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026

    Chen et al., `Symbolic Discovery of Optimization Algorithms
    <https://arxiv.org/abs/2302.06675>`_, 2023
  """
  return dtype_stable(optax.lion(
      learning_rate, b1=b1, b2=b2, mu_dtype=mu_dtype, weight_decay=weight_decay,
      mask=mask_or_default(weight_decay_mask)))


def sgd(
    learning_rate: ScalarOrSchedule,
    *,
    momentum: float | jax.Array | None = 0.9,
    nesterov: bool = False,
    weight_decay: float | jax.Array = 0.0,
    accumulator_dtype: Any | None = None,
    weight_decay_mask: Mask | None = None,
) -> optax.GradientTransformation:
  r"""SGD with heavy-ball momentum and decoupled, masked weight decay.

  Update rule: `m = momentum m + g` (Nesterov: the step uses
  `g + momentum m`), `W -= eta (m + lambda W)`; decay is added after the
  momentum, as in AdamW, and skips norms and biases.

  State: `(TraceState, mask state, learning-rate state)`. Memory: one
  parameter-sized momentum (none with `momentum=None`).

  Args:
    learning_rate: a scalar or an `optax.Schedule`.
    momentum: the momentum decay; None for plain SGD.
    nesterov: Nesterov momentum.
    weight_decay: decoupled decay, multiplied by the learning rate.
    accumulator_dtype: dtype of the momentum; None = the params'.
    weight_decay_mask: a pytree of bools or a function of the params.

  Returns:
    An `optax.GradientTransformation`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpipe import optim
    >>> tx = optim.sgd(0.1, momentum=0.9)
    >>> state = tx.init({'kernel': jnp.ones((2, 2))})

  References:
    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026
  """
  return dtype_stable(optax.chain(
      (optax.trace(decay=momentum, nesterov=nesterov,
                   accumulator_dtype=accumulator_dtype)
       if momentum is not None else optax.identity()),
      optax.add_decayed_weights(
          weight_decay, mask_or_default(weight_decay_mask)),
      optax.scale_by_learning_rate(learning_rate),
  ))
