"""Muon: Newton-Schulz orthogonalised momentum on hidden matrices, AdamW elsewhere.

Muon's direction is optax's `scale_by_muon` rewritten only so that a stack
split over two mesh axes stays split (`_orthogonalise`); its update scale and
its AdamW group are `_optimizers`' (`scale_by_shape`, `with_adamw`), which
NorMuon shares. The Newton-Schulz coefficients: Jordan's fixed quintic, or
Polar Express's one per step.
"""

from __future__ import annotations

import math
import operator
import typing
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

from jaxpipe.optim import _config
from jaxpipe.optim import _optimizers

__all__ = ["NS_COEFFS", "POLAR_EXPRESS_COEFFS", "muon", "orthogonalised_momentum",
           "scale_by_muon"]

# Quintic Newton-Schulz coefficients of Jordan's Muon: they maximise the slope
# at zero, so 5 steps push every singular value into roughly [0.7, 1.2]
# rather than converging to exactly 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel et al., arXiv 2505.16932, Algorithm 1, degree 5): one
# quintic per iteration, each the minimax (sup-norm) best approximation of
# sign(x) on the interval of singular values that the previous ones leave,
# starting from [1e-3, 1]. Early polynomials are aggressive, later ones
# converge, so 5 iterations land much closer to 1 than Jordan's fixed quintic.
# These are the numbers printed in the paper's Algorithm 1 (also in its code,
# github.com/NoahAmsel/PolarExpress).
_POLAR_EXPRESS_PAPER = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
# The paper's safety factor (its section 4.4): each polynomial but the last is
# evaluated at x / 1.01, so that round-off in low precision cannot push a
# singular value past the interval the next polynomial was fitted on.
_POLAR_EXPRESS_SAFETY = 1.01


def _at_scaled_input(coeffs: Sequence[float], s: float) -> tuple[float, ...]:
  # p(x / s) for p(x) = a x + b x^3 + c x^5.
  a, b, c = coeffs
  return (a / s, b / s**3, c / s**5)


# Per-iteration coefficients after the safety factor, as Algorithm 1 uses
# them; iterations past the eighth repeat the last row.
POLAR_EXPRESS_COEFFS = tuple(
    _at_scaled_input(c, _POLAR_EXPRESS_SAFETY)
    for c in _POLAR_EXPRESS_PAPER[:-1]) + (_POLAR_EXPRESS_PAPER[-1],)
# The names `ns_coeffs` takes, as the config's `optimizer.muon.ns_coeffs` does.
_NS_PRESETS: tuple[str, ...] = typing.get_args(_config.NsCoeffs)


def _ns_schedule(ns_coeffs: str | Sequence[Any], ns_steps: int) -> Any:
  """The Newton-Schulz coefficients to give optax's Muon for `ns_steps`.

  A flat (a, b, c) is returned as it is (one quintic for every step); a name
  or a sequence of (a, b, c) rows becomes exactly `ns_steps` rows: the first
  `ns_steps`, the last row repeated if there are fewer, as in Polar Express.
  """
  if isinstance(ns_coeffs, str):
    if ns_coeffs == "jordan":
      return NS_COEFFS
    if ns_coeffs != "polar_express":
      raise ValueError(f"unknown ns_coeffs {ns_coeffs!r}; expected one of "
                       f"{_NS_PRESETS} or coefficients")
    # Algorithm 1 normalises by 1.01 * ||X||_F, optax's Muon by ||X||_F + eps;
    # evaluating the first polynomial at x / 1.01 is the same thing.
    rows = ((_at_scaled_input(POLAR_EXPRESS_COEFFS[0], _POLAR_EXPRESS_SAFETY),)
            + POLAR_EXPRESS_COEFFS[1:])
  else:
    rows = tuple(ns_coeffs)
    if len(rows) == 3 and all(np.ndim(r) == 0 for r in rows):
      return ns_coeffs
    if not rows or any(np.ndim(r) != 1 or len(r) != 3 for r in rows):
      raise ValueError("ns_coeffs must be (a, b, c) or a sequence of them, "
                       f"got {ns_coeffs!r}")
    rows = tuple(tuple(r) for r in rows)
  try:
    steps = operator.index(ns_steps)
  except TypeError:
    # optax.inject_hyperparams passes every int argument in traced.
    raise ValueError(
        "per-step ns_coeffs need a static ns_steps; under "
        "optax.inject_hyperparams name 'ns_steps' in static_args") from None
  if steps < 1:
    raise ValueError(f"ns_steps must be >= 1, got {steps}")
  return rows[:steps] + rows[-1:] * max(0, steps - len(rows))


