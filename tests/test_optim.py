"""Tests for jaxpipe.optim: each rule pinned down with numbers, in float32."""

import dataclasses
import doctest
import functools
import importlib
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxpipe import optim
from jaxpipe.config import OptimizerConfig
from jaxpipe.optim import SgdConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = dict(rtol=1e-6, atol=1e-7)

L, D, HD, F, V, E = 2, 8, 8, 12, 10, 3


def _normal(seed, shape, dtype=jnp.float32):
  # numpy draws: no XLA compilation per shape, which would dominate runtime.
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  return jnp.asarray(x).astype(dtype)


def _tree_of(shapes, seed, dtype=jnp.float32):
  leaves, treedef = jax.tree.flatten(
      shapes, is_leaf=lambda x: isinstance(x, tuple))
  return jax.tree.unflatten(
      treedef,
      [_normal(seed * 1000 + i, s, dtype) for i, s in enumerate(leaves)])


JAXPIPE_SHAPES = {
    "embed": {"embedding": (V, D)},
    "blocks": {
        "attn": {"q": {"kernel": (L, D, HD)}, "k": {"kernel": (L, D, HD)},
                 "v": {"kernel": (L, D, HD)}, "o": {"kernel": (L, HD, D)}},
        "mlp": {"gate": {"kernel": (L, D, F)}, "up": {"kernel": (L, D, F)},
                "down": {"kernel": (L, F, D)}},
        "attn_norm": {"scale": (L, D)},
        "mlp_norm": {"scale": (L, D)},
        "moe": {"router": {"kernel": (L, D, E)},
                "gate": {"kernel": (L, E, D, F)},
                "up": {"kernel": (L, E, D, F)},
                "down": {"kernel": (L, E, F, D)}},
    },
    "head": {"norm": {"scale": (D,)}, "out": {"kernel": (D, V)}},
}

# One leaf of each kind of jaxpipe's tree, to keep compilation short.
COMPACT_SHAPES = {
    "embed": {"embedding": (V, D)},
    "blocks": {"attn": {"q": {"kernel": (L, D, HD)}},
               "attn_norm": {"scale": (L, D)},
               "moe": {"router": {"kernel": (L, D, E)},
                       "gate": {"kernel": (L, E, D, F)}}},
    "head": {"norm": {"scale": (D,)}, "out": {"kernel": (D, V)}},
}


def jaxpipe_tree(seed=0, dtype=jnp.float32):
  """A small tree with the layout of jaxpipe's model (stacked blocks, MoE)."""
  return _tree_of(JAXPIPE_SHAPES, seed, dtype)


def compact_tree(seed=0, dtype=jnp.float32):
  return _tree_of(COMPACT_SHAPES, seed, dtype)


JAXPIPE_LABELS = {
    "embed": {"embedding": "adam"},
    "blocks": {
        "attn": {"q": {"kernel": "muon"}, "k": {"kernel": "muon"},
                 "v": {"kernel": "muon"}, "o": {"kernel": "muon"}},
        "mlp": {"gate": {"kernel": "muon"}, "up": {"kernel": "muon"},
                "down": {"kernel": "muon"}},
        "attn_norm": {"scale": "adam"},
        "mlp_norm": {"scale": "adam"},
        "moe": {"router": {"kernel": "adam"}, "gate": {"kernel": "muon"},
                "up": {"kernel": "muon"}, "down": {"kernel": "muon"}},
    },
    "head": {"norm": {"scale": "adam"}, "out": {"kernel": "adam"}},
}


def small_tree(dtype_w=jnp.float32, dtype_b=jnp.float32):
  """A stacked matrix, a stacked norm, an embedding, a bias; dtypes mixable."""
  return {
      "blocks": {"mlp": {"kernel": _normal(1, (2, 6, 4), dtype_w)},
                 "norm": {"scale": 1.0 + _normal(2, (2, 4), dtype_b)}},
      "embed": {"embedding": _normal(3, (5, 6), dtype_w)},
      "out": {"bias": _normal(4, (4,), dtype_b)},
  }


def grads_like(tree, seed):
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [
      _normal(seed * 1000 + 500 + i, x.shape, x.dtype)
      for i, x in enumerate(leaves)])


