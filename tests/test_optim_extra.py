"""MARS, NorMuon, Polar Express coefficients and weight prediction, by hand.

Every reference here is written out in numpy (float64) from the papers'
formulas, independently of the code under test; comparisons are float32.
"""

import doctest
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from jaxpipe import optim
from jaxpipe.config import OptimizerConfig
from jaxpipe.optim import AdanConfig, LionConfig, MarsConfig, MuonConfig, NorMuonConfig
from jaxpipe.config import load as load_config
from jaxpipe.errors import ConfigError
from jaxpipe.optim import _optimizers
from tests import test_optim as base

TOL = base.TOL
JORDAN = [(3.4445, -4.7750, 2.0315)] * 5

# A stacked hidden kernel [L=2, in=3, out=2], an embedding, a norm scale.
HAND_SHAPES = {"blocks": {"mlp": {"kernel": (2, 3, 2)}},
               "embed": {"embedding": (4, 3)},
               "norm": {"scale": (3,)}}


def _hand_case(steps=2):
  """Params and `steps` gradients; the kernel's two matrices get gradients of
  very different norms (one clipped by MARS, one not)."""
  params = base._tree_of(HAND_SHAPES, 7)
  grads = []
  for s in range(steps):
    g = base._tree_of(HAND_SHAPES, 20 + s)
    kernel = g["blocks"]["mlp"]["kernel"]
    g["blocks"]["mlp"]["kernel"] = kernel * jnp.array([3.0, 0.1])[:, None, None]
    grads.append(g)
  return params, grads


def _np(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _np_adamw(gs, p, lr, wd, b1, b2, eps=1e-8):
  """AdamW's updates (optax sign) for a gradient sequence, params held."""
  m, v, out = 0.0, 0.0, []
  for t, g in enumerate(gs, start=1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    out.append(-lr * (step + wd * p))
  return out


def _np_mars(gs, p, lr, wd, gamma=0.025, b1=0.95, b2=0.99, per_matrix=True):
  """MARS-AdamW (Yuan et al. 2024, Algorithm 1, approximate form)."""
  cs, prev = [], None
  for g in gs:
    c = g if prev is None else g + gamma * b1 / (1 - b1) * (g - prev)
    axes = (-2, -1) if per_matrix else None
    norm = np.sqrt(np.sum(c * c, axis=axes, keepdims=True))
    cs.append(np.where(norm > 1, c / norm, c))
    prev = g
  return _np_adamw(cs, p, lr, wd, b1, b2)


def _np_ns(x, rows, eps=1e-8):
  """Quintic Newton-Schulz, one (a, b, c) per row, Frobenius-normalised."""
  x = np.asarray(x, np.float64)
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  x = x / (np.linalg.norm(x) + eps)
  for a, b, c in rows:
    s = x @ x.T
    x = a * x + (b * s + c * s @ s) @ x
  return x.T if tall else x


def _np_nesterov(gs, beta=0.95):
  """Muon's Nesterov momentum with optax's bias corrections."""
  mu, out = 0.0, []
  for t, g in enumerate(gs, start=1):
    mu = beta * mu + (1 - beta) * g
    out.append(beta * mu / (1 - beta**(t + 1)) + (1 - beta) * g / (1 - beta**t))
  return out


def _np_normuon(gs, p, lr, wd, b2=0.95, eps=1e-8):
  """NorMuon (Li et al. 2025) on one [in, out] matrix: per output column."""
  fan_in, fan_out = p.shape
  v, out = np.zeros((1, fan_out)), []
  for d in _np_nesterov(gs):
    o = _np_ns(d, JORDAN)
    v = b2 * v + (1 - b2) * np.mean(o * o, axis=0, keepdims=True)
    o_hat = o / (np.sqrt(v) + eps)
    # The paper's eta_hat = 0.2 eta sqrt(mn) / ||O_hat||_F.
    scale = 0.2 * np.sqrt(fan_in * fan_out) / np.linalg.norm(o_hat)
    out.append(-lr * (scale * o_hat + wd * p))
  return out


def _per_matrix(fn, gs, p, **kw):
  """Applies a one-matrix reference to each matrix of a stacked leaf."""
  per = [fn([g[i] for g in gs], p[i], **kw) for i in range(p.shape[0])]
  return [np.stack([per[i][t] for i in range(p.shape[0])])
          for t in range(len(gs))]


def _close(got, want, **tol):
  np.testing.assert_allclose(np.asarray(got, np.float64), want, **(tol or TOL))


def _find(state, cls):
  """The one state of type `cls` anywhere in an optimizer state."""
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, cls))
           if isinstance(s, cls)]
  assert len(found) == 1, found
  return found[0]


