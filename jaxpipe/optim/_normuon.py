"""NorMuon: Muon with a per-neuron second moment (Li et al. 2025)."""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from jaxpipe.optim import _muon
from jaxpipe.optim import _optimizers

__all__ = ["ScaleByNeuronRmsState", "normuon", "scale_by_neuron_rms"]

_is_dims = lambda x: isinstance(x, MuonDimensionNumbers)


class ScaleByNeuronRmsState(NamedTuple):
  """State of `scale_by_neuron_rms`.

  Attributes:
    nu: per output neuron, the moving average of the mean square of the
      update over its inputs: a leaf shaped like the param with the reduction
      (input) axes of size 1, e.g. [L, 1, F] for stacked kernels [L, D, F];
      at least float32.
  """
  nu: optax.Updates


def scale_by_neuron_rms(
    dims_fn: Callable[[Any], Any],
    *,
    b2: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-8,
) -> optax.GradientTransformation:
  r"""Normalises each output neuron of an update by its running RMS.

  For an update O (one matrix; with the dimension numbers from `dims_fn`,
  any stack of them matrix by matrix), reduction size m and output size n:

  .. math::
    v_t = \beta_2 v_{t-1} + (1-\beta_2)\, \mathrm{mean}_{in}(O_t \odot O_t),
    \quad \hat O_t = O_t / (\sqrt{v_t} + \epsilon), \quad
    \mathrm{out} = \sqrt{\min(m, n)}\; \hat O_t / (\|\hat O_t\|_F + \epsilon).

  The last step gives the output the Frobenius norm of an exactly
  semi-orthogonal m x n matrix, so Muon's shape scaling after it means what
  it means for Muon (`consistent_rms` 0.2: an RMS of exactly 0.2). No bias
  correction of v: the Frobenius rescaling cancels any scalar one.

  Args:
    dims_fn: from the (masked) updates to a tree of `MuonDimensionNumbers`.
    b2: decay of the per-neuron second moment.
    eps: added to sqrt(v) and to the norm.

  Returns:
    An `optax.GradientTransformation` with state `ScaleByNeuronRmsState`.
  """

  def axes(x, dims):
    # Reduction axes, and reduction + output axes, both normalised.
    red = _optimizers.wrap_axes(x.ndim, dims.reduction_axis)
    out = _optimizers.wrap_axes(x.ndim, dims.output_axis)
    return red, red + out

  def init_fn(params):
    def zeros(p, dims):
      wide = jnp.promote_types(p.dtype, jnp.float32)
      # Summing zeros (rather than zeros(shape)) keeps p's sharding on the
      # axes that remain, e.g. `stage` on stacked blocks.
      return jnp.sum(jnp.zeros_like(p, dtype=wide), axis=axes(p, dims)[0],
                     keepdims=True)
    return ScaleByNeuronRmsState(
        nu=jax.tree.map(zeros, params, dims_fn(params)))

  def update_fn(updates, state, params=None):
    del params
    dims = dims_fn(updates)

    def second_moment(o, nu, d):
      sq = jnp.square(o.astype(nu.dtype))
      return b2 * nu + (1 - b2) * jnp.mean(sq, axis=axes(o, d)[0],
                                           keepdims=True)

    def normalised(o, nu, d):
      o_hat = o.astype(nu.dtype) / (jnp.sqrt(nu) + eps)
      fan_in, fan_out = _optimizers.fans(o.shape, d)
      norm = jnp.sqrt(jnp.sum(jnp.square(o_hat), axis=axes(o, d)[1],
                              keepdims=True))
      o_hat = o_hat * (math.sqrt(min(fan_in, fan_out)) / (norm + eps))
      return o_hat.astype(o.dtype)

    nu = jax.tree.map(second_moment, updates, state.nu, dims)
    return (jax.tree.map(normalised, updates, nu, dims),
            ScaleByNeuronRmsState(nu=nu))

  return optax.GradientTransformation(init_fn, update_fn)


