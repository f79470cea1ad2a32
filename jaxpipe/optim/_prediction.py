"""Weight prediction: take the delayed gradient where the weights will be."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["PredictionState", "predicted_params", "weight_prediction"]


class PredictionState(NamedTuple):
  """State of `weight_prediction`.

  Attributes:
    horizon: the extrapolation factor s (a float32 scalar), kept here so
      that `predicted_params` needs nothing but the state.
    prev_update: the update the wrapper returned last, i.e. the one applied
      to the params (zeros before the first call).
    inner_state: the wrapped optimizer's state.
  """
  horizon: jax.Array
  prev_update: optax.Updates
  inner_state: optax.OptState


def weight_prediction(
    inner: optax.GradientTransformation,
    steps: float | jax.Array = 1.0,
    *,
    buffer_dtype: Any | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Remembers the applied update, so the next gradient is taken ahead.

  A pair with `predicted_params`: this wrapper leaves `inner`'s updates
  unchanged and keeps the last one; `predicted_params(params, state)` gives
  the weights the next forward and backward should run on,

  .. math::
    \hat w[k] = w[k] + s\, u[k-1] = w[k] + s\,(w[k] - w[k-1]),

  a linear extrapolation of the trajectory s updates ahead (PipeMare's and
  SpecTrain's weight prediction, with the last update as the velocity).

  Why it corrects a one-step delay: PipeDream-2BW applies
  `w[k+1] = w[k] + U(g[k-1])`. Plainly g[k-1] is taken at w[k-1], which is
  u[k-1] away from the w[k] it is applied to. Predicted, it is taken at
  `w_hat[k-1] = w[k-1] + s u[k-2]`, which is `s u[k-2] - u[k-1]` away:
  with s = 1 only the change between consecutive updates, a second-order
  distance where the plain delay's is first-order.

  One-device simulation of 2BW with prediction (exact, as `delay` is for
  plain 2BW): the forward runs on `predicted_params(w, state)`, the update is
  applied to w:

  .. code-block:: python

    tx = optim.delay(optim.weight_prediction(inner))
    g = jax.grad(loss)(optim.predicted_params(w, state), batch)
    u, state = tx.update(g, state, w)      # decay acts on w, not w_hat
    w = optax.apply_updates(w, u)

  Place the wrapper where its output is the update that is applied: outside
  `error_feedback`, `clip` and the optimizer; inside or outside `delay`
  makes no difference (inside, the delay's zero updates never reach it and
  its buffer stays zero, which is what was applied).

  How it differs from `error_feedback`: error feedback changes the applied
  update, `(1 + c) v[t] - c v[t-1]`, and takes gradients at the weights as
  they are; its shadow iterate follows the plain rule, and the real weights
  run ahead of it. Prediction applies the optimizer's updates unchanged and
  moves only the point where the gradient is taken, so the weights follow
  exactly the plain delayed rule, fed better gradients. Both cancel the
  delay to first order; using both corrects it about twice.

  Cost: one parameter-sized buffer for u[k-1] here (`buffer_dtype`, default
  the params'), plus the predicted weights that the forward uses, built from
  it when needed. In a pipeline the stage must run its forward and backward
  on w_hat while it updates w, so 2BW would keep the predicted version of
  each in-flight batch as its two buffers and the master weights apart: one
  version more than plain 2BW. Wiring that into jaxpipe's 2bw engine is out
  of scope; this module gives the rule and its one-device simulation.

  Args:
    inner: the optimizer whose updates are applied.
    steps: the horizon s in updates (1 for a one-step delay; may be
      fractional, or traced under `optax.inject_hyperparams`).
    buffer_dtype: dtype of the stored update; None keeps the params'.

  Returns:
    An `optax.GradientTransformationExtraArgs`; its updates are `inner`'s.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jaxpipe import optim
    >>> tx = optim.weight_prediction(optax.sgd(1.0))
    >>> w = jnp.zeros(2)
    >>> state = tx.init(w)
    >>> u, state = tx.update(jnp.array([1., 2.]), state, w)
    >>> w = optax.apply_updates(w, u)
    >>> optim.predicted_params(w, state)   # w + u
    Array([-2., -4.], dtype=float32)

  References:
    Yang et al., `PipeMare: Asynchronous Pipeline Parallel DNN Training
    <https://arxiv.org/abs/1910.05124>`_, 2021

    Chen et al., `Efficient and Robust Parallel DNN Training through Model
    Parallelism on Multi-GPU Platform <https://arxiv.org/abs/1809.02839>`_,
    2018

    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return PredictionState(horizon=jnp.asarray(steps, jnp.float32),
                           prev_update=_update_buffer(params, buffer_dtype),
                           inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    return updates, PredictionState(horizon=jnp.asarray(steps, jnp.float32),
                                    prev_update=_in_dtypes_of(updates, state.prev_update),
                                    inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _update_buffer(params: optax.Params, buffer_dtype: Any | None) -> optax.Params:
  """Zeros like `params`, in `buffer_dtype` where given: the last update, before any."""
  def zeros(p):
    return jnp.zeros_like(p, dtype=p.dtype if buffer_dtype is None else jnp.dtype(buffer_dtype))
  return jax.tree.map(zeros, params)


def _in_dtypes_of(updates: optax.Updates, buffer: optax.Updates) -> optax.Updates:
  """`updates` cast leaf by leaf to the dtypes of `buffer` (the stored update's)."""
  return jax.tree.map(lambda u, b: u.astype(b.dtype), updates, buffer)


def predicted_params(params: optax.Params, opt_state: optax.OptState) -> Any:
  r"""The weights the next forward should use: `params + s * prev_update`.

  Finds the one `PredictionState` anywhere in `opt_state` (inside `delay`,
  `error_feedback`, `optax.chain`, `optax.inject_hyperparams`, ...) and
  extrapolates `params` by its horizon s times the update applied last
  (see `weight_prediction`). Computed in at least float32 and returned in
  the params' dtypes. Jit-able.

  Args:
    params: the current weights w[k].
    opt_state: a state holding exactly one `PredictionState`.

  Returns:
    A pytree like `params`: `w[k] + s * u[k-1]`.

  Raises:
    ValueError: when `opt_state` holds no `PredictionState` or several.
  """
  is_prediction = lambda x: isinstance(x, PredictionState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_prediction)
           if is_prediction(x)]
  if len(found) != 1:
    raise ValueError(f"opt_state must hold one PredictionState (from "
                     f"weight_prediction), found {len(found)}")
  state = found[0]

  def ahead(p, u):
    wide = jnp.promote_types(p.dtype, jnp.float32)
    out = p.astype(wide) + state.horizon.astype(wide) * u.astype(wide)
    return out.astype(p.dtype)

  return jax.tree.map(ahead, params, state.prev_update)