def _newton_schulz(x: jax.Array, coeffs: jax.Array, steps: int, eps) -> jax.Array:
  """The quintic Newton-Schulz iteration on one matrix x [m, n], Frobenius-normalised.

  The same operations as optax's `scale_by_muon` (x / (||x||_F + eps), the
  wide orientation, X <- a X + (b A + c A^2) X with A = X X^T), per step
  `coeffs[i]` when `coeffs` is [steps, 3].
  """
  transposed = x.shape[0] > x.shape[1]
  if transposed:
    x = x.T
  x = x / (jnp.linalg.norm(x, ord="fro") + eps)
  coeffs = coeffs.astype(x.dtype)

  def step(x, c):
    a = x @ x.T.conj()
    b = c[1] * a + c[2] * a @ a
    return c[0] * x + b @ x

  if coeffs.ndim == 1:
    x = jax.lax.fori_loop(0, steps, lambda _, x: step(x, coeffs), x, unroll=True)
  else:
    x, _ = jax.lax.scan(lambda x, c: (step(x, c), None), x, coeffs)
  return x.T if transposed else x


def _orthogonalise(x: jax.Array, dims: MuonDimensionNumbers, coeffs, steps, eps) -> jax.Array:
  """Newton-Schulz on every matrix of x, its batch axes mapped one by one.

  optax flattens all batch axes into one before its vmap. When two of them
  are split over different mesh axes (a stage's layers over 'stage', its
  experts over 'data'), no layout of the merged axis keeps both splits, so
  XLA gathers the stack and every device orthogonalises all of it. Mapping
  each batch axis with its own `jax.vmap` keeps each matrix on the device
  that holds it.
  """
  red = _optimizers.wrap_axes(x.ndim, dims.reduction_axis)
  out = _optimizers.wrap_axes(x.ndim, dims.output_axis)
  batch = tuple(a for a in range(x.ndim) if a not in red + out)
  order = batch + red + out
  shaped = jnp.transpose(x, order)
  lead = shaped.shape[:len(batch)]
  m, n = math.prod(x.shape[a] for a in red), math.prod(x.shape[a] for a in out)
  fn = lambda mat: _newton_schulz(mat, coeffs, steps, eps)
  for _ in batch:
    fn = jax.vmap(fn)
  y = fn(shaped.reshape(*lead, m, n)).reshape(shaped.shape)
  return jnp.transpose(y, np.argsort(order))


def orthogonalised_momentum(
    dims_fn: Callable[[Any], Any],
    *,
    momentum: float | jax.Array,
    nesterov: bool,
    ns_steps: int,
    ns_coeffs: str | Sequence[Any],
    eps: float | jax.Array,
    mu_dtype: Any | None,
) -> optax.GradientTransformation:
  """Muon's direction before its scale: NS(momentum), each matrix alone.

  optax's `scale_by_muon` with its state (`optax.contrib.MuonState`) and its
  arithmetic, except that the matrices of a stack are orthogonalised where
  they lie on the mesh (`_orthogonalise`).
  """
  coeffs = _ns_schedule(ns_coeffs, ns_steps)
  mu_dtype = jax.dtypes.canonicalize_dtype(mu_dtype) if mu_dtype is not None else None
  is_dims = lambda x: isinstance(x, MuonDimensionNumbers)

  def init_fn(params):
    c = jnp.asarray(coeffs)
    if c.ndim == 2:
      c = c[-ns_steps:]
    return optax.contrib.MuonState(count=jnp.zeros([], jnp.int32),
                                   mu=optax.tree.zeros_like(params, dtype=mu_dtype),
                                   ns_coeffs=c)

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, momentum, 1)
    count = optax.safe_increment(state.count)
    if nesterov:
      mu_hat = jax.tree.map(lambda m, g: momentum * m + (1 - momentum) * g,
                            optax.tree.bias_correction(mu, momentum,
                                                       optax.safe_increment(count)),
                            optax.tree.bias_correction(updates, momentum, count))
    else:
      mu_hat = optax.tree.bias_correction(mu, momentum, count)
    updates = jax.tree.map(
        lambda x, d: _orthogonalise(x, d, state.ns_coeffs, ns_steps, eps),
        mu_hat, dims_fn(updates), is_leaf=is_dims)
    return updates, optax.contrib.MuonState(count=count, mu=optax.tree.cast(mu, mu_dtype),
                                            ns_coeffs=state.ns_coeffs)

  return optax.GradientTransformation(init_fn, update_fn)


