"""MARS-AdamW: AdamW on a variance-reduced gradient (Yuan et al. 2024)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpipe.optim import _grouping
from jaxpipe.optim import _optimizers

__all__ = ["ScaleByMarsState", "mars", "mars_labels", "scale_by_mars"]


class ScaleByMarsState(NamedTuple):
  """State of `scale_by_mars`.

  Attributes:
    count: number of updates so far (int32, saturating).
    mu: first moment of the clipped corrected gradient, param-shaped.
    nu: second moment of the same, param-shaped.
    prev_grad: the gradient of the previous update (zeros before the first),
      param-shaped.
  """
  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  prev_grad: optax.Updates


def _state_dtype(p: jax.Array) -> Any:
  # At least float32: in bf16 the correction gamma b1/(1-b1) (g - g_prev) of
  # nearby gradients would mostly round away.
  return jnp.promote_types(p.dtype, jnp.float32)


def _matrix_norm(c: jax.Array) -> jax.Array:
  # The paper's models keep one tensor per matrix; a stacked leaf [..., m, n]
  # holds several, so each matrix (last two axes) is clipped on its own.
  axes = tuple(range(c.ndim))[-2:]
  return jnp.sqrt(jnp.sum(jnp.square(c), axis=axes, keepdims=True))


def scale_by_mars(
    *,
    gamma: float | jax.Array = 0.025,
    b1: float | jax.Array = 0.95,
    b2: float | jax.Array = 0.99,
    eps: float | jax.Array = 1e-8,
    clip_threshold: float | jax.Array | None = 1.0,
) -> optax.GradientTransformation:
  r"""MARS-AdamW's direction (approximate MARS), without decay or rate.

  Update rule for gradient g[t], t counted from 1:

  .. math::
    c_t = g_t + \gamma \frac{\beta_1}{1-\beta_1} (g_t - g_{t-1})
      \;(c_1 = g_1), \quad
    \tilde c_t = c_t \min(1, \tau / \|c_t\|), \\
    m_t = \beta_1 m_{t-1} + (1-\beta_1) \tilde c_t, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) \tilde c_t^2, \quad
    u_t = \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon},

  with tau = `clip_threshold` (1 in the paper; None = no clip) and the norm
  taken per matrix (the last two axes; the whole leaf below two axes).

  Returns the direction u (to be scaled by minus the learning rate).

  Args:
    gamma: strength of the gradient correction.
    b1: first-moment decay (also sets the correction's weight).
    b2: second-moment decay.
    eps: added to the denominator.
    clip_threshold: the norm above which c_t is scaled down to it.

  Returns:
    An `optax.GradientTransformation` with state `ScaleByMarsState`.
  """

  def init_fn(params):
    zeros = lambda p: jnp.zeros_like(p, dtype=_state_dtype(p))
    return ScaleByMarsState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(zeros, params),
        nu=jax.tree.map(zeros, params),
        prev_grad=jax.tree.map(zeros, params))

  def update_fn(updates, state, params=None):
    del params
    first = state.count == 0
    weight = gamma * b1 / (1 - b1)

    def corrected(g, prev):
      g = g.astype(prev.dtype)
      # The approximate MARS of the paper: the previous gradient stands in
      # for the current batch's gradient at the previous weights. Its x_1 =
      # x_0 makes the first correction zero (a select, not a multiply by
      # zero, so no 0 * inf).
      c = jnp.where(first, g, g + weight * (g - prev))
      if clip_threshold is None:
        return c
      norm = _matrix_norm(c)
      return c * jnp.where(norm > clip_threshold, clip_threshold / norm, 1.0)

    c = jax.tree.map(corrected, updates, state.prev_grad)
    mu = optax.tree.update_moment(c, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(c, state.nu, b2, 2)
    count = optax.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, b1, count)
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    direction = jax.tree.map(
        lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
    prev = jax.tree.map(lambda g, b: g.astype(b.dtype), updates,
                        state.prev_grad)
    return direction, ScaleByMarsState(
        count=count, mu=mu, nu=nu, prev_grad=prev)

  return optax.GradientTransformation(init_fn, update_fn)


def mars_labels(params: Any) -> Any:
  """Labels `'mars'` every matrix (embeddings and head too), `'adam'` vectors.

  This is the grouping of the MARS paper's code: MARS on every tensor with
  two axes, AdamW on norms and biases. Here "matrix" is every kind of
  `jaxpipe.optim.param_kinds` but `vector`, so stacked blocks [L, D, F] and
  experts [L, E, D, F] go to MARS and stacked norms to AdamW.

  Args:
    params: a pytree of arrays or `jax.ShapeDtypeStruct`s.

  Returns:
    A pytree of `'mars'` / `'adam'` with the structure of `params`.
  """
  return jax.tree.map(
      lambda kind: "adam" if kind == _grouping.VECTOR else "mars",
      _grouping.param_kinds(params))


def mars(
    learning_rate: optax.ScalarOrSchedule,
    *,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    gamma: float | jax.Array = 0.025,
    b1: float | jax.Array = 0.95,
    b2: float | jax.Array = 0.99,
    adam_b1: float | jax.Array = 0.9,
    adam_b2: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-8,
    weight_decay: float | jax.Array = 0.01,
    clip_threshold: float | jax.Array | None = 1.0,
    param_labels: Any | Callable[[Any], Any] | None = None,
    weight_decay_mask: Any | Callable[[Any], Any] | None = None,
) -> optax.GradientTransformation:
  r"""MARS-AdamW on matrices, AdamW on norms and biases.

  Update rule for a matrix W with gradient g[t] (t from 1; the approximate
  MARS of the paper, which uses the previous step's gradient in place of the
  current batch's gradient at the previous weights):

  .. math::
    c_t = g_t + \gamma \frac{\beta_1}{1-\beta_1} (g_t - g_{t-1}), \quad
    \tilde c_t = c_t / \max(1, \|c_t\|_2), \\
    m_t = \beta_1 m_{t-1} + (1-\beta_1) \tilde c_t, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) \tilde c_t^2, \\
    W_{t+1} = W_t - \eta \Big(\frac{m_t/(1-\beta_1^t)}
      {\sqrt{v_t/(1-\beta_2^t)} + \epsilon} + \lambda W_t\Big).

  - The first step has no previous gradient: c_1 = g_1, as the paper's
    algorithm gives with its x_1 = x_0. (Its code keeps a zero previous
    gradient instead, so its c_1 = (1 + gamma b1/(1-b1)) g_1 before the clip.)
  - The clip to norm 1 is the paper's `Clip(c_t, 1)`, per tensor as in its
    code: here per matrix, so each matrix of a stacked leaf [L, m, n] is
    clipped alone (`clip_threshold`, None = off). It comes on top of any
    global clip of the raw gradient (`make_optimizer` keeps `clip_norm`).
  - Grouping: MARS on every matrix, embeddings and output head included
    (`mars_labels`, the paper code's 2-D rule); AdamW with `adam_b1`,
    `adam_b2` (the code's 0.9, 0.95) on norms and biases. Decay follows
    jaxpipe's mask (every matrix, no norms or biases), where the paper's code
    also decays its 1-D parameters.
  - Defaults are the paper's for GPT-2: gamma 0.025, (b1, b2) = (0.95, 0.99),
    weight decay 0.01 (learning rate 6e-3 at 125M parameters, with
    `adam_learning_rate` 3e-3 there). `adam_learning_rate` None =
    `learning_rate`.

  State: `(PartitionState{mars: ScaleByMarsState, adam: ScaleByAdamState},
  decay state, PartitionState of the rates)`. Memory: three param-sized
  float32 buffers per MARS leaf (m, v and the previous gradient), AdamW's two
  on the vectors: about 3x params, against AdamW's 2x (and in float32
  whatever the params' dtype, so bf16 params keep bf16 updates but pay 4
  bytes a buffer).

  Under `delay` the gradients MARS differences are consecutive delayed ones,
  so the correction acts on g(w[t-1]) - g(w[t-2]).

  Args:
    learning_rate: MARS's rate (a scalar or an `optax.Schedule`).
    adam_learning_rate: AdamW's rate on norms and biases; None = the same.
    gamma: strength of the gradient correction (0 = AdamW on clipped
      gradients).
    b1: MARS's first-moment decay.
    b2: MARS's second-moment decay.
    adam_b1: AdamW's first-moment decay.
    adam_b2: AdamW's second-moment decay.
    eps: added to both denominators.
    weight_decay: decoupled decay, multiplied by each group's rate.
    clip_threshold: per-matrix norm bound of c_t; None = no clip.
    param_labels: a pytree of `'mars'`/`'adam'` or a function of the params;
      None = `mars_labels`. Under `optax.inject_hyperparams` name a function
      here in `static_args`.
    weight_decay_mask: a pytree of bools or a function of the params; None =
      `jaxpipe.optim.weight_decay_mask`.

  Returns:
    An `optax.GradientTransformation`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpipe import optim
    >>> params = {'w': jnp.ones((2, 3, 3)), 'norm': {'scale': jnp.ones(3)}}
    >>> tx = optim.mars(3e-3)
    >>> updates, state = tx.update(params, tx.init(params), params)

  References:
    Yuan et al., `MARS: Unleashing the Power of Variance Reduction for
    Training Large Models <https://arxiv.org/abs/2411.10438>`_, 2024

    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026
  """
  labels = _optimizers.checked_labels(
      param_labels, main="mars", default=mars_labels)
  direction = scale_by_mars(
      gamma=gamma, b1=b1, b2=b2, eps=eps, clip_threshold=clip_threshold)
  return _optimizers.with_adamw(
      direction, labels, main_label="mars", learning_rate=learning_rate,
      adam_learning_rate=adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=eps,
      mu_dtype=None, weight_decay=weight_decay,
      weight_decay_mask=weight_decay_mask)