def run(tx, grads_seq, params):
  """Feeds a list of gradient trees to jitted `tx`; returns updates, states."""
  state = jax.jit(tx.init)(params)
  update = jax.jit(tx.update)
  updates, states = [], [state]
  for g in grads_seq:
    u, state = update(g, state, params)
    updates.append(u)
    states.append(state)
  return updates, states


def assert_trees_close(a, b, **tol):
  tol = tol or TOL
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x, np.float32),
                               np.asarray(y, np.float32), **tol)


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------------------------
# delay

GRADS_1D = [jnp.array(g, jnp.float32)
            for g in ([1., 2.], [3., -1.], [0.5, 4.], [-2., 1.], [7., 0.])]


def test_delay_one_step_sgd_outputs():
  updates, _ = run(optim.delay(optax.sgd(1.0), 1), GRADS_1D, jnp.zeros(2))
  expected = [[0., 0.], [-1., -2.], [-3., 1.], [-0.5, -4.], [2., -1.]]
  np.testing.assert_array_equal(np.stack(updates), np.array(expected))


def test_delay_two_steps_sgd_outputs():
  updates, _ = run(optim.delay(optax.sgd(1.0), 2), GRADS_1D, jnp.zeros(2))
  expected = [[0., 0.], [0., 0.], [-1., -2.], [-3., 1.], [-0.5, -4.]]
  np.testing.assert_array_equal(np.stack(updates), np.array(expected))


@pytest.mark.parametrize("steps", [1, 2])
def test_delay_is_adam_shifted_and_inner_state_waits(steps):
  params = jnp.array([0.3, -0.2])
  inner = optax.adam(0.1)
  delayed, states = run(optim.delay(inner, steps), GRADS_1D, params)
  plain, plain_states = run(inner, GRADS_1D, params)
  init = inner.init(params)
  for t in range(steps):
    np.testing.assert_array_equal(delayed[t], jnp.zeros(2))
    assert_trees_equal(states[t + 1].inner_state, init)
  for t in range(steps, len(GRADS_1D)):
    np.testing.assert_allclose(delayed[t], plain[t - steps], **TOL)
    assert_trees_close(states[t + 1].inner_state, plain_states[t - steps + 1])
  assert int(states[-1].count) == len(GRADS_1D)


def test_delay_buffer_dtype_and_zero_steps():
  params = {"w": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.ones(3)}
  state = optim.delay(optax.sgd(1.0), 3).init(params)
  assert state.buffer["w"].shape == (3, 2, 3)
  assert state.buffer["w"].dtype == jnp.bfloat16
  assert state.buffer["b"].dtype == jnp.float32
  state = optim.delay(optax.sgd(1.0), 1, buffer_dtype=jnp.float32).init(params)
  assert state.buffer["w"].dtype == jnp.float32
  inner = optax.sgd(1.0)
  assert optim.delay(inner, 0).init(params) == inner.init(params)
  with pytest.raises(ValueError):
    optim.delay(inner, -1)


# --------------------------------------------------------------------------
# error feedback

def test_error_feedback_hand_computation_coeff_one():
  updates, _ = run(optim.error_feedback(optax.sgd(0.1), 1.0), GRADS_1D[:3],
                   jnp.zeros(2))
  # v = -0.1 g; out[0] = v[0]; out[t] = 2 v[t] - v[t-1].
  expected = [[-0.1, -0.2], [-0.5, 0.4], [0.2, -0.9]]
  np.testing.assert_allclose(np.stack(updates), np.array(expected), **TOL)


@pytest.mark.parametrize("coeff", [0.0, 0.5, 1.0, 2.0])
def test_error_feedback_formula(coeff):
  updates, states = run(optim.error_feedback(optax.sgd(0.1), coeff), GRADS_1D,
                        jnp.zeros(2))
  v = [-0.1 * np.asarray(g) for g in GRADS_1D]
  expected = [v[0]] + [(1 + coeff) * v[t] - coeff * v[t - 1]
                       for t in range(1, len(v))]
  np.testing.assert_allclose(np.stack(updates), np.stack(expected), **TOL)
  np.testing.assert_allclose(states[-1].prev_update, v[-1], **TOL)


