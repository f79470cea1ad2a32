"""Wrappers that change when and how an inner optimizer's update is applied.

`delay` reproduces on one device the stale gradients of an asynchronous
pipeline; `error_feedback` is the optimizer-agnostic correction for them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["DelayState", "ErrorFeedbackState", "delay", "error_feedback"]


def _dtype_or(dtype: Any | None, like: jax.Array) -> Any:
  # Not `dtype or like.dtype`: numpy dtypes have len() 0 and are falsy.
  return like.dtype if dtype is None else jnp.dtype(dtype)


class DelayState(NamedTuple):
  """State of `delay`.

  Attributes:
    count: number of calls so far (int32, saturating).
    buffer: the last `steps` gradients, a pytree like the params whose leaves
      carry a leading axis of size `steps`; used as a ring, slot
      `count % steps` holds the gradient of call `count - steps`.
    inner_state: the wrapped optimizer's state; it advances only once a
      delayed gradient exists.
  """
  count: jax.Array
  buffer: optax.Updates
  inner_state: optax.OptState


def delay(
    inner: optax.GradientTransformation,
    steps: int = 1,
    *,
    buffer_dtype: Any | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Applies `inner` to the gradient received `steps` calls earlier.

  Update rule: for call t (counted from 0) with gradient g[t],

  .. math::
    u[t] = 0 \text{ and inner state unchanged}, \quad t < \text{steps};
    \qquad u[t] = \mathrm{inner}(g[t - \text{steps}]), \quad t \ge \text{steps}.

  The inner optimizer sees the *current* params (so decoupled weight decay
  acts on the newest weights) and advances its state once per real update.
  With `steps=1` this is the one-device reference of PipeDream-2BW,
  `w[k+1] = w[k] - U(grad f(w[k-1]))`: the update is applied to the newest
  weights but its gradient was taken one version earlier.

  Composition with `error_feedback`: a 2BW pipeline calls its optimizer only
  once a delayed gradient exists, so the one-device equivalent of "2BW plus
  correction" is `delay(error_feedback(inner))`, whose first real update is
  the inner update unchanged. `error_feedback(delay(inner))` instead counts the
  zero update of call 0 as the previous update, so its first real update is
  scaled by 1 + c; afterwards the two agree.

  State: `DelayState(count, buffer, inner_state)`. Memory: `steps` extra
  parameter-sized buffers of gradients, in `buffer_dtype` (default: the
  params' dtype, which is the gradients' dtype under `jax.grad`).

  Args:
    inner: the optimizer whose update is delayed.
    steps: the delay in calls; 0 returns `inner` itself.
    buffer_dtype: dtype of the gradient buffer; None keeps the params' dtype.
      Incoming gradients are stored in this dtype.

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jaxpipe import optim
    >>> tx = optim.delay(optax.sgd(1.0), steps=1)
    >>> state = tx.init(jnp.zeros(2))
    >>> u, state = tx.update(jnp.array([1., 2.]), state)   # zero update
    >>> u, state = tx.update(jnp.array([3., 4.]), state)   # -g[0]
    >>> u
    Array([-1., -2.], dtype=float32)

  References:
    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026

    Narayanan et al., `Memory-Efficient Pipeline-Parallel DNN Training
    <https://arxiv.org/abs/2006.09503>`_, 2021
  """
  if steps < 0:
    raise ValueError(f"delay steps must be >= 0, got {steps}")
  if steps == 0:
    return optax.with_extra_args_support(inner)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    # Broadcasting zeros_like(p) keeps p's sharding on the parameter axes.
    buffer = jax.tree.map(
        lambda p: jnp.broadcast_to(
            jnp.zeros_like(p, dtype=_dtype_or(buffer_dtype, p)),
            (steps,) + p.shape),
        params)
    return DelayState(
        count=jnp.zeros([], jnp.int32),
        buffer=buffer,
        inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    slot = state.count % steps
    # The slot about to be overwritten holds the gradient of call t - steps.
    delayed = jax.tree.map(
        lambda b: jax.lax.dynamic_index_in_dim(b, slot, keepdims=False),
        state.buffer)
    buffer = jax.tree.map(
        lambda b, g: jax.lax.dynamic_update_index_in_dim(
            b, g.astype(b.dtype), slot, 0),
        state.buffer, updates)

    def apply(operand):
      grads, inner_state = operand
      return inner.update(grads, inner_state, params, **extra_args)

    out_shapes = jax.eval_shape(apply, (delayed, state.inner_state))

    def skip(operand):
      grads, inner_state = operand
      # zeros_like of the gradients keeps their sharding; the dtype is the
      # inner update's, so both branches of the cond agree.
      zeros = jax.tree.map(
          lambda s, g: jnp.zeros_like(g, dtype=s.dtype), out_shapes[0], grads)
      return zeros, inner_state

    new_updates, inner_state = jax.lax.cond(
        state.count >= steps, apply, skip, (delayed, state.inner_state))
    return new_updates, DelayState(
        count=optax.safe_increment(state.count),
        buffer=buffer,
        inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class ErrorFeedbackState(NamedTuple):
  """State of `error_feedback`.

  Attributes:
    count: number of calls so far (int32, saturating).
    prev_update: the inner optimizer's previous (uncorrected) update v[t-1],
      zeros before the first call.
    inner_state: the wrapped optimizer's state.
  """
  count: jax.Array
  prev_update: optax.Updates
  inner_state: optax.OptState


def error_feedback(
    inner: optax.GradientTransformation,
    coeff: float | jax.Array = 1.0,
    *,
    buffer_dtype: Any | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Error-feedback correction for a one-step gradient delay.

  Update rule, with v[t] the inner optimizer's whole update (learning rate and
  decoupled weight decay included) and optax's sign convention (updates are
  added to the params):

  .. math::
    \mathrm{out}[0] = v[0], \qquad
    \mathrm{out}[t] = (1 + c)\, v[t] - c\, v[t-1] \quad (t \ge 1).

  In the paper's notation, with the descent step u = -v,
  `x[t+1] = x[t] - u[t] - c (u[t] - u[t-1])`. Equivalently, from t = 1 on
  the shadow iterate `z[t] = x[t] - c v[t-1]` (= `x[t] + c u[t-1]`) follows
  the uncorrected rule `z[t+1] = z[t] + v[t]`, and the weights at which the
  next gradient is taken, x, are z pushed about c updates ahead. With c = 1
  that cancels a one-step gradient delay to first order.

  Order with `delay`: use `delay(error_feedback(inner))` to match a
  PipeDream-2BW pipeline, which calls its optimizer first when a delayed
  gradient exists (so its first real update is uncorrected).
  `error_feedback(delay(inner))` counts the delay's zero update as v[0], so its
  first real update is (1 + c) v; all later updates are the same.

  State: `ErrorFeedbackState(count, prev_update, inner_state)`. Memory: one
  parameter-sized buffer for v[t-1], in `buffer_dtype` (default: the params'
  dtype). The correction is computed in at least float32 and returned in the
  inner update's dtype, so bf16 updates stay bf16.

  Args:
    inner: the optimizer to correct.
    coeff: the coefficient c >= 0 (1 in the paper); 0 gives `inner`'s updates.
      May be a traced scalar (e.g. under `optax.inject_hyperparams`).
    buffer_dtype: dtype of the stored previous update; None keeps the params'.

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jaxpipe import optim
    >>> tx = optim.error_feedback(optax.sgd(1.0), coeff=1.0)
    >>> state = tx.init(jnp.zeros(1))
    >>> u, state = tx.update(jnp.array([1.]), state)   # v[0] = -1
    >>> u, state = tx.update(jnp.array([3.]), state)   # 2 * -3 - (-1)
    >>> u
    Array([-5.], dtype=float32)

  References:
    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return ErrorFeedbackState(
        count=jnp.zeros([], jnp.int32),
        prev_update=jax.tree.map(
            lambda p: jnp.zeros_like(p, dtype=_dtype_or(buffer_dtype, p)),
            params),
        inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    v, inner_state = inner.update(updates, state.inner_state, params,
                                  **extra_args)
    first = state.count == 0

    def correct(v_t, v_prev):
      wide = jnp.promote_types(v_t.dtype, jnp.float32)
      v32 = v_t.astype(wide)
      out = v32 + jnp.asarray(coeff, wide) * (v32 - v_prev.astype(wide))
      # A select, not a multiply by zero: an inf in v[0] must not become NaN.
      return jnp.where(first, v_t, out.astype(v_t.dtype))

    out = jax.tree.map(correct, v, state.prev_update)
    prev = jax.tree.map(lambda v_t, b: v_t.astype(b.dtype), v,
                        state.prev_update)
    return out, ErrorFeedbackState(
        count=optax.safe_increment(state.count),
        prev_update=prev,
        inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