# --------------------------------------------------------------------------
# MARS

def test_mars_labels():
  params, _ = _hand_case()
  assert optim.mars_labels(params) == {
      "blocks": {"mlp": {"kernel": "mars"}}, "embed": {"embedding": "mars"},
      "norm": {"scale": "adam"}}
  assert optim.mars_labels(base.compact_tree())["blocks"] == {
      "attn": {"q": {"kernel": "mars"}}, "attn_norm": {"scale": "adam"},
      "moe": {"router": {"kernel": "mars"}, "gate": {"kernel": "mars"}}}


def test_mars_two_steps_by_hand():
  params, grads = _hand_case()
  lr, wd = 0.1, 0.01
  updates, states = base.run(optim.mars(lr, weight_decay=wd), grads, params)
  p, gs = _np(params), [_np(g) for g in grads]
  want = {
      "kernel": _np_mars([g["blocks"]["mlp"]["kernel"] for g in gs],
                         p["blocks"]["mlp"]["kernel"], lr, wd),
      "embedding": _np_mars([g["embed"]["embedding"] for g in gs],
                            p["embed"]["embedding"], lr, wd),
      # Norms: AdamW (0.9, 0.95), no decay.
      "scale": _np_adamw([g["norm"]["scale"] for g in gs],
                         p["norm"]["scale"], lr, 0.0, 0.9, 0.95),
  }
  for t in range(2):
    _close(updates[t]["blocks"]["mlp"]["kernel"], want["kernel"][t])
    _close(updates[t]["embed"]["embedding"], want["embedding"][t])
    _close(updates[t]["norm"]["scale"], want["scale"][t])
  # The second step's correction matters: without it the numbers differ.
  no_corr = _np_mars([g["embed"]["embedding"] for g in gs],
                     p["embed"]["embedding"], lr, wd, gamma=0.0)
  assert np.max(np.abs(no_corr[1] - want["embedding"][1])) > 1e-4
  mars_state = _find(states[-1], optim.ScaleByMarsState)
  assert int(mars_state.count) == 2
  np.testing.assert_array_equal(mars_state.prev_grad["embed"]["embedding"],
                                grads[1]["embed"]["embedding"])


def test_mars_stacked_leaf_is_two_matrices():
  params, grads = _hand_case()
  kernel = lambda t: t["blocks"]["mlp"]["kernel"]
  stacked = {"w": kernel(params)}
  split = {"w0": kernel(params)[0], "w1": kernel(params)[1]}
  tx = optim.mars(0.1)
  got, _ = base.run(tx, [{"w": kernel(g)} for g in grads], stacked)
  sep, _ = base.run(tx, [{"w0": kernel(g)[0], "w1": kernel(g)[1]}
                         for g in grads], split)
  gs = [np.asarray(kernel(g), np.float64) for g in grads]
  p = np.asarray(kernel(params), np.float64)
  want = _per_matrix(_np_mars, gs, p, lr=0.1, wd=0.01)
  for t in range(2):
    _close(got[t]["w"][0], sep[t]["w0"])
    _close(got[t]["w"][1], sep[t]["w1"])
    _close(got[t]["w"], want[t])
  # Negative control: one clip over the whole stack gives other numbers.
  whole = _np_mars(gs, p, 0.1, 0.01, per_matrix=False)
  assert np.max(np.abs(whole[1] - want[1])) > 1e-3


def test_mars_without_correction_or_clip_is_adamw():
  params, grads = _hand_case(3)
  tx = optim.mars(0.01, gamma=0.0, b1=0.9, b2=0.95, clip_threshold=None,
                  weight_decay=0.1)
  want = optax.adamw(0.01, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                     mask=optim.weight_decay_mask)
  got, _ = base.run(tx, grads, params)
  ref, _ = base.run(want, grads, params)
  for a, b in zip(got, ref):
    base.assert_trees_close(a, b)


def test_mars_bf16_params_keep_dtype_with_float32_state():
  params = base.small_tree(jnp.bfloat16, jnp.float32)
  tx = optim.mars(0.01)
  updates, states = base.run(tx, [base.grads_like(params, s) for s in range(2)],
                             params)
  for u in updates:
    assert base._spec(u) == base._spec(params)
  mars_state = _find(states[-1], optim.ScaleByMarsState)
  assert mars_state.mu["blocks"]["mlp"]["kernel"].dtype == jnp.float32
  assert mars_state.prev_grad["embed"]["embedding"].dtype == jnp.float32