def normuon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    momentum: float | jax.Array = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coeffs: str | Sequence[Any] = "jordan",
    neuron_b2: float | jax.Array = 0.95,
    consistent_rms: float | jax.Array | None = 0.2,
    weight_decay: float | jax.Array = 0.1,
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-8,
    mu_dtype: Any | None = None,
    param_labels: Any | Callable[[Any], Any] | None = None,
    weight_decay_mask: Any | Callable[[Any], Any] | None = None,
    dimension_numbers: (
        MuonDimensionNumbers | Callable[[Any], Any] | None) = None,
) -> optax.GradientTransformation:
  r"""NorMuon for hidden matrices, AdamW for embeddings, head, norms, biases.

  Update rule for a hidden matrix W of m inputs and n outputs (each matrix
  of a stack on its own), with O[t] Muon's orthogonalised momentum (see
  `jaxpipe.optim.muon`: Nesterov momentum, `ns_steps` Newton-Schulz steps
  with `ns_coeffs`):

  .. math::
    v[t] = \beta_2 v[t-1] + (1-\beta_2)\, \mathrm{mean}_{in}(O[t]^2), \quad
    \hat O[t] = O[t] / (\sqrt{v[t]} + \epsilon), \\
    W[t+1] = W[t] - \eta \Big(0.2 \sqrt{mn}\;
      \frac{\hat O[t]}{\|\hat O[t]\|_F} + \lambda W[t]\Big),

  v holding one number per output neuron. In flax's [in, out] kernels an
  output neuron is a column, so the mean runs over the input axis (the
  paper's torch [out, in] weights make it a row). 0.2 is `consistent_rms`:
  the update has exactly that RMS, the paper's rescaling and the convention
  of jaxpipe's `muon` (about 0.2, like AdamW's); `consistent_rms=None`
  scales to Muon's Frobenius norm sqrt(min(m, n)) and then by Jordan's
  `sqrt(max(1, n / m))`. Other leaves take AdamW, exactly as in `muon`.

  What differs from the paper: the momentum is `muon`'s (Nesterov by default,
  with optax's bias correction; `nesterov=False` is the paper's plain
  M[t] = b1 M[t-1] + (1 - b1) G[t], whose scale does not matter to the
  orthogonalisation), and epsilon also guards the Frobenius division. Its
  defaults otherwise: momentum 0.95, second-moment decay 0.95, eps 1e-8.

  State: `(PartitionState{muon: (MuonState, ScaleByNeuronRmsState, empty),
  adam: ScaleByAdamState}, decay state, PartitionState of the rates)`.
  Memory: Muon's momentum per hidden matrix plus one float32 number per
  output neuron (n per m x n matrix, so about 1x params as for Muon).

  Args:
    learning_rate: NorMuon's rate (a scalar or an `optax.Schedule`).
    adam_learning_rate: AdamW's rate; None = `learning_rate`.
    momentum: Muon's momentum beta.
    nesterov: Nesterov momentum.
    ns_steps: Newton-Schulz iterations.
    ns_coeffs: as in `muon`: `"jordan"`, `"polar_express"` or coefficients.
    neuron_b2: decay of the per-neuron second moment.
    consistent_rms: RMS of the update, or None for Jordan's scale.
    weight_decay: decoupled decay lambda, multiplied by each group's rate.
    b1: AdamW's first-moment decay.
    b2: AdamW's second-moment decay.
    eps: AdamW's epsilon; also guards the normalisations.
    mu_dtype: dtype of the momentum and AdamW's first moment.
    param_labels: as in `muon`.
    weight_decay_mask: as in `muon`.
    dimension_numbers: as in `muon`; the reduction axes are the inputs that
      the per-neuron mean runs over.

  Returns:
    An `optax.GradientTransformation`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpipe import optim
    >>> params = {'w': jnp.ones((4, 3, 3)), 'norm': {'scale': jnp.ones(3)}}
    >>> tx = optim.normuon(0.02)
    >>> updates, state = tx.update(params, tx.init(params), params)

  References:
    Li et al., `NorMuon: Making Muon more efficient and scalable
    <https://arxiv.org/abs/2510.05491>`_, 2025

    Zmushko et al., `One-Step Gradient Delay is Not a Barrier for Large-Scale
    Asynchronous Pipeline Parallel LLM Pretraining
    <https://arxiv.org/abs/2606.30634>`_, 2026
  """

  dims_fn = _optimizers.dims_fn_of(dimension_numbers)
  matrix = optax.chain(
      _muon.orthogonalised_momentum(
          dims_fn, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
          ns_coeffs=ns_coeffs, eps=eps, mu_dtype=mu_dtype),
      scale_by_neuron_rms(dims_fn, b2=neuron_b2, eps=eps),
      _optimizers.scale_by_shape(dims_fn, consistent_rms),
  )
  return _optimizers.with_adamw(
      matrix, _optimizers.checked_labels(param_labels), main_label="muon",
      learning_rate=learning_rate, adam_learning_rate=adam_learning_rate,
      b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype, weight_decay=weight_decay,
      weight_decay_mask=weight_decay_mask)