@pytest.mark.parametrize("coeff", [0.5, 1.0])
def test_error_feedback_shadow_iterate_follows_plain_adam(coeff):
  """From t = 1 on, z[t] = x[t] - c v[t-1] obeys z[t+1] = z[t] + v[t]."""
  target = jnp.array([1.0, -2.0, 0.5])
  loss = lambda x: 0.5 * jnp.sum((x - target) ** 2 * jnp.array([1., 4., 9.]))
  inner = optax.adam(0.05)
  tx = optim.error_feedback(inner, coeff)
  x = jnp.zeros(3)
  state, inner_state = tx.init(x), inner.init(x)
  xs, vs = [x], []
  for _ in range(8):
    g = jax.grad(loss)(x)
    out, state = tx.update(g, state, x)
    v, inner_state = inner.update(g, inner_state, x)   # the uncorrected update
    x = optax.apply_updates(x, out)
    xs.append(x)
    vs.append(v)
  # z is defined from t = 1 on: the first update has no predecessor and is
  # applied uncorrected, so x[1] = x[0] + v[0].
  np.testing.assert_allclose(xs[1], xs[0] + vs[0], **TOL)
  z = {t: xs[t] - coeff * vs[t - 1] for t in range(1, len(xs))}
  for t in range(1, len(vs)):
    np.testing.assert_allclose(z[t + 1], z[t] + vs[t], rtol=1e-5, atol=1e-6)
  # The correction really moved x: it is not the plain run.
  assert float(jnp.max(jnp.abs(xs[-1] - z[len(xs) - 1]))) > 1e-3


def test_error_feedback_dtypes():
  params = {"w": jnp.ones((2, 2), jnp.bfloat16), "b": jnp.zeros(2)}
  tx = optim.error_feedback(optax.sgd(0.1), 1.0)
  state = tx.init(params)
  assert state.prev_update["w"].dtype == jnp.bfloat16
  assert state.prev_update["b"].dtype == jnp.float32
  u, state = tx.update(params, state, params)
  assert u["w"].dtype == jnp.bfloat16 and u["b"].dtype == jnp.float32

  # A bf16 buffer under f32 params: the previous update is rounded to bf16.
  tx = optim.error_feedback(optax.sgd(1.0), 1.0, buffer_dtype=jnp.bfloat16)
  x = jnp.zeros(1)
  state = tx.init(x)
  assert state.prev_update.dtype == jnp.bfloat16
  _, state = tx.update(jnp.array([1.001]), state, x)
  u, state = tx.update(jnp.array([2.0]), state, x)
  prev = float(jnp.asarray(-1.001, jnp.bfloat16))
  np.testing.assert_allclose(u, [2 * -2.0 - prev], **TOL)
  assert u.dtype == jnp.float32


def test_error_feedback_first_update_not_nan_on_inf():
  tx = optim.error_feedback(optax.sgd(1.0), 1.0)
  u, _ = tx.update(jnp.array([jnp.inf, 1.0]), tx.init(jnp.zeros(2)))
  np.testing.assert_array_equal(u, [-jnp.inf, -1.0])


@pytest.mark.parametrize("coeff", [0.5, 1.0])
def test_delay_and_error_feedback_orders_differ_only_first_update(coeff):
  params = jnp.zeros(2)
  a, _ = run(optim.delay(optim.error_feedback(optax.sgd(1.0), coeff)),
             GRADS_1D, params)
  b, _ = run(optim.error_feedback(optim.delay(optax.sgd(1.0)), coeff),
             GRADS_1D, params)
  g = [np.asarray(x) for x in GRADS_1D]
  # delay(ef): 0, -g0, -(1+c) g1 + c g0, ...
  np.testing.assert_allclose(a[0], 0.0)
  np.testing.assert_allclose(a[1], -g[0], **TOL)
  np.testing.assert_allclose(a[2], -(1 + coeff) * g[1] + coeff * g[0], **TOL)
  # ef(delay): the zero update counts as v[0], so the first real one is scaled.
  np.testing.assert_allclose(b[0], 0.0)
  np.testing.assert_allclose(b[1], (1 + coeff) * a[1], **TOL)
  for t in range(2, len(g)):
    np.testing.assert_allclose(b[t], a[t], **TOL)


# --------------------------------------------------------------------------
# grouping