# --------------------------------------------------------------------------
# NorMuon

def test_normuon_two_steps_by_hand():
  params, grads = _hand_case()
  lr, wd = 0.1, 0.1
  updates, _ = base.run(optim.normuon(lr, weight_decay=wd), grads, params)
  p, gs = _np(params), [_np(g) for g in grads]
  kernel = _per_matrix(_np_normuon, [g["blocks"]["mlp"]["kernel"] for g in gs],
                       p["blocks"]["mlp"]["kernel"], lr=lr, wd=wd)
  embedding = _np_adamw([g["embed"]["embedding"] for g in gs],
                        p["embed"]["embedding"], lr, wd, 0.9, 0.95)
  scale = _np_adamw([g["norm"]["scale"] for g in gs], p["norm"]["scale"], lr,
                    0.0, 0.9, 0.95)
  for t in range(2):
    _close(updates[t]["blocks"]["mlp"]["kernel"], kernel[t])
    _close(updates[t]["embed"]["embedding"], embedding[t])
    _close(updates[t]["norm"]["scale"], scale[t])


def test_normuon_stacked_leaf_is_two_matrices():
  params, grads = _hand_case()
  kernel = lambda t: t["blocks"]["mlp"]["kernel"]
  tx = optim.normuon(0.1)
  got, _ = base.run(tx, [{"w": kernel(g)} for g in grads],
                    {"w": kernel(params)})
  sep, _ = base.run(tx, [{"w0": kernel(g)[0], "w1": kernel(g)[1]}
                         for g in grads],
                    {"w0": kernel(params)[0], "w1": kernel(params)[1]})
  for t in range(2):
    _close(got[t]["w"][0], sep[t]["w0"])
    _close(got[t]["w"][1], sep[t]["w1"])


def test_normuon_first_update_balances_neurons_at_rms_02():
  m, n = 12, 6
  grad = {"w": base._normal(3, (2, m, n)) * jnp.linspace(0.2, 3.0, n)}
  params = {"w": jnp.zeros((2, m, n))}
  u = np.asarray(base.first_update(optim.normuon(1.0, weight_decay=0.0), grad,
                                   params)["w"], np.float64)
  # After one step v is exactly (1 - b2) mean(O^2) per column, so every output
  # neuron's update has the same norm, and the RMS is consistent_rms.
  cols = np.linalg.norm(u, axis=1)                            # [2, n]
  _close(cols, np.broadcast_to(cols[:, :1], cols.shape))
  _close(np.sqrt(np.mean(u * u, axis=(1, 2))), [0.2, 0.2])
  # Negative control: Muon's columns differ.
  um = np.asarray(base.first_update(optim.muon(1.0, weight_decay=0.0), grad,
                                    params)["w"], np.float64)
  cols = np.linalg.norm(um, axis=1)
  assert np.max(cols / cols[:, :1]) > 1.01 or np.min(cols / cols[:, :1]) < 0.99


def test_normuon_state_is_per_neuron():
  params = base.compact_tree()
  state = optim.normuon(0.01).init(params)
  nu = _find(state, optim.ScaleByNeuronRmsState).nu["blocks"]
  assert nu["attn"]["q"]["kernel"].shape == (base.L, 1, base.HD)
  assert nu["moe"]["gate"]["kernel"].shape == (base.L, base.E, 1, base.F)
  assert nu["attn"]["q"]["kernel"].dtype == jnp.float32


# --------------------------------------------------------------------------
# Muon's Newton-Schulz coefficients

def _poly(rows, x):
  for a, b, c in rows:
    x = a * x + b * x**3 + c * x**5
  return x