def muon(
    learning_rate: _optimizers.ScalarOrSchedule,
    *,
    adam_learning_rate: _optimizers.ScalarOrSchedule | None = None,
    momentum: float | jax.Array = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coeffs: str | Sequence[Any] = "jordan",
    weight_decay: float | jax.Array = 0.1,
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-8,
    consistent_rms: float | jax.Array | None = 0.2,
    mu_dtype: Any | None = None,
    param_labels: Any | None = None,
    weight_decay_mask: _optimizers.Mask | None = None,
    dimension_numbers: MuonDimensionNumbers | Callable[[Any], Any] | None = None,
) -> optax.GradientTransformation:
  r"""Muon for hidden matrices, AdamW for embeddings, head, norms and biases.

  Update rule for a hidden matrix W (each matrix of a stack on its own), with
  gradient G[t], momentum beta and Nesterov (the default):

  .. math::
    M[t] = \beta M[t-1] + (1-\beta) G[t], \quad
    O[t] = \mathrm{NS}_5(\beta \hat M[t] + (1-\beta) \hat G[t]), \\
    W[t+1] = W[t] - \eta\,(0.2 \sqrt{\max(m, n)}\; O[t] + \lambda W[t]),

  where hats are optax's bias corrections, NS_5 is five quintic Newton-Schulz
  steps (`scale_by_muon`: the direction and its scale), m x n is the matrix
  shape, eta the learning rate and lambda the decoupled weight decay. All other leaves take
  AdamW, `W -= eta_adam (m_hat / (sqrt(v_hat) + eps) + lambda W)`, without
  decay on norms and biases.

  Update scale (a choice, `scale_by_muon`): the default RMS of about 0.2 lets
  one learning rate and one weight decay serve both groups.

  Which leaves are hidden matrices: `param_labels` (default
  `jaxpipe.optim.param_labels`, a rule on paths and shapes). Stacked weights
  [L, D, F] and stacked experts [L, E, D, F] are orthogonalised per matrix,
  with the last two axes as (in, out) unless `dimension_numbers` says
  otherwise. (Without dimension numbers optax's `muon` silently gives 3-D and
  4-D weights to Adam; here every Muon leaf gets them.) A leaf labelled
  `'muon'` with fewer than two axes is an error.

  State: `(PartitionState{muon: MuonState, adam: ScaleByAdamState}, decay
  state, PartitionState of the learning-rate scalings)`. Memory: one momentum
  buffer per Muon matrix (in `mu_dtype`, default the params'), two moments per
  AdamW leaf; with Muon covering most weights, about 1x params against
  AdamW's 2x.

  Defaults are the usual Muon settings, as the paper does not pin them all
  down: Nesterov momentum 0.95, 5 Newton-Schulz steps, AdamW (0.9, 0.95) on
  the other leaves.

  Args:
    learning_rate: Muon's rate (a scalar or an `optax.Schedule`).
    adam_learning_rate: AdamW's rate; None = `learning_rate`.
    momentum: Muon's momentum beta.
    nesterov: Nesterov momentum for Muon.
    ns_steps: Newton-Schulz iterations.
    ns_coeffs: the Newton-Schulz coefficients (see `scale_by_muon`).
    weight_decay: decoupled decay lambda, multiplied by each group's rate.
    b1: AdamW's first-moment decay.
    b2: AdamW's second-moment decay.
    eps: AdamW's epsilon (also guards Muon's normalisation).
    consistent_rms: target RMS of Muon's update, or None for Jordan's scale.
    mu_dtype: dtype of Muon's momentum and AdamW's first moment.
    param_labels: a pytree of `'muon'`/`'adam'`, or a function of the params
      returning one. Under `optax.inject_hyperparams`, name a function here in
      `static_args`, or it is taken for a schedule.
    weight_decay_mask: a pytree of bools, or a function of the params; None =
      `jaxpipe.optim.weight_decay_mask` (every matrix, no norms or biases).
    dimension_numbers: `MuonDimensionNumbers` for every Muon leaf, or a
      function from the Muon branch's masked tree to a tree of them; None =
      last two axes (in, out).

  Returns:
    An `optax.GradientTransformation`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpipe import optim
    >>> params = {'w': jnp.ones((4, 3, 3)), 'norm': {'scale': jnp.ones(3)}}
    >>> tx = optim.muon(0.02)
    >>> updates, state = tx.update(params, tx.init(params), params)

  References:
    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026

    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024

    Liu et al., `Muon is Scalable for LLM Training
    <https://arxiv.org/abs/2502.16982>`_, 2025

    Amsel et al., `The Polar Express: Optimal Matrix Sign Methods and Their
    Application to the Muon Algorithm <https://arxiv.org/abs/2505.16932>`_,
    2025
  """
  matrix = scale_by_muon(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                         ns_coeffs=ns_coeffs, eps=eps, consistent_rms=consistent_rms,
                         mu_dtype=mu_dtype, dimension_numbers=dimension_numbers)
  return _optimizers.with_adamw(
      matrix, _optimizers.checked_labels(param_labels), main_label="muon",
      learning_rate=learning_rate, adam_learning_rate=adam_learning_rate,
      b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype, weight_decay=weight_decay,
      weight_decay_mask=weight_decay_mask)