class _FlaxBlock(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(16)(nn.LayerNorm()(x))
    return x + nn.Dense(8)(nn.gelu(h)), None


class _FlaxLM(nn.Module):

  @nn.compact
  def __call__(self, tokens):
    x = nn.Dense(8)(nn.Embed(10, 8)(tokens))
    blocks = nn.scan(_FlaxBlock, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=3)
    x, _ = blocks(name="blocks")(x, None)
    return nn.Dense(10, name="lm_head")(nn.LayerNorm()(x))


def test_param_labels_on_jaxpipe_tree():
  assert optim.param_labels(jaxpipe_tree()) == JAXPIPE_LABELS


def test_weight_decay_mask_on_jaxpipe_tree():
  expected = jax.tree.map(lambda lab: True, JAXPIPE_LABELS)
  for path in (("blocks", "attn_norm"), ("blocks", "mlp_norm"),
               ("head", "norm")):
    expected[path[0]][path[1]]["scale"] = False
  assert optim.weight_decay_mask(jaxpipe_tree()) == expected


def test_param_labels_on_flax_linen_tree():
  shapes = jax.eval_shape(_FlaxLM().init, jax.random.key(0),
                          jnp.zeros((2, 4), jnp.int32))
  assert shapes["params"]["blocks"]["Dense_0"]["kernel"].shape == (3, 8, 16)
  dense = {"kernel": "muon", "bias": "adam"}
  norm = {"scale": "adam", "bias": "adam"}
  assert optim.param_labels(shapes) == {"params": {
      "Embed_0": {"embedding": "adam"},
      "Dense_0": dense,
      "blocks": {"Dense_0": dense, "Dense_1": dense, "LayerNorm_0": norm},
      "LayerNorm_0": norm,
      "lm_head": {"kernel": "adam", "bias": "adam"},
  }}
  mask = optim.weight_decay_mask(shapes)["params"]
  assert mask["blocks"]["Dense_0"] == {"kernel": True, "bias": False}
  assert mask["blocks"]["LayerNorm_0"] == {"scale": False, "bias": False}
  assert mask["Embed_0"]["embedding"] and mask["lm_head"]["kernel"]


def test_param_labels_names_are_whole_keys():
  tree = {"MultiHeadAttention_0": {"kernel": jnp.zeros((4, 4))},
          "tok_embeddings": jnp.zeros((4, 4)), "ln_f": {"w": jnp.zeros((2, 4))},
          "raw": jnp.zeros((3, 4)), "vec": jnp.zeros(4)}
  assert optim.param_labels(tree) == {
      "MultiHeadAttention_0": {"kernel": "muon"}, "tok_embeddings": "adam",
      "ln_f": {"w": "adam"}, "raw": "muon", "vec": "adam"}


# --------------------------------------------------------------------------
# Muon

def _singular_values(update):
  """Singular values of every [m, n] matrix of a stacked update."""
  return np.linalg.svd(np.asarray(update, np.float64), compute_uv=False)


def _newton_schulz(g, steps=5, eps=1e-8):
  """Muon's quintic Newton-Schulz iteration on one matrix, in float64."""
  a, b, c = optim.NS_COEFFS
  x = np.asarray(g, np.float64)
  x = x / (np.linalg.norm(x) + eps)
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  for _ in range(steps):
    s = x @ x.T
    x = a * x + (b * s + c * s @ s) @ x
  return x.T if tall else x


def first_update(tx, grads, params):
  """The update of the first call of `tx`, jitted."""
  return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)


def test_muon_orthogonalises_each_matrix_of_a_stack():
  m, n = 12, 6
  # A gradient dominated by one direction per slice, plus noise: far from
  # orthogonal, so sign-like Adam updates stay badly conditioned.
  grad = (10 * jnp.einsum("lm,ln->lmn", _normal(1, (3, m)), _normal(2, (3, n)))
          + _normal(3, (3, m, n)))
  params = {"w": jnp.zeros((3, m, n))}
  u = first_update(optim.muon(1.0, weight_decay=0.0), {"w": grad}, params)
  # Update = -0.2 sqrt(max(m, n)) NS(G). The quintic NS is tuned for speed,
  # not exact convergence, and leaves singular values in about [0.7, 1.2].
  ortho = -np.asarray(u["w"]) / (0.2 * np.sqrt(max(m, n)))
  sv = _singular_values(ortho)
  assert sv.shape == (3, n)
  assert np.all((sv > 0.5) & (sv < 1.5)), sv
  # Each slice equals the quintic iteration run on that slice alone.
  np.testing.assert_allclose(ortho, [_newton_schulz(x) for x in grad],
                             rtol=1e-4, atol=1e-5)

  ua = first_update(optax.adam(1.0), {"w": grad}, params)
  sv_adam = _singular_values(ua["w"])
  assert np.all(sv_adam[:, 0] / sv_adam[:, -1] > 5), sv_adam