def test_polar_express_polynomials_converge():
  rows = optim.POLAR_EXPRESS_COEFFS
  assert len(rows) == 8 and rows[-1] == (1.875, -1.25, 0.375)
  # The first row of Algorithm 1 with its safety factor applied.
  np.testing.assert_allclose(
      rows[0], (8.28721201814563 / 1.01, -23.595886519098837 / 1.01**3,
                17.300387312530933 / 1.01**5), rtol=1e-15)
  # Algorithm 1 normalises by 1.01 ||X||_F; its polynomials were fitted on
  # singular values from 1e-3 to 1. Composed, all eight reach 1 to
  # double-precision rounding; five already lie in about [0.84, 1.12], where
  # Jordan's fixed quintic leaves the small ones below 0.5.
  x = np.logspace(-3, 0, 2001)
  np.testing.assert_allclose(_poly(rows, x / 1.01), 1.0, atol=1e-12)
  five = _poly(rows[:5], x / 1.01)
  assert five.min() > 0.83 and five.max() < 1.13, (five.min(), five.max())
  assert _poly(JORDAN, x).min() < 0.5


def _ill_conditioned(m=16, n=8, decades=2.5, seed=0):
  rng = np.random.default_rng(seed)
  u, _ = np.linalg.qr(rng.standard_normal((m, n)))
  v, _ = np.linalg.qr(rng.standard_normal((n, n)))
  return (u * np.logspace(0, -decades, n)) @ v.T


def _orthogonalised(ns_coeffs, grad, **kw):
  """Muon's NS(G) from its first update (weight decay 0, rate 1)."""
  m, n = grad.shape
  tx = optim.muon(1.0, weight_decay=0.0, ns_coeffs=ns_coeffs, **kw)
  u = base.first_update(tx, {"w": grad}, {"w": jnp.zeros_like(grad)})["w"]
  return -np.asarray(u, np.float64) / (0.2 * np.sqrt(max(m, n)))


def test_polar_express_orthogonalises_better_than_jordan():
  grad = jnp.asarray(_ill_conditioned(), jnp.float32)   # condition 10^2.5
  sv_pe = np.linalg.svd(_orthogonalised("polar_express", grad),
                        compute_uv=False)
  sv_jordan = np.linalg.svd(_orthogonalised("jordan", grad), compute_uv=False)
  err_pe, err_jordan = np.abs(sv_pe - 1).max(), np.abs(sv_jordan - 1).max()
  # float64 on these singular values: 0.125 and 0.317.
  assert err_pe < 0.15, sv_pe
  assert err_pe < 0.5 * err_jordan, (sv_pe, sv_jordan)


def test_polar_express_matches_algorithm_1_in_float64():
  grad = 1e3 * _ill_conditioned(12, 5, decades=1.5, seed=1)

  def algorithm_1(g, steps=5):
    # Amsel et al., Algorithm 1: normalise by 1.01 ||G||_F, then the
    # safety-scaled polynomials one per step.
    x = g.T                                      # wide: fewer flops
    x = x / (np.linalg.norm(x) * 1.01 + 1e-7)
    for a, b, c in optim.POLAR_EXPRESS_COEFFS[:steps]:
      s = x @ x.T
      x = a * x + (b * s + c * s @ s) @ x
    return x.T

  with jax.enable_x64(True):
    got = _orthogonalised("polar_express", jnp.asarray(grad, jnp.float64))
  np.testing.assert_allclose(got, algorithm_1(grad), rtol=1e-9, atol=1e-9)
  # The 1.01 is part of the method: leaving it out changes the result.
  with jax.enable_x64(True):
    plain = _orthogonalised(optim.POLAR_EXPRESS_COEFFS,
                            jnp.asarray(grad, jnp.float64))
  assert np.max(np.abs(plain - got)) > 1e-4


def _muon_ns_rows(tx, params):
  state = _find(tx.init(params), optax.contrib.MuonState)
  return np.asarray(state.ns_coeffs, np.float64)


def test_ns_coeffs_schedule():
  params = {"w": jnp.zeros((4, 3))}
  pe = np.asarray(optim.POLAR_EXPRESS_COEFFS, np.float64)
  first = pe[0] / np.array([1.01, 1.01**3, 1.01**5])    # 1.01 normalisation
  for steps, want in [(3, [first, pe[1], pe[2]]),
                      (10, [first, *pe[1:], pe[-1], pe[-1]])]:
    rows = _muon_ns_rows(
        optim.muon(0.1, ns_coeffs="polar_express", ns_steps=steps), params)
    np.testing.assert_allclose(rows, np.stack(want), rtol=1e-7)
  rows = _muon_ns_rows(optim.muon(0.1, ns_coeffs=((1, 2, 3), (4, 5, 6)),
                                  ns_steps=3), params)
  np.testing.assert_array_equal(rows, [[1, 2, 3], [4, 5, 6], [4, 5, 6]])
  for coeffs in ("jordan", optim.NS_COEFFS):
    rows = _muon_ns_rows(optim.muon(0.1, ns_coeffs=coeffs), params)
    np.testing.assert_array_equal(rows, np.float32(optim.NS_COEFFS))
  with pytest.raises(ValueError, match="unknown ns_coeffs"):
    optim.muon(0.1, ns_coeffs="newton")
  with pytest.raises(ValueError, match="ns_coeffs must be"):
    optim.muon(0.1, ns_coeffs=((1, 2), (3, 4)))