def scale_by_muon(
    *,
    momentum: float | jax.Array = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coeffs: str | Sequence[Any] = "jordan",
    eps: float | jax.Array = 1e-8,
    consistent_rms: float | jax.Array | None = 0.2,
    mu_dtype: Any | None = None,
    dimension_numbers: (
        MuonDimensionNumbers | Callable[[Any], Any] | None) = None,
) -> optax.GradientTransformation:
  r"""Muon's direction and its scale for hidden matrices: `muon` without its AdamW group.

  .. math::
    O[t] = s(m, n)\;\mathrm{NS}_5(\beta \hat M[t] + (1-\beta) \hat G[t])

  (Nesterov; `nesterov=False` orthogonalises the bias-corrected momentum
  itself), each matrix of a stack on its own. NS_5 is five quintic
  Newton-Schulz steps with coefficients (3.4445, -4.7750, 2.0315) on the
  Frobenius-normalised matrix (singular values end in roughly [0.7, 1.2], not
  exactly 1: the coefficients trade exactness for speed;
  `ns_coeffs="polar_express"` takes a different quintic per step instead,
  Amsel et al. 2025, whose 5 steps end much closer to 1).

  Update scale s(m, n) (a choice): `consistent_rms=0.2` multiplies the
  orthogonalised update by `0.2 * sqrt(max(m, n))`, which gives it an RMS of
  about 0.2, close to AdamW's (Liu et al. 2025). So one learning rate and one
  weight decay serve both groups: `adam_learning_rate` defaults to
  `learning_rate`, and rates tuned for AdamW carry over. `consistent_rms=None`
  selects Jordan's scale `sqrt(max(1, n / m))` instead, under which Muon wants
  a rate near 0.02 and AdamW a separate one near 3e-3.

  Args:
    momentum: the momentum beta.
    nesterov: Nesterov momentum.
    ns_steps: Newton-Schulz iterations.
    ns_coeffs: `"jordan"` (`NS_COEFFS` at every step), `"polar_express"`
      (`POLAR_EXPRESS_COEFFS`, one row per step, with the paper's 1.01
      normalisation folded into the first), one (a, b, c) for every step, or
      a sequence of them, one per step (the last repeats if `ns_steps` is
      larger; extra rows are ignored).
    eps: guards the normalisation.
    consistent_rms: target RMS of the update, or None for Jordan's scale.
    mu_dtype: dtype of the momentum.
    dimension_numbers: as `muon`'s.

  Returns:
    An `optax.GradientTransformation` (no learning rate, no decay).
  """
  dims_fn = _optimizers.dims_fn_of(dimension_numbers)
  return optax.chain(
      orthogonalised_momentum(
          dims_fn, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
          ns_coeffs=ns_coeffs, eps=eps, mu_dtype=mu_dtype),
      _optimizers.scale_by_shape(dims_fn, consistent_rms),
  )