def test_muon_matches_optax_muon_on_plain_matrices():
  params = {"a": _normal(1, (6, 4)), "b": _normal(2, (4, 8))}
  ours = optim.muon(0.02, weight_decay=0.1)
  theirs = optax.contrib.muon(0.02, weight_decay=0.1, consistent_rms=0.2)
  grads = [grads_like(params, s) for s in range(3)]
  ua, _ = run(ours, grads, params)
  ub, _ = run(theirs, grads, params)
  assert_trees_close(ua, ub, rtol=1e-5, atol=1e-7)


def test_muon_adam_group_is_adamw():
  params = compact_tree()
  adam_only = {"embed": params["embed"], "head": params["head"]}
  grads = [grads_like(params, s) for s in range(3)]
  ua, _ = run(optim.muon(0.02, adam_learning_rate=3e-3, weight_decay=0.1),
              grads, params)
  ub, _ = run(optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.1,
                          mask=optim.weight_decay_mask),
              [{"embed": g["embed"], "head": g["head"]} for g in grads],
              adam_only)
  for a, b in zip(ua, ub):
    assert_trees_close({"embed": a["embed"], "head": a["head"]}, b)


def test_muon_jordan_scale():
  m, n = 4, 9
  g = {"w": _normal(5, (m, n))}
  params = {"w": jnp.zeros((m, n))}
  u1 = first_update(optim.muon(1.0, weight_decay=0.0), g, params)
  u2 = first_update(optim.muon(1.0, weight_decay=0.0, consistent_rms=None), g,
                    params)
  np.testing.assert_allclose(
      u2["w"], u1["w"] * np.sqrt(n / m) / (0.2 * np.sqrt(n)), rtol=1e-5)


def test_muon_label_override():
  params = compact_tree()

  def labels(p):
    out = optim.param_labels(p)
    out["head"]["out"]["kernel"] = "muon"
    return out

  grads = grads_like(params, 1)
  for override in (labels, labels(params)):
    tx = optim.muon(1.0, weight_decay=0.0, param_labels=override)
    u = first_update(tx, grads, params)
    sv = _singular_values(-u["head"]["out"]["kernel"] / (0.2 * np.sqrt(V)))
    assert np.all((sv > 0.5) & (sv < 1.5)), sv
  bad = optim.param_labels(params)
  bad["head"]["norm"]["scale"] = "muon"
  tx = optim.muon(1.0, param_labels=bad)
  with pytest.raises(ValueError, match="Muon needs a matrix"):
    tx.init(params)


# --------------------------------------------------------------------------
# One suite for every optimizer and wrapper (as optax's alias tests do)

def _cfg(**kw):
  return OptimizerConfig(warmup_steps=2, schedule="cosine", **kw)


FACTORIES = {
    "adamw": lambda lr: optim.adamw(lr),
    "muon": lambda lr: optim.muon(lr),
    "mars": lambda lr: optim.mars(lr),
    "normuon": lambda lr: optim.normuon(lr),
    "soap": lambda lr: optim.soap(lr),
    "delay(adamw)": lambda lr: optim.delay(optim.adamw(lr)),
    "delay(error_feedback(muon))": lambda lr: optim.delay(
        optim.error_feedback(optim.muon(lr), 0.5), 2),
}
BUILT = {f"make_optimizer[{name}]": lambda name=name: optim.make_optimizer(
    _cfg(name=name, delay=1, error_feedback=1.0), 10)
         for name in ("adamw", "muon", "lion", "adan", "sgd", "mars",
                      "normuon", "soap")}
# make_optimizer[...] covers lion, adan, sgd and delay(error_feedback(clip + opt)).
ALL = {**{k: functools.partial(FACTORIES[k], 0.01)
          for k in ("adamw", "muon", "mars", "normuon", "soap",
                    "delay(error_feedback(muon))")}, **BUILT}
# optax's own tests cover its optimizers inside MultiSteps and partition; ours
# add Muon's nested partition and the wrappers' conds and buffers. (Not
# soap: small_tree's 6 x 4 matrix gives its first factor a 2-D null space,
# whose eigenbasis, and so the next update, follows rounding; its own tests
# check MultiSteps and partition on shapes without one.)
COMPOSED = ["adamw", "muon", "mars", "normuon", "delay(adamw)",
            "delay(error_feedback(muon))"]