def test_polar_express_under_inject_hyperparams():
  params = {"w": base._normal(1, (4, 3))}
  grads = {"w": base._normal(2, (4, 3))}
  make = lambda **kw: optax.inject_hyperparams(optim.muon, **kw)(
      learning_rate=0.1, ns_coeffs="polar_express")
  want, _ = base.run(optim.muon(0.1, ns_coeffs="polar_express"), [grads],
                     params)
  got, _ = base.run(make(static_args=("ns_steps",)), [grads], params)
  base.assert_trees_close(got[0], want[0])
  # Traced (jitted update), ns_steps cannot pick rows: a clear error.
  with pytest.raises(ValueError, match="static_args"):
    base.run(make(), [grads], params)


def test_default_muon_is_unchanged_bit_for_bit():
  """The default equals the composition muon had before ns_coeffs presets."""
  lr = 0.02
  dims = lambda tree: jax.tree.map(lambda _: MuonDimensionNumbers(-2, -1), tree)
  labels = optim.param_labels
  before = _optimizers.dtype_stable(optax.chain(
      optax.partition({
          "muon": optax.chain(
              optax.contrib.scale_by_muon(
                  ns_coeffs=(3.4445, -4.7750, 2.0315), ns_steps=5, beta=0.95,
                  eps=1e-8, nesterov=True, weight_dimension_numbers=dims),
              _optimizers.scale_by_shape(dims, 0.2)),
          "adam": optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8)}, labels),
      optax.add_decayed_weights(0.1, optim.weight_decay_mask),
      optax.partition({"muon": optax.scale_by_learning_rate(lr),
                       "adam": optax.scale_by_learning_rate(lr)}, labels)))
  params = base.compact_tree()
  grads = [base.grads_like(params, s) for s in range(2)]
  want, want_states = base.run(before, grads, params)
  for tx in (optim.muon(lr), optim.muon(lr, ns_coeffs="jordan")):
    got, states = base.run(tx, grads, params)
    for a, b in zip(got, want):
      base.assert_trees_equal(a, b)
    base.assert_trees_equal(states[-1], want_states[-1])


# --------------------------------------------------------------------------
# make_optimizer and config

def test_build_matches_factories_with_the_config_betas():
  params, grads = _hand_case()
  common = dict(lr=0.01, schedule="constant", clip_norm=0.0, weight_decay=0.05)
  cases = [
      (OptimizerConfig(name="mars", mars=MarsConfig(gamma=0.05, b1=0.9, b2=0.98),
                       **common),
       optim.mars(0.01, gamma=0.05, b1=0.9, b2=0.98, weight_decay=0.05)),
      (OptimizerConfig(name="normuon", muon=MuonConfig(ns_coeffs="polar_express"),
                       normuon=NorMuonConfig(b2=0.9), **common),
       optim.normuon(0.01, ns_coeffs="polar_express", neuron_b2=0.9,
                     weight_decay=0.05)),
  ]
  cases += [
      (OptimizerConfig(name="lion", lion=LionConfig(b1=0.95, b2=0.98), **common),
       optim.lion(0.01, b1=0.95, b2=0.98, weight_decay=0.05)),
      (OptimizerConfig(name="adan", adan=AdanConfig(b1=0.9, b2=0.8, b3=0.999), eps=1e-6,
                       **common),
       optim.adan(0.01, b1=0.9, b2=0.8, b3=0.999, eps=1e-6, weight_decay=0.05)),
  ]
  for cfg, tx in cases:
    got, _ = base.run(optim.make_optimizer(cfg, 10), grads, params)
    want, _ = base.run(tx, grads, params)
    for a, b in zip(got, want):
      base.assert_trees_close(a, b)


