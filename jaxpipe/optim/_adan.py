"""Adan as the Adan paper states it, and optax's variant for comparison."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpipe.optim import _config
from jaxpipe.optim import _optimizers

__all__ = ["AdanState", "adan", "scale_by_adan"]


class AdanState(NamedTuple):
  """State of `scale_by_adan` (form 'paper').

  Attributes:
    count: updates done.
    m: average of the gradients.
    v: average of the gradient differences.
    n: average of the squared Nesterov gradient.
    prev_grad: the last gradient (the first difference is zero).
  """
  count: jax.Array
  m: optax.Updates
  v: optax.Updates
  n: optax.Updates
  prev_grad: optax.Updates


def scale_by_adan(
    b1: float | jax.Array = 0.98,
    b2: float | jax.Array = 0.92,
    b3: float | jax.Array = 0.99,
    eps: float | jax.Array = 1e-8,
) -> optax.GradientTransformation:
  r"""Adan's direction, Algorithm 1 of Xie et al. (2022) in optax's beta convention.

  With d = g[t] - g[t-1] (zero at the first step) and b = 1 - the paper's beta:

  .. math::
    m = b_1 m + (1-b_1) g, \quad v = b_2 v + (1-b_2) d, \quad
    n = b_3 n + (1-b_3) (g + b_2 d)^2, \\
    u = (\hat m + b_2 \hat v) / (\sqrt{\hat n} + \epsilon),

  hats being Adam's bias corrections. The weight of the difference, b2, is
  the paper's (1 - beta_2) = 0.92 and the authors' code's `beta2`; optax
  0.2.8's `scale_by_adan` uses 1 - b2 = 0.08 there instead (`adan(form=
  'optax')`).
  """

  def init_fn(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    return AdanState(jnp.zeros([], jnp.int32), zeros(), zeros(), zeros(), zeros())

  def update_fn(updates, state, params=None):
    del params
    first = state.count == 0
    d = jax.tree.map(lambda g, p: jnp.where(first, jnp.zeros_like(g), g - p), updates,
                     state.prev_grad)
    m = optax.tree.update_moment(updates, state.m, b1, 1)
    v = optax.tree.update_moment(d, state.v, b2, 1)
    nesterov = jax.tree.map(lambda g, x: g + b2 * x, updates, d)
    n = optax.tree.update_moment_per_elem_norm(nesterov, state.n, b3, 2)
    count = optax.safe_increment(state.count)
    m_hat = optax.tree.bias_correction(m, b1, count)
    v_hat = optax.tree.bias_correction(v, b2, count)
    n_hat = optax.tree.bias_correction(n, b3, count)
    out = jax.tree.map(lambda a, b, c: (a + b2 * b) / (jnp.sqrt(c) + eps), m_hat, v_hat, n_hat)
    return out, AdanState(count, m, v, n, updates)

  return optax.GradientTransformation(init_fn, update_fn)


def adan(
    learning_rate: _optimizers.ScalarOrSchedule,
    *,
    b1: float | jax.Array = 0.98,
    b2: float | jax.Array = 0.92,
    b3: float | jax.Array = 0.99,
    eps: float | jax.Array = 1e-8,
    weight_decay: float | jax.Array = 0.1,
    weight_decay_mask: _optimizers.Mask | None = None,
    form: str = "paper",
) -> optax.GradientTransformation:
  r"""Adan with jaxpipe's decay mask (no decay on norms and biases).

  Update rule (`form='paper'`, the default): `scale_by_adan`'s direction u,
  then `W -= eta (u + lambda W)` (decoupled decay, as AdamW's; the authors'
  code divides by 1 + eta lambda instead, equal to first order). The betas
  are optax's and the authors' code's, b = 1 - the paper's beta: the
  defaults (0.98, 0.92, 0.99) are the paper's (0.02, 0.08, 0.01).

  `form='optax'` is `optax.adan` with the mask: the same but for the weight
  of the gradient difference, 1 - b2 = 0.08 where the paper has 0.92 (in both
  the update and the second moment), so its Nesterov term is about 11x
  weaker. jaxpipe used it before; it stays for comparing with those results.

  State: `(AdanState or optax's ScaleByAdanState, mask state, learning-rate
  state)`. Memory: three parameter-sized moments plus the previous gradient
  (4x params).

  Args:
    learning_rate: a scalar or an `optax.Schedule`.
    b1: decay of the gradient average.
    b2: decay of the gradient-difference average (and, in the paper's form,
      the weight of the difference).
    b3: decay of the second moment.
    eps: added to the denominator.
    weight_decay: decoupled decay, multiplied by the learning rate.
    weight_decay_mask: a pytree of bools or a function of the params.
    form: 'paper' or 'optax' (see above).

  Returns:
    An `optax.GradientTransformation`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpipe import optim
    >>> tx = optim.adan(1e-3)
    >>> state = tx.init({'kernel': jnp.ones((2, 2))})

  References:
    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026

    Xie et al., `Adan: Adaptive Nesterov Momentum Algorithm for Faster
    Optimizing Deep Models <https://arxiv.org/abs/2208.06677>`_, 2022
  """
  if form not in _config.ADAN_FORMS:
    raise ValueError(f"adan form must be one of {', '.join(_config.ADAN_FORMS)}, got {form!r}")
  mask = _optimizers.mask_or_default(weight_decay_mask)
  if form == "optax":
    inner = optax.adan(learning_rate, b1=b1, b2=b2, b3=b3, eps=eps, weight_decay=weight_decay,
                       mask=mask)
  else:
    inner = optax.chain(scale_by_adan(b1, b2, b3, eps),
                        optax.add_decayed_weights(weight_decay, mask),
                        optax.scale_by_learning_rate(learning_rate))
  return _optimizers.dtype_stable(inner)