def _spec(tree):
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


@pytest.mark.parametrize("name", sorted(ALL))
def test_suite_jit_dtypes_and_state(name):
  """Jitted init/update; bf16 leaves stay bf16 beside f32 ones; state fixed."""
  tx = ALL[name]()
  params = small_tree(jnp.bfloat16, jnp.float32)
  updates, states = run(tx, [grads_like(params, s) for s in range(3)], params)
  for state in states[1:]:
    assert _spec(state) == _spec(states[0])
  for u in updates:
    assert _spec(u) == _spec(params)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(updates))
  assert all(float(jnp.max(jnp.abs(x))) > 0
             for x in jax.tree.leaves(updates[-1]))


@pytest.mark.parametrize("name", ["adamw", "muon", "lion", "adan", "sgd",
                                  "mars", "normuon", "soap"])
def test_suite_zero_gradient_is_masked_decay(name):
  params = compact_tree()
  lr, wd = 0.5, 0.1
  zeros = jax.tree.map(jnp.zeros_like, params)
  u = first_update(getattr(optim, name)(lr, weight_decay=wd), zeros, params)
  expected = jax.tree.map(lambda p, m: -lr * wd * p if m else 0 * p, params,
                          optim.weight_decay_mask(params))
  assert_trees_close(u, expected)


@pytest.mark.parametrize("name", ["adamw", "muon", "lion", "adan", "sgd",
                                  "mars", "normuon", "soap"])
def test_suite_inject_hyperparams_changes_lr_mid_run(name):
  tx = optax.inject_hyperparams(getattr(optim, name))(learning_rate=0.1)
  params = compact_tree()
  update = jax.jit(tx.update)
  state = jax.jit(tx.init)(params)
  for seed in range(2):
    _, state = update(grads_like(params, seed), state, params)
  g = grads_like(params, 9)
  u_before, _ = update(g, state, params)
  state.hyperparams["learning_rate"] = jnp.asarray(0.01)
  u_after, state = update(g, state, params)
  # Every part of these updates (decay included) is proportional to the rate.
  assert_trees_close(u_after, jax.tree.map(lambda x: 0.1 * x, u_before),
                     rtol=1e-5, atol=1e-8)
  assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.01)


def test_inject_hyperparams_inside_wrappers_and_on_coeff():
  params = small_tree()
  inner = optax.inject_hyperparams(optim.adamw)(learning_rate=0.1)
  tx = optim.delay(optim.error_feedback(inner, 1.0))
  update = jax.jit(tx.update)
  state = tx.init(params)
  for seed in range(3):
    _, state = update(grads_like(params, seed), state, params)
  g = grads_like(params, 5)
  u1, _ = update(g, state, params)
  state.inner_state.inner_state.hyperparams["learning_rate"] = jnp.asarray(0.05)
  u2, _ = update(g, state, params)
  # out = 2 v[t] - v[t-1], and only v[t] is made at the new rate (half the
  # old): out2 = v1 - v[t-1] = out1 - v1, with v1 = (out1 + v[t-1]) / 2.
  prev = state.inner_state.prev_update
  v1 = jax.tree.map(lambda o, p: (o + p) / 2, u1, prev)
  assert_trees_close(u2, jax.tree.map(lambda o, v: o - v, u1, v1),
                     rtol=1e-5, atol=1e-7)

  ef = optax.inject_hyperparams(optim.error_feedback)(optax.sgd(1.0), coeff=1.0)
  state = ef.init(jnp.zeros(1))
  _, state = ef.update(jnp.array([1.0]), state)
  state.hyperparams["coeff"] = jnp.asarray(2.0)
  u, _ = ef.update(jnp.array([2.0]), state)
  np.testing.assert_allclose(u, [3 * -2.0 + 2 * 1.0], **TOL)