@pytest.mark.parametrize("override, key", [
    ("optimizer.muon.ns_coeffs=newton", "optimizer.muon.ns_coeffs"),
    ("optimizer.mars.b1=1.0", "optimizer.mars.b1"),
    ("optimizer.normuon.b2=-0.1", "optimizer.normuon.b2"),
    ("optimizer.mars.gamma=-1", "optimizer.mars.gamma"),
    ("optimizer.lion.b1=1.0", "optimizer.lion.b1"),
    ("optimizer.adan.b3=-0.5", "optimizer.adan.b3"),
])
def test_config_rejects_bad_optimizer_keys(override, key):
  with pytest.raises(ConfigError, match=key):
    load_config(None, ["optimizer.name=mars", override])
  assert load_config(None, ["optimizer.name=normuon"]).optimizer.muon.ns_coeffs == (
      "jordan")


# --------------------------------------------------------------------------
# weight prediction

def test_weight_prediction_keeps_updates_and_extrapolates():
  w = jnp.array([1.0, -1.0])
  tx = optim.weight_prediction(optax.sgd(0.5), steps=2.0)
  state = tx.init(w)
  np.testing.assert_array_equal(optim.predicted_params(w, state), w)
  u, state = tx.update(jnp.array([1.0, 2.0]), state, w)
  np.testing.assert_array_equal(u, [-0.5, -1.0])            # sgd unchanged
  w = optax.apply_updates(w, u)                             # [0.5, -2]
  np.testing.assert_array_equal(optim.predicted_params(w, state), [-0.5, -4.0])
  u, state = tx.update(jnp.array([-4.0, 0.0]), state, w)
  np.testing.assert_array_equal(u, [2.0, 0.0])
  w = optax.apply_updates(w, u)                             # [2.5, -2]
  np.testing.assert_array_equal(optim.predicted_params(w, state), [6.5, -2.0])
  with pytest.raises(ValueError, match="one PredictionState"):
    optim.predicted_params(w, optax.sgd(1.0).init(w))


def _delayed_loop(tx, grad_fn, w, steps, predict):
  """The one-device 2BW simulation: forward at predicted (or current) w."""
  state = tx.init(w)
  ws, at = [w], []
  for _ in range(steps):
    x = optim.predicted_params(w, state) if predict else w
    at.append(x)
    u, state = tx.update(grad_fn(x), state, w)
    w = optax.apply_updates(w, u)
    ws.append(w)
  return np.asarray(ws), np.asarray(at)


def test_weight_prediction_under_delay_by_hand():
  # f(w) = h w^2 / 2, SGD with rate eta, one-step delay.
  h, eta = 2.0, 0.1
  grad_fn = lambda w: h * w
  w0 = jnp.array(1.0)
  plain, _ = _delayed_loop(optim.delay(optax.sgd(eta)), grad_fn, w0, 4, False)
  ws, at = _delayed_loop(optim.delay(optim.weight_prediction(optax.sgd(eta))),
                         grad_fn, w0, 4, True)
  k = eta * h
  # Plain: w2 = 1 - k, w3 = 1 - 2k, w4 = w3 - k (1 - k) = 1 - 3k + k^2.
  _close(plain, [1, 1, 1 - k, 1 - 2 * k, 1 - 3 * k + k**2])
  # Predicted: the forward of call t runs at w[t] + u[t-1]: 1, 1, 1 - 2k,
  # 1 - 3k; so w4 = w3 - k (1 - 2k) = 1 - 3k + 2k^2, nearer the synchronous
  # three updates (1 - k)^3 = 1 - 3k + 3k^2 - k^3.
  _close(at, [1, 1, 1 - 2 * k, 1 - 3 * k])
  _close(ws, [1, 1, 1 - k, 1 - 2 * k, 1 - 3 * k + 2 * k**2])
  sync = (1 - k)**3
  assert abs(ws[-1] - sync) < abs(plain[-1] - sync)


def _least_squares(seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (128, 8))
  y = x @ jax.random.normal(kw, (8, 2))
  return lambda w: jnp.mean((x @ w - y) ** 2)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _train_loss(make_tx, predict, steps):
  loss = _least_squares()
  tx = make_tx()
  w0 = jnp.zeros((8, 2))

  def step(carry, _):
    w, state = carry
    x = optim.predicted_params(w, state) if predict else w
    u, state = tx.update(jax.grad(loss)(x), state, w)
    return (optax.apply_updates(w, u), state), None

  (w, _), _ = jax.lax.scan(step, (w0, tx.init(w0)), length=steps)
  return loss(w)


def _adamw():
  return optax.adamw(0.05, b1=0.9, b2=0.95, weight_decay=0.0)


