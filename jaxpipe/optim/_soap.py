"""SOAP: Adam run in the eigenbasis of Shampoo's preconditioner.

`scale_by_soap` is the direction on hidden matrices; `soap` joins it with
AdamW on the other leaves under the grouping of `_grouping`, as `muon` does.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

from jaxpipe import _target
from jaxpipe.optim import _grouping
from jaxpipe.optim import _optimizers

__all__ = ["MAX_PRECOND_DIM", "ScaleBySoapState", "scale_by_soap", "soap"]

# The eigenbasis is read off products of gradients; the TF32/bf16 passes that
# XLA may use for float32 dots on GPUs would perturb eigenvectors of close
# eigenvalues, so every product here runs at full float32 precision.
_PRECISION = jax.lax.Precision.HIGHEST

# The paper's max_precond_dim: longer sides are not rotated.
MAX_PRECOND_DIM = 10000

# Labels that `soap` preconditions. `param_labels` calls hidden matrices
# 'muon', so both names select the SOAP group.
_MATRIX_LABELS = ("soap", "muon")


class ScaleBySoapState(NamedTuple):
  """State of `scale_by_soap`.

  Every field but `count` is a pytree like the params. For a leaf whose
  dimension numbers make it a stack of m x n matrices with batch shape b
  (b = () for a plain matrix, [L] for stacked layers, [L, E] for experts),
  the leaves are float32 arrays of these shapes:

  Attributes:
    count: calls so far (int32, saturating). Call 0 only initialises the
      preconditioner; call t >= 1 is Adam step t (its bias correction).
    mu: first moment of the gradient in the original space, [*b, m, n].
    nu: second moment of the rotated gradient, [*b, m, n], in the current
      eigenbasis (its rows and columns follow the eigenvectors' order).
    l_factor: L, the average of G G^T, [*b, m, m]; an empty [*b, 0, 0] where
      m > max_precond_dim and that side is not rotated.
    r_factor: R, the average of G^T G, [*b, n, n] (or [*b, 0, 0]).
    q_l: eigenbasis of L, columns by decreasing eigenvalue, shaped like
      `l_factor`.
    q_r: eigenbasis of R, shaped like `r_factor`.
  """
  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  l_factor: optax.Updates
  r_factor: optax.Updates
  q_l: optax.Updates
  q_r: optax.Updates


def _layout(
    shape: tuple[int, ...], dims: MuonDimensionNumbers,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Permutation (batch, reduction, output axes) and the [*b, m, n] shape."""
  ndim = len(shape)
  red = _optimizers.wrap_axes(ndim, dims.reduction_axis)
  out = _optimizers.wrap_axes(ndim, dims.output_axis)
  if not red or not out or set(red) & set(out):
    raise ValueError(f"SOAP needs disjoint, non-empty reduction and output "
                     f"axes; got {dims} for shape {shape}")
  batch = tuple(a for a in range(ndim) if a not in red + out)
  m = math.prod(shape[a] for a in red)
  n = math.prod(shape[a] for a in out)
  return batch + red + out, tuple(shape[a] for a in batch) + (m, n)


def _to_matrices(x: jax.Array, shape, dims) -> jax.Array:
  perm, mat_shape = _layout(shape, dims)
  return jnp.transpose(x, perm).reshape(mat_shape)


def _from_matrices(y: jax.Array, shape, dims) -> jax.Array:
  perm, _ = _layout(shape, dims)
  y = y.reshape(tuple(shape[a] for a in perm))
  return jnp.transpose(y, tuple(int(a) for a in np.argsort(perm)))


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.matmul(a, b, precision=_PRECISION)


def _t(a: jax.Array) -> jax.Array:
  return jnp.swapaxes(a, -1, -2)


def _rotated(side: jax.Array) -> bool:
  # A side longer than max_precond_dim holds an empty [..., 0, 0] factor.
  return side.shape[-1] > 0


def _project(x, q_l, q_r):
  """Q_L^T X Q_R, leaving out sides that are not rotated."""
  if _rotated(q_l):
    x = _mm(_t(q_l), x)
  if _rotated(q_r):
    x = _mm(x, q_r)
  return x


def _project_back(x, q_l, q_r):
  """Q_L X Q_R^T, leaving out sides that are not rotated."""
  if _rotated(q_l):
    x = _mm(q_l, x)
  if _rotated(q_r):
    x = _mm(x, _t(q_r))
  return x


def _factors(g, l_factor, r_factor, beta):
  """L = beta L + (1-beta) G G^T and R = beta R + (1-beta) G^T G."""
  if _rotated(l_factor):
    l_factor = beta * l_factor + (1 - beta) * _mm(g, _t(g))
  if _rotated(r_factor):
    r_factor = beta * r_factor + (1 - beta) * _mm(_t(g), g)
  return l_factor, r_factor


def _per_matrix(fn, x):
  """`fn(x)` for a LAPACK decomposition `fn`, one matrix per call on the CPU.

  jaxlib's CPU kernels spread a batch of matrices over XLA's intra-op thread
  pool and block the calling pool thread until the batch is done. With
  several emulated devices in one process, every pool thread can end up
  blocked in such a wait with no thread left to do the work: 2bw with SOAP on
  2 emulated devices and 2 cores never finished its first step. A call with
  one matrix runs inline, so on the CPU the batch goes through `lax.map`; other
  backends keep the batched call. The results are the same: the kernel
  decomposes each matrix of a batch on its own.
  """
  if x.ndim == 2 or _target.platform() != "cpu":
    return fn(x)
  batch = x.shape[:-2]
  out = jax.lax.map(fn, x.reshape(-1, *x.shape[-2:]))
  return jax.tree.map(lambda y: y.reshape(*batch, *y.shape[1:]), out)


def _eigenbasis(factor):
  """Eigenvectors of a factor by decreasing eigenvalue (the first call's)."""
  if not _rotated(factor):
    return factor
  _, vectors = _per_matrix(jnp.linalg.eigh, factor)   # ascending eigenvalues
  return vectors[..., ::-1]


def _power_step(factor, q, nu, axis):
  """One power iteration and QR from the old basis (the paper's refresh).

  The old columns are first put in decreasing order of their estimated
  eigenvalues q_i^T F q_i, and the axis of nu that they index is permuted the
  same way, so each second moment stays with its eigenvector.
  """
  if not _rotated(factor):
    return q, nu
  fq = _mm(factor, q)
  estimate = jnp.sum(q * fq, axis=-2)            # [*b, k]
  order = jnp.argsort(-estimate, axis=-1)        # stable: ties keep order
  fq = jnp.take_along_axis(fq, order[..., None, :], axis=-1)
  index = order[..., :, None] if axis == -2 else order[..., None, :]
  nu = jnp.take_along_axis(nu, index, axis=axis)
  q, _ = _per_matrix(jnp.linalg.qr, fq)
  return q, nu


def _static_int(value: Any, name: str) -> int:
  try:
    return int(value)
  except jax.errors.ConcretizationTypeError as e:
    raise ValueError(
        f"SOAP's {name} decides the state's shapes and must be known while "
        f"tracing; under optax.inject_hyperparams pass "
        f"static_args=('{name}',)") from e


def _split(tree_of_tuples: Any, like: Any, size: int) -> list[Any]:
  """A tree with k-tuples at `like`'s leaves, as k trees shaped like `like`."""
  return [jax.tree.map(lambda _, t, i=i: t[i], like, tree_of_tuples)
          for i in range(size)]


def scale_by_soap(
    *,
    b1: float | jax.Array = 0.95,
    b2: float | jax.Array = 0.95,
    shampoo_beta: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-8,
    precondition_frequency: int | jax.Array = 10,
    max_precond_dim: int | None = None,
    dimension_numbers: (
        MuonDimensionNumbers | Callable[[Any], Any] | None) = None,
) -> optax.GradientTransformation:
  r"""SOAP's direction: Adam in the eigenbasis of Shampoo's factors.

  Update rule for each m x n matrix G[t] of every leaf (stacks matrix by
  matrix), with count t of earlier calls:

  .. math::
    L \leftarrow \beta_s L + (1-\beta_s) G G^T, \quad
    R \leftarrow \beta_s R + (1-\beta_s) G^T G;

  call 0 sets Q_L, Q_R to the eigenvectors of L, R (`eigh`, decreasing
  eigenvalues) and returns a zero direction (rotating the first gradient into
  its own eigenbasis would make it diagonal up to rounding, and Adam's
  sign-like first step would amplify that rounding). Call t >= 1, before its
  own L, R update:

  .. math::
    G' = Q_L^T G Q_R, \quad M \leftarrow \beta_1 M + (1-\beta_1) G, \quad
    V \leftarrow \beta_2 V + (1-\beta_2) G' \odot G', \\
    D = Q_L \frac{Q_L^T M Q_R / (1-\beta_1^t)}
               {\sqrt{V / (1-\beta_2^t)} + \epsilon} Q_R^T,

  then, when t is a multiple of `precondition_frequency`, each basis takes
  one power-iteration step from the new factor, `Q <- QR(F Q)`, after its
  columns (and V's matching axis) are ordered by decreasing `q^T F q`.
  M stays in the original space and is rotated anew each call, so it is not
  disturbed when the basis changes. A side longer than `max_precond_dim` is
  not rotated (Q = I, no factor kept).

  State: `ScaleBySoapState`, all float32. Memory per m x n matrix:
  2 (m^2 + n^2) for the factors and bases plus 2 m n for the moments.

  Reproducibility: where a factor has a repeated eigenvalue, above all the
  null space that the first call leaves when a side is longer than the other
  by two or more (an [in, out] = [D, 4D] kernel leaves R one of dimension
  3D), any orthonormal basis of it is an eigenbasis; `eigh` (and later the
  QR of near-zero columns) picks one by rounding, and the next sign-like Adam
  step depends on it. Runs that differ only in rounding (another device,
  mesh or fusion) can then drift apart faster than under AdamW, as with the
  paper's code. Losses stay comparable; weights are not equal to float32
  rounding.

  Args:
    b1: decay of the first moment.
    b2: decay of the rotated second moment.
    shampoo_beta: decay of the factors L and R.
    eps: added to the denominator after the bias correction, `m_hat / (sqrt(v_hat) +
      eps)` as optax's Adam (the paper's code adds it to `sqrt(v)` before, which is
      this rule with `eps / sqrt(1 - b2^t)` for eps).
    precondition_frequency: calls between eigenbasis refreshes.
    max_precond_dim: sides longer than this are not rotated; None =
      `MAX_PRECOND_DIM` (10000, the paper's). It sets the state's shapes, so
      it must be static: `optax.inject_hyperparams` turns every number it is
      given into a traced array, hence None rather than 10000 as the
      default; if you pass a number there, name it in `static_args`.
    dimension_numbers: `MuonDimensionNumbers` for every leaf, or a function
      from the (masked) tree to a tree of them; None = last two axes
      (in, out), leading axes a stack.

  Returns:
    An `optax.GradientTransformation`.

  References:
    Vyas et al., `SOAP: Improving and Stabilizing Shampoo using Adam
    <https://arxiv.org/abs/2409.11321>`_, 2024
  """
  dims_fn = _optimizers.dims_fn_of(dimension_numbers)
  if isinstance(precondition_frequency, int) and precondition_frequency < 1:
    raise ValueError(f"precondition_frequency must be >= 1, got {precondition_frequency}")

  def init_fn(params):
    max_dim = (MAX_PRECOND_DIM if max_precond_dim is None
               else _static_int(max_precond_dim, "max_precond_dim"))
    if max_dim < 0:
      raise ValueError(f"max_precond_dim must be >= 0, got {max_dim}")
    leaves = jax.tree.map(functools.partial(_init_leaf, max_dim=max_dim), params,
                          dims_fn(params))
    return ScaleBySoapState(jnp.zeros([], jnp.int32), *_split(leaves, params, 6))

  def update_fn(updates, state, params=None):
    del params
    dims = dims_fn(updates)
    beta1, beta2, beta_s, epsilon = (
        jnp.asarray(x, jnp.float32) for x in (b1, b2, shampoo_beta, eps))
    grads = jax.tree.map(
        lambda g, d: _to_matrices(g.astype(jnp.float32), g.shape, d), updates, dims)
    fields = (state.mu, state.nu, state.l_factor, state.r_factor, state.q_l, state.q_r)
    later = functools.partial(_later_call, count=state.count, beta1=beta1, beta2=beta2,
                              beta_s=beta_s, eps=epsilon,
                              precondition_frequency=precondition_frequency)
    direction, fields = jax.lax.cond(
        state.count == 0, functools.partial(_first_call, beta_s=beta_s), later,
        (grads, fields))
    direction = jax.tree.map(
        lambda u, g, d: _from_matrices(u, g.shape, d).astype(g.dtype),
        direction, updates, dims)
    return direction, ScaleBySoapState(optax.safe_increment(state.count), *fields)

  return optax.GradientTransformation(init_fn, update_fn)


def _init_leaf(p: jax.Array, dims: MuonDimensionNumbers, *, max_dim: int) -> tuple:
  """One leaf's (mu, nu, L, R, Q_L, Q_R) before any gradient, all float32."""
  f32 = jnp.float32
  # zeros_like keeps the parameter's sharding (default dimension numbers
  # make the transpose and reshape no-ops).
  mu = _to_matrices(jnp.zeros_like(p, dtype=f32), p.shape, dims)
  batch, (m, n) = mu.shape[:-2], mu.shape[-2:]
  side = lambda k: k if k <= max_dim else 0
  factor = lambda k: jnp.zeros(batch + (side(k), side(k)), f32)
  basis = lambda k: jnp.broadcast_to(jnp.eye(side(k), dtype=f32),
                                     batch + (side(k), side(k)))
  return mu, mu, factor(m), factor(n), basis(m), basis(n)


def _first_call(operand, *, beta_s):
  """Call 0: the factors and their eigenbases from the first gradient; a zero direction."""
  # No basis exists before the first gradient, so (as the paper) this
  # call only builds the preconditioner and its direction is zero.
  grads, (mu, nu, l_f, r_f, _, _) = operand

  def leaf(g, l_f, r_f):
    l_f, r_f = _factors(g, l_f, r_f, beta_s)
    return l_f, r_f, _eigenbasis(l_f), _eigenbasis(r_f)

  l_f, r_f, q_l, q_r = _split(
      jax.tree.map(leaf, grads, l_f, r_f), grads, 4)
  return jax.tree.map(jnp.zeros_like, grads), (mu, nu, l_f, r_f, q_l, q_r)


def _later_call(operand, *, count, beta1, beta2, beta_s, eps, precondition_frequency):
  """Call t >= 1: Adam's direction in the current bases, then the factors' update and,
  every `precondition_frequency` calls, the bases' refresh."""
  grads, (mu, nu, l_f, r_f, q_l, q_r) = operand
  t = count.astype(jnp.float32)
  bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t

  def leaf(g, mu, nu, l_f, r_f, q_l, q_r):
    rotated = _project(g, q_l, q_r)
    mu = beta1 * mu + (1 - beta1) * g
    nu = beta2 * nu + (1 - beta2) * rotated * rotated
    step = (_project(mu, q_l, q_r) / bc1) / (jnp.sqrt(nu / bc2) + eps)
    l_f, r_f = _factors(g, l_f, r_f, beta_s)
    return _project_back(step, q_l, q_r), mu, nu, l_f, r_f

  direction, mu, nu, l_f, r_f = _split(
      jax.tree.map(leaf, grads, mu, nu, l_f, r_f, q_l, q_r), grads, 5)
  nu, l_f, r_f, q_l, q_r = jax.lax.cond(
      count % precondition_frequency == 0, _refresh, lambda x: x,
      (nu, l_f, r_f, q_l, q_r))
  return direction, (mu, nu, l_f, r_f, q_l, q_r)


def _refresh(operand):
  """One power-iteration step of each basis from its factor (V's axes reordered with it)."""
  nu, l_f, r_f, q_l, q_r = operand

  def leaf(nu, l_f, r_f, q_l, q_r):
    q_l, nu = _power_step(l_f, q_l, nu, axis=-2)
    q_r, nu = _power_step(r_f, q_r, nu, axis=-1)
    return nu, q_l, q_r

  nu, q_l, q_r = _split(
      jax.tree.map(leaf, nu, l_f, r_f, q_l, q_r), nu, 3)
  return nu, l_f, r_f, q_l, q_r


def checked_labels(labels: Any) -> Callable[[Any], Any]:
  """Resolves labels to 'soap' / 'adam', refusing SOAP leaves below 2-D."""
  labels = _grouping.param_labels if labels is None else labels

  def resolved(params):
    tree = _grouping.resolve(labels, params)

    def check(path, label, p):
      if label not in _MATRIX_LABELS + ("adam",):
        raise ValueError(f"param label {label!r} at "
                         f"{jax.tree_util.keystr(path)} is not 'soap' (or "
                         "'muon') nor 'adam'")
      if label != "adam" and p.ndim < 2:
        raise ValueError(f"SOAP needs a matrix (or a stack of matrices) at "
                         f"{jax.tree_util.keystr(path)}, got shape {p.shape}")
      return "adam" if label == "adam" else "soap"

    return jax.tree_util.tree_map_with_path(check, tree, params)

  return resolved


def soap(
    learning_rate: _optimizers.ScalarOrSchedule,
    *,
    adam_learning_rate: _optimizers.ScalarOrSchedule | None = None,
    b1: float | jax.Array = 0.95,
    b2: float | jax.Array = 0.95,
    shampoo_beta: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-8,
    weight_decay: float | jax.Array = 0.1,
    precondition_frequency: int | jax.Array = 10,
    max_precond_dim: int | None = None,
    mu_dtype: Any | None = None,
    param_labels: Any | None = None,
    weight_decay_mask: _optimizers.Mask | None = None,
    dimension_numbers: (
        MuonDimensionNumbers | Callable[[Any], Any] | None) = None,
) -> optax.GradientTransformation:
  r"""SOAP for hidden matrices, AdamW for embeddings, head, norms and biases.

  Update rule for a hidden matrix W (each matrix of a stack on its own) with
  gradient G: Shampoo's factors `L = b_s L + (1-b_s) G G^T`,
  `R = b_s R + (1-b_s) G^T G`, their eigenbases Q_L, Q_R, and Adam in the
  rotated space (see `scale_by_soap`):

  .. math::
    W \leftarrow W - \eta\,\big(Q_L \tfrac{\hat M'}{\sqrt{\hat V'} + \epsilon}
      Q_R^T + \lambda W\big), \qquad M' = Q_L^T M Q_R,

  with M the gradient's first moment (kept in the original space), V' the
  second moment of the rotated gradient `Q_L^T G Q_R`, hats Adam's bias
  corrections, eta the learning rate and lambda the decoupled weight decay.
  The bases are computed by `eigh` on the first call and refreshed every
  `precondition_frequency` calls by one power-iteration step and a QR
  decomposition (the paper's Algorithm 4). Sides longer than
  `max_precond_dim` are not rotated.

  First call (as the paper): it only initialises L, R and the bases, so the
  hidden matrices move by the weight decay alone; Adam's moments and bias
  correction start at the second call. The AdamW leaves step from the
  first call, exactly as `optax.adamw`. (Why the zero first step: `scale_by_soap`.)

  Reproducibility under rounding (repeated eigenvalues): see `scale_by_soap`.

  Grouping as `muon`: `param_labels` (default `jaxpipe.optim.param_labels`,
  whose 'muon' leaves are SOAP's; 'soap' is accepted too) and
  `dimension_numbers` (last two axes (in, out); stacked layers [L, D, F] and
  experts [L, E, D, F] are preconditioned matrix by matrix).

  Where this differs from the paper's code: eps (see `scale_by_soap`); the
  decay acts on the weights before the step (optax's `add_decayed_weights`) rather than after it; the AdamW
  leaves take their first step on the first call.

  State: `(PartitionState{soap: ScaleBySoapState, adam: ScaleByAdamState},
  decay state, PartitionState of the learning-rate scalings)`. Memory per
  m x n matrix, float32: L and R (m^2 + n^2), Q_L and Q_R (m^2 + n^2), and
  the two moments (2 m n); AdamW leaves two moments each.

  Defaults are the paper's (betas 0.95, shampoo_beta = b2, eps 1e-8,
  refresh every 10 steps, max_precond_dim 10000), except the weight decay,
  0.1 as in jaxpipe's other optimizers (the paper's code defaults to 0.01).

  Args:
    learning_rate: SOAP's rate (a scalar or an `optax.Schedule`).
    adam_learning_rate: AdamW's rate; None = `learning_rate` (SOAP's steps
      are Adam-sized, so one rate serves both).
    b1: first-moment decay (both groups).
    b2: second-moment decay (both groups).
    shampoo_beta: decay of the factors L and R.
    eps: added to the denominator (both groups).
    weight_decay: decoupled decay lambda, multiplied by each group's rate.
    precondition_frequency: calls between eigenbasis refreshes.
    max_precond_dim: sides longer than this are not rotated; None = 10000
      (static: see `scale_by_soap`).
    mu_dtype: dtype of AdamW's first moment; SOAP's state is float32.
    param_labels: a pytree of `'soap'` (or `'muon'`) / `'adam'`, or a
      function of the params returning one. Under
      `optax.inject_hyperparams`, name a function here in `static_args`.
    weight_decay_mask: a pytree of bools, or a function of the params; None =
      `jaxpipe.optim.weight_decay_mask` (every matrix, no norms or biases).
    dimension_numbers: `MuonDimensionNumbers` for every SOAP leaf, or a
      function from the SOAP branch's masked tree to a tree of them.

  Returns:
    An `optax.GradientTransformation`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpipe import optim
    >>> params = {'w': jnp.ones((2, 3, 2)), 'norm': {'scale': jnp.ones(2)}}
    >>> tx = optim.soap(3e-3)
    >>> updates, state = tx.update(params, tx.init(params), params)
    >>> updates['w'].shape
    (2, 3, 2)

  References:
    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026

    Vyas et al., `SOAP: Improving and Stabilizing Shampoo using Adam
    <https://arxiv.org/abs/2409.11321>`_, 2024
  """
  return _optimizers.with_adamw(
      scale_by_soap(b1=b1, b2=b2, shampoo_beta=shampoo_beta, eps=eps,
                    precondition_frequency=precondition_frequency,
                    max_precond_dim=max_precond_dim, dimension_numbers=dimension_numbers),
      checked_labels(param_labels), main_label="soap", learning_rate=learning_rate,
      adam_learning_rate=adam_learning_rate, b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype,
      weight_decay=weight_decay, weight_decay_mask=weight_decay_mask)