@pytest.mark.parametrize("name", COMPOSED)
def test_suite_multisteps(name):
  params = small_tree()
  k = 2
  grads = [grads_like(params, s) for s in range(2 * k)]
  multi = optax.MultiSteps(FACTORIES[name](0.01), every_k_schedule=k)
  inner = FACTORIES[name](0.01)
  got, _ = run(multi, grads, params)
  mean = [jax.tree.map(lambda *g: sum(g) / k, *grads[i:i + k])
          for i in range(0, len(grads), k)]
  want, _ = run(inner, mean, params)
  assert_trees_equal(got[0], jax.tree.map(jnp.zeros_like, params))
  assert_trees_equal(got[2], jax.tree.map(jnp.zeros_like, params))
  assert_trees_close(got[1], want[0], rtol=1e-5, atol=1e-7)
  assert_trees_close(got[3], want[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", COMPOSED)
def test_suite_inside_partition(name):
  params = {"net": small_tree(), "other": jnp.ones(3)}
  grads = [grads_like(params, s) for s in range(3)]
  tx = optax.partition({"a": FACTORIES[name](0.01), "b": optax.sgd(1.0)},
                       {"net": "a", "other": "b"})
  got, _ = run(tx, grads, params)
  want, _ = run(FACTORIES[name](0.01), [g["net"] for g in grads],
                params["net"])
  for a, b, g in zip(got, want, grads):
    assert_trees_close(a["net"], b)
    np.testing.assert_allclose(a["other"], -g["other"], **TOL)


# --------------------------------------------------------------------------
# Sharded params under jit: the trainer applies the optimizer outside
# shard_map to stage-sharded stacked weights.

@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_build_on_sharded_params_matches_unsharded(axis_type):
  mesh = jax.make_mesh((2,), ("stage",), axis_types=(axis_type,),
                       devices=jax.devices()[:2])
  params = compact_tree()
  grads = [grads_like(params, s) for s in range(3)]
  tx = optim.make_optimizer(_cfg(name="muon", delay=1, error_feedback=1.0), 10)
  want, _ = run(tx, grads, params)

  def spec(path, _):
    blocks = jax.tree_util.keystr(path).startswith("['blocks']")
    return NamedSharding(mesh, P("stage") if blocks else P())

  shardings = jax.tree_util.tree_map_with_path(spec, params)
  put = lambda tree: jax.device_put(tree, shardings)
  with jax.set_mesh(mesh):
    sharded = put(params)
    state = jax.jit(tx.init)(sharded)
    first = state
    update = jax.jit(tx.update)
    for g, w in zip(grads, want):
      u, state = update(put(g), state, sharded)
      assert_trees_close(u, w, rtol=1e-5, atol=1e-7)
  if axis_type == AxisType.Explicit:
    # Shardings are part of the types: the state follows the params from
    # init on, an update keeps it, and updates are sharded like the params.
    # (Under Auto axes the compiler picks where init's fresh zeros live; a
    # trainer fixes that with out_shardings.)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(state)):
      assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    for x, want_sharding in zip(jax.tree.leaves(u), jax.tree.leaves(shardings)):
      assert x.sharding.is_equivalent_to(want_sharding, x.ndim)
    buffer = state.buffer["blocks"]["moe"]["gate"]["kernel"]
    assert buffer.sharding.spec == P(None, "stage", None, None, None)


# --------------------------------------------------------------------------
# make_optimizer and schedules

def test_build_matches_hand_composed_chain():
  # No warmup: a warmup from rate 0 would make the first real update zero and
  # hide the difference between the two orders.
  cfg = OptimizerConfig(name="adamw", lr=0.01, weight_decay=0.1, clip_norm=1.0,
                        warmup_steps=0, schedule="cosine", delay=1,
                        error_feedback=0.5)
  sched = optax.cosine_decay_schedule(0.01, 8, alpha=0.1)
  hand = optim.delay(optim.error_feedback(optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                  mask=optim.weight_decay_mask)), 0.5), 1)
  swapped = optim.error_feedback(optim.delay(optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                  mask=optim.weight_decay_mask)), 1), 0.5)
  params = small_tree()
  grads = [grads_like(params, s) for s in range(5)]
  got, _ = run(optim.make_optimizer(cfg, 8), grads, params)
  want, _ = run(hand, grads, params)
  other, _ = run(swapped, grads, params)
  for a, b in zip(got, want):
    assert_trees_close(a, b, rtol=1e-5, atol=1e-8)
  # The first real update (call 1) is uncorrected in make_optimizer's order and 1.5
  # times larger in the other; after that the orders agree.
  assert_trees_close(jax.tree.map(lambda x: 1.5 * x, got[1]), other[1],
                     rtol=1e-5, atol=1e-8)
  for a, b in zip(got[2:], other[2:]):
    assert_trees_close(a, b, rtol=1e-5, atol=1e-8)