def _delayed_adamw():
  return optim.delay(_adamw())


def _predicted_adamw():
  return optim.delay(optim.weight_prediction(_adamw()))


def _corrected_adamw():
  return optim.delay(optim.error_feedback(_adamw(), 1.0))


def test_weight_prediction_reduces_the_delay_error():
  steps = 200
  sync = float(_train_loss(_adamw, False, steps))
  delayed = float(_train_loss(_delayed_adamw, False, steps))
  predicted = float(_train_loss(_predicted_adamw, True, steps))
  # Negative control: the same wrapper without the forward at predicted
  # weights is just the plain delay.
  unused = float(_train_loss(_predicted_adamw, False, steps))
  assert unused == pytest.approx(delayed, rel=1e-6)
  # Measured here: sync 1.9e-7, delayed 2.2e-2, predicted 2.1e-3, and
  # delay(error_feedback) 2.3e-3: prediction cuts the delayed loss about
  # tenfold, as much as the paper's correction.
  ef = float(_train_loss(_corrected_adamw, False, steps))
  assert sync < predicted < delayed, (sync, predicted, delayed)
  assert predicted < 0.25 * delayed, (sync, predicted, delayed)
  assert predicted < 2 * ef, (predicted, ef)


def test_weight_prediction_composes_and_keeps_dtypes():
  params = base.small_tree(jnp.bfloat16, jnp.float32)
  grads = [base.grads_like(params, s) for s in range(3)]
  inner = lambda: optim.error_feedback(optim.adamw(0.01), 1.0)
  inside = optim.delay(optim.weight_prediction(inner()))
  outside = optim.weight_prediction(optim.delay(inner()))
  got_in, states_in = base.run(inside, grads, params)
  got_out, states_out = base.run(outside, grads, params)
  for a, b in zip(got_in, got_out):
    base.assert_trees_close(a, b)
  for u in got_in:
    assert base._spec(u) == base._spec(params)
  for s in states_in[1:]:
    assert base._spec(s) == base._spec(states_in[0])
  # The buffer holds the update applied last, so both orders predict alike.
  base.assert_trees_close(
      jax.jit(optim.predicted_params)(params, states_in[-1]),
      jax.jit(optim.predicted_params)(params, states_out[-1]))
  base.assert_trees_equal(states_out[-1].prev_update, got_out[-1])


def test_weight_prediction_inject_hyperparams():
  w = jnp.array([1.0, -1.0])
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
  tx = optax.inject_hyperparams(optim.weight_prediction)(inner, steps=1.0)
  state = tx.init(w)
  u, state = jax.jit(tx.update)(jnp.array([1.0, 2.0]), state, w)
  state.hyperparams["steps"] = jnp.asarray(3.0)
  state.inner_state.inner_state.hyperparams["learning_rate"] = jnp.asarray(1.0)
  u, state = jax.jit(tx.update)(jnp.array([1.0, 2.0]), state, w)
  np.testing.assert_array_equal(u, [-1.0, -2.0])
  np.testing.assert_array_equal(optim.predicted_params(w, state), [-2.0, -7.0])


@pytest.mark.parametrize("module", ["_adan", "_mars", "_normuon", "_prediction"])
def test_docstring_examples_run(module):
  mod = importlib.import_module(f"jaxpipe.optim.{module}")
  result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