def test_build_muon_adam_lr_and_ef_dtype():
  cfg = OptimizerConfig(name="muon", lr=0.02, adam_lr=0.004,
                        schedule="constant", clip_norm=0.0,
                        error_feedback=1.0, ef_dtype="bfloat16")
  tx = optim.make_optimizer(cfg, 10)
  params = compact_tree()
  state = tx.init(params)
  assert isinstance(state, optim.ErrorFeedbackState)
  assert all(x.dtype == jnp.bfloat16
             for x in jax.tree.leaves(state.prev_update))
  grads = [grads_like(params, s) for s in range(2)]
  plain = optim.make_optimizer(dataclasses.replace(cfg, error_feedback=0.0), 10)
  got, _ = run(plain, grads, params)
  want, _ = run(optim.muon(0.02, adam_learning_rate=0.004, weight_decay=0.1),
                grads, params)
  for a, b in zip(got, want):
    assert_trees_close(a, b, rtol=1e-5, atol=1e-8)


def test_build_plain_config_is_just_the_optimizer():
  cfg = OptimizerConfig(name="sgd", clip_norm=0.0, schedule="constant",
                        sgd=SgdConfig(momentum=0.9), lr=0.1, weight_decay=0.0)
  state = optim.make_optimizer(cfg, 5).init(jnp.zeros(2))
  assert not isinstance(state, (optim.DelayState, optim.ErrorFeedbackState))
  with pytest.raises(ValueError):
    optim.make_optimizer(dataclasses.replace(cfg, name="rmsprop"), 5)


def _lr(cfg, total, counts, **kw):
  sched = jax.jit(optim.learning_rate_schedule(cfg, total, **kw))
  return np.array([float(sched(jnp.asarray(c))) for c in counts])


def test_schedule_constant():
  cfg = OptimizerConfig(lr=0.4, schedule="constant", warmup_steps=4)
  np.testing.assert_allclose(_lr(cfg, 20, [0, 2, 4, 10, 25]),
                             [0.0, 0.2, 0.4, 0.4, 0.4], **TOL)
  cfg = dataclasses.replace(cfg, warmup_steps=0)
  np.testing.assert_allclose(_lr(cfg, 20, [0, 19]), [0.4, 0.4], **TOL)


def test_schedule_cosine():
  cfg = OptimizerConfig(lr=1.0, schedule="cosine", warmup_steps=10,
                        min_lr_ratio=0.1)
  # Peak at the end of warmup, half way in cosine at the midpoint, floor at T.
  np.testing.assert_allclose(_lr(cfg, 110, [0, 5, 10, 60, 110, 200]),
                             [0.0, 0.5, 1.0, 0.55, 0.1, 0.1], rtol=1e-5)


@pytest.mark.parametrize("shape, quarter",
                         [("1-sqrt", 0.1 + 0.9 * 0.5),
                          ("linear", 0.1 + 0.9 * 0.75)])
def test_schedule_wsd(shape, quarter):
  cfg = OptimizerConfig(lr=1.0, schedule="wsd", warmup_steps=10,
                        decay_fraction=0.2, min_lr_ratio=0.1)
  # T = 200: warmup to 10, stable to 160, decay over 40 steps to 200.
  got = _lr(cfg, 200, [5, 10, 100, 160, 170, 200, 300], wsd_shape=shape)
  np.testing.assert_allclose(got, [0.5, 1.0, 1.0, 1.0, quarter, 0.1, 0.1],
                             rtol=1e-5)


def test_schedule_wsd_default_is_one_minus_sqrt():
  cfg = OptimizerConfig(lr=2.0, schedule="wsd", warmup_steps=0,
                        decay_fraction=0.5, min_lr_ratio=0.0)
  # Decay from 50 to 100: at 50 + 50 * 0.64, 1 - sqrt(0.64) = 0.2.
  np.testing.assert_allclose(_lr(cfg, 100, [0, 50, 82, 100]),
                             [2.0, 2.0, 0.4, 0.0], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------
# the user guide's snippet and the docstring examples run

@pytest.mark.parametrize("module", ["_wrappers", "_optimizers", "_muon"])
def test_docstring_examples_run(module):
  mod = importlib.import_module(f"jaxpipe.optim.{module}")
  result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0