def test_schedule_none_takes_gradients_at_predicted_weights():
  """`optimizer.weight_prediction` through `make_optimizer` and `schedule=none`, as the
  trainer wires it, equals the rule's loop by hand for 3 steps."""
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import make_mesh, make_schedule  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline._schedules import _full_loss  # pylint: disable=g-import-not-at-top
  from tests import _pipeline_util as util  # pylint: disable=g-import-not-at-top
  cfg = OptimizerConfig(name="adamw", lr=1e-2, schedule="constant", clip_norm=0.0, delay=1,
                        weight_prediction=1.0, eps=1e-6)
  fns = trainer.stage_fns(util.model())
  params = jax.tree.map(jnp.asarray, util.initial_params())
  sch = make_schedule("none", fns, optim.make_optimizer(cfg, 3), make_mesh(1, 1), 1,
                      predict=optim.predicted_params)
  state = sch.init(params, (1, util.ROWS, util.SEQ))
  tx = optim.delay(optim.weight_prediction(optim.adamw(1e-2, eps=1e-6)))
  w, opt_state = params, tx.init(params)
  loss = jax.jit(lambda p, t, y: _full_loss(fns)(p, t[0], y[0]))
  for tok, tgt in util.batches(1)[:3]:
    state, metrics = sch.step(state, jnp.asarray(tok), jnp.asarray(tgt))
    ahead = optim.predicted_params(w, opt_state)
    value, g = jax.value_and_grad(loss)(ahead, tok, tgt)
    np.testing.assert_allclose(float(metrics["loss"]), float(value), rtol=1e-6)
    u, opt_state = tx.update(g, opt_state, w)
    w = optax.apply_updates(w, u)
  q = lambda p: p["blocks"]["attn"]["q"]["kernel"]
  assert float(jnp.max(jnp.abs(q(optim.predicted_params(w, opt_state)) - q(w)))) > 1e-4
  for a, b in zip(jax.tree.leaves(sch.params(state)), jax.tree.leaves(w)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_weight_prediction_config_is_checked():
  with pytest.raises(ConfigError, match="optimizer.weight_prediction"):
    load_config(None, ["optimizer.weight_prediction=-1"])
  with pytest.raises(ConfigError, match="schedule none only"):
    load_config(None, ["pipeline.schedule=2bw", "pipeline.stages=2", "pipeline.microbatches=2",
                       "model.n_layers=2", "optimizer.weight_prediction=1"])
  with pytest.raises(ValueError, match="predicted weights"):
    from jaxpipe.pipeline import make_mesh, make_schedule  # pylint: disable=g-import-not-at-top
    from tests import _pipeline_util as util  # pylint: disable=g-import-not-at-top
    make_schedule("gpipe", util.stage_fns(), optim.adamw(1e-3), make_mesh(2, 1), 2,
                  predict=optim.predicted_params)


# --------------------------------------------------------------------------
# Adan: the paper's form and optax's


def test_adan_two_steps_by_hand():
  """Algorithm 1 of the Adan paper (b = 1 - its beta), two steps, numbers by hand."""
  b1, b2, b3, eps, lr, wd = 0.9, 0.8, 0.99, 1e-8, 0.1, 0.0
  w0 = {"kernel": jnp.array([[1.0, -2.0], [0.5, 3.0]])}
  g1 = np.array([[0.5, -1.0], [2.0, 0.25]])
  g2 = np.array([[1.5, 1.0], [-2.0, 0.25]])
  tx = optim.adan(lr, b1=b1, b2=b2, b3=b3, eps=eps, weight_decay=wd)
  state = tx.init(w0)
  u1, state = tx.update({"kernel": jnp.asarray(g1)}, state, w0)
  u2, state = tx.update({"kernel": jnp.asarray(g2)}, state, w0)
  # Step 1: d = 0, so m_hat = g1, v_hat = 0, n_hat = g1^2: u = -lr * g1 / |g1|.
  np.testing.assert_allclose(u1["kernel"], -lr * g1 / (np.abs(g1) + eps), rtol=1e-6)
  # Step 2: d = g2 - g1.
  d = g2 - g1
  m = b1 * (1 - b1) * g1 + (1 - b1) * g2
  v = (1 - b2) * d
  n = b3 * (1 - b3) * g1**2 + (1 - b3) * (g2 + b2 * d)**2
  m_hat, v_hat, n_hat = m / (1 - b1**2), v / (1 - b2**2), n / (1 - b3**2)
  want = -lr * (m_hat + b2 * v_hat) / (np.sqrt(n_hat) + eps)
  np.testing.assert_allclose(u2["kernel"], want, rtol=1e-5)


def test_adan_optax_form_is_optax_and_differs_from_the_paper_from_step_two():
  params, grads = _hand_case()
  kw = dict(b1=0.98, b2=0.92, b3=0.99, weight_decay=0.05)
  mask = optim.weight_decay_mask
  got, _ = base.run(optim.adan(0.01, form="optax", **kw), grads, params)
  want, _ = base.run(optax.adan(0.01, mask=mask, **kw), grads, params)
  for a, b in zip(got, want):
    base.assert_trees_close(a, b)
  paper, _ = base.run(optim.adan(0.01, **kw), grads, params)
  base.assert_trees_close(paper[0], got[0])           # no difference yet
  gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in
            zip(jax.tree.leaves(paper[1]), jax.tree.leaves(got[1])))
  assert gap > 1e-4
  with pytest.raises(ValueError, match="form"):
    optim.adan(0.01, form="pytorch")
