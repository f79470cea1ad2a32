"""Tests for jaxpipe.optim.soap: the update rule pinned down with numbers.

The reference below is SOAP written out in numpy (float64) from the paper's
Algorithms 3 and 4, one matrix at a time, without any of jaxpipe's code.
"""

import doctest
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from jaxpipe import config as config_lib
from jaxpipe import optim
from jaxpipe.config import OptimizerConfig
from jaxpipe.optim import SoapConfig
from jaxpipe.errors import ConfigError
from jaxpipe.optim import _soap

TOL = dict(rtol=1e-6, atol=1e-7)

# Hyperparameters of the hand computation: all distinct, and eps large
# enough (against O(1) gradients) that where it is added shows.
HP = dict(b1=0.9, b2=0.8, shampoo_beta=0.5, eps=1e-3, weight_decay=0.1)
LR = 0.1

# A 3 x 2 weight and three gradients. G0's factors have well separated
# eigenvalues (L: 2.39, 0.73, 0; R: 2.39, 0.73), G1 is large in G0's weak
# directions so that the first refresh reorders both bases, and no rotated
# gradient entry is near zero (Adam's first step is close to its sign).
W0 = np.array([[0.5, -1.0], [1.5, 0.2], [-0.7, 0.9]])
G = [np.array([[-1.1, 0.2], [1.2, -1.6], [-0.6, -0.8]]),
     np.array([[0.2, 0.4], [-3.1, 0.7], [1.7, 4.6]]),
     np.array([[-0.1, 1.1], [-0.3, -1.3], [0.5, -1.4]])]


def reference(grads, w, *, lr, b1, b2, shampoo_beta, eps, weight_decay,
              frequency, left=True, right=True, permute=True):
  """SOAP on one matrix in float64; updates applied to w as they come.

  Returns the updates, the final (Q_L, Q_R, M, V) and the orders that each
  refresh put the old columns in.
  """
  m, n = w.shape
  big_l, big_r = np.zeros((m, m)), np.zeros((n, n))
  mom, var = np.zeros((m, n)), np.zeros((m, n))
  q_l, q_r = np.eye(m), np.eye(n)
  updates, orders = [], []
  for t, g in enumerate(grads):
    if t == 0:
      direction = np.zeros_like(w)   # the first call builds the bases only
    else:
      rot = q_l.T @ g @ q_r
      mom = b1 * mom + (1 - b1) * g
      var = b2 * var + (1 - b2) * rot ** 2
      m_hat = (q_l.T @ mom @ q_r) / (1 - b1 ** t)
      v_hat = var / (1 - b2 ** t)
      direction = q_l @ (m_hat / (np.sqrt(v_hat) + eps)) @ q_r.T
    u = -lr * (direction + weight_decay * w)
    updates.append(u)
    w = w + u
    if left:
      big_l = shampoo_beta * big_l + (1 - shampoo_beta) * g @ g.T
    if right:
      big_r = shampoo_beta * big_r + (1 - shampoo_beta) * g.T @ g
    if t == 0:
      # eigh sorts ascending; the bases keep decreasing eigenvalues.
      if left:
        q_l = np.linalg.eigh(big_l)[1][:, ::-1]
      if right:
        q_r = np.linalg.eigh(big_r)[1][:, ::-1]
    elif t % frequency == 0:
      if left:
        est = np.diag(q_l.T @ big_l @ q_l)
        order = np.argsort(-est, kind="stable")
        orders.append(order)
        if permute:
          var = var[order, :]
        q_l = np.linalg.qr(big_l @ q_l[:, order])[0]
      if right:
        est = np.diag(q_r.T @ big_r @ q_r)
        order = np.argsort(-est, kind="stable")
        orders.append(order)
        if permute:
          var = var[:, order]
        q_r = np.linalg.qr(big_r @ q_r[:, order])[0]
  return updates, (q_l, q_r, mom, var), orders


def run(tx, grads, params, apply=False):
  """Feeds gradients to jitted `tx`; returns the updates and the states."""
  state = jax.jit(tx.init)(params)
  update = jax.jit(tx.update)
  updates, states = [], [state]
  for g in grads:
    u, state = update(g, state, params)
    if apply:
      params = optax.apply_updates(params, u)
    updates.append(u)
    states.append(state)
  return updates, states


def soap_state(state):
  """The one `ScaleBySoapState` inside a state tree."""
  found = [x for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optim.ScaleBySoapState))
           if isinstance(x, optim.ScaleBySoapState)]
  assert len(found) == 1
  return found[0]


def signs_fixed(q):
  """Columns of a basis with their largest entry made positive."""
  q = np.asarray(q, np.float64)
  idx = np.argmax(np.abs(q), axis=-2)
  sign = np.sign(np.take_along_axis(q, idx[..., None, :], axis=-2))
  return q * sign


def _normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _f32(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def assert_close(a, b, **tol):
  np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b),
                             **(tol or TOL))


# --------------------------------------------------------------------------
# the rule, by hand

@pytest.mark.parametrize("frequency", [1, 2])
def test_hand_computation_three_calls(frequency):
  """Call 0: bases from eigh, decay only; calls 1, 2: rotated Adam.

  With frequency 1 the refresh after call 1 (power step, QR, reordered
  columns and second moment) shapes call 2's update; with frequency 2 it
  comes after call 2 and shows in the final state.
  """
  want, (q_l, q_r, mom, var), orders = reference(
      G, W0, lr=LR, frequency=frequency, **HP)
  # The data exercise the reordering: the first refresh swaps columns.
  assert not np.array_equal(orders[0], np.arange(3))
  assert not np.array_equal(orders[1], np.arange(2))

  tx = optim.soap(LR, precondition_frequency=frequency, **HP)
  got, states = run(tx, [{"w": jnp.asarray(g, jnp.float32)} for g in G],
                    {"w": jnp.asarray(W0, jnp.float32)}, apply=True)
  assert_close(got[0]["w"], -LR * HP["weight_decay"] * W0)
  for u, w in zip(got, want):
    assert_close(u["w"], w)
  s = soap_state(states[-1])
  assert int(s.count) == 3
  assert_close(signs_fixed(s.q_l["w"]), signs_fixed(q_l), rtol=1e-6, atol=1e-6)
  assert_close(signs_fixed(s.q_r["w"]), signs_fixed(q_r), rtol=1e-6, atol=1e-6)
  assert_close(s.mu["w"], mom)
  assert_close(s.nu["w"], var, rtol=1e-6, atol=1e-6)

  # Negative control: without moving the second moment along with its
  # eigenvectors, the numbers change well beyond the tolerance.
  stale, (_, _, _, stale_var), _ = reference(
      G, W0, lr=LR, frequency=frequency, permute=False, **HP)
  if frequency == 1:
    assert np.max(np.abs(stale[2] - want[2])) > 1e-2
  else:
    assert np.max(np.abs(stale_var - var)) > 0.5


def test_max_precond_dim_leaves_long_sides_unrotated():
  grads = [{"w": jnp.asarray(g, jnp.float32)} for g in G]
  params = {"w": jnp.asarray(W0, jnp.float32)}
  # 3 > 2: the left side is not rotated and keeps no factor.
  want, _, _ = reference(G, W0, lr=LR, frequency=1, left=False, **HP)
  got, states = run(
      optim.soap(LR, precondition_frequency=1, max_precond_dim=2, **HP),
      grads, params, apply=True)
  for u, w in zip(got, want):
    assert_close(u["w"], w)
  s = soap_state(states[-1])
  assert s.l_factor["w"].shape == s.q_l["w"].shape == (0, 0)
  assert s.r_factor["w"].shape == s.q_r["w"].shape == (2, 2)

  # No side rotated: Adam from the second call on (optax's, an oracle
  # independent of the reference above).
  got, _ = run(optim.soap(LR, max_precond_dim=0, **HP), grads, params)
  adam = optax.scale_by_adam(b1=HP["b1"], b2=HP["b2"], eps=HP["eps"])
  directions, _ = run(adam, grads[1:], params)
  decay = -LR * HP["weight_decay"] * W0
  assert_close(got[0]["w"], decay)
  for u, d in zip(got[1:], directions):
    assert_close(u["w"], decay - LR * np.asarray(d["w"]))


# --------------------------------------------------------------------------
# grouping: stacks, experts and dimension numbers are matrix by matrix

# Refresh every call; the default eps, so that the sign-like first step is
# not sensitive to rounding in random rotated entries of size about eps.
STACK_HP = dict(precondition_frequency=1, shampoo_beta=0.5)

# Shapes in these tests keep |m - n| <= 1. An m x n gradient (m > n + 1)
# leaves the first factor L a null space of dimension m - n > 1, in which
# any orthonormal basis is an eigenbasis: eigh picks one by rounding, and
# the next (sign-like) Adam step depends on it. Two computations that differ
# only in rounding then disagree far beyond float32 tolerances, as they would
# in the paper's code.

def test_stacked_and_expert_leaves_equal_separate_matrices():
  stack, experts = _normal(1, (2, 3, 2)), _normal(2, (2, 2, 3, 2))
  params = {"blocks": {"mlp": {"kernel": stack},
                       "moe": {"up": {"kernel": experts}}}}
  apart = {f"m{i}": stack[i] for i in range(2)}
  apart.update({f"e{i}{j}": experts[i, j] for i in range(2) for j in range(2)})
  grads = [{"blocks": {"mlp": {"kernel": _normal(10 + s, (2, 3, 2))},
                       "moe": {"up": {"kernel": _normal(20 + s, (2, 2, 3, 2))}}}}
           for s in range(3)]

  def split(tree):
    out = {f"m{i}": tree["blocks"]["mlp"]["kernel"][i] for i in range(2)}
    out.update({f"e{i}{j}": tree["blocks"]["moe"]["up"]["kernel"][i, j]
                for i in range(2) for j in range(2)})
    return out

  tx = optim.soap(LR, **STACK_HP)
  got, states = run(tx, _f32(grads), _f32(params))
  want, _ = run(tx, _f32([split(g) for g in grads]), _f32(apart))
  for u, w in zip(got, want):
    for k, v in split(u).items():
      assert_close(v, w[k])
  s = soap_state(states[-1])
  assert s.q_l["blocks"]["moe"]["up"]["kernel"].shape == (2, 2, 3, 3)
  assert s.r_factor["blocks"]["mlp"]["kernel"].shape == (2, 2, 2)


def _lapack_operands(hlo: str) -> list[str]:
  """The operand shapes of the compiled program's LAPACK calls ('f32[8,8]', ...)."""
  lines = [line for line in hlo.splitlines() if 'custom_call_target="lapack_' in line]
  return [re.search(r"operand_layout_constraints=\{(\w+\[[0-9,]*\])", line).group(1)
          for line in lines]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's LAPACK kernels")
def test_cpu_decompositions_take_one_matrix_per_call():
  """On the CPU every eigh and QR call of a stacked leaf gets one matrix.

  jaxlib's batched CPU kernels block a thread of XLA's pool until the batch
  is done, which deadlocked 2bw with SOAP on 2 emulated devices
  (`_soap._per_matrix`); the batched program, compiled for contrast, shows
  that the check can see a stack.
  """
  params = {"blocks": {"mlp": {"kernel": jnp.zeros((3, 8, 8))}}}
  grads = {"blocks": {"mlp": {"kernel": jnp.asarray(_normal(1, (3, 8, 8)), jnp.float32)}}}
  tx = optim.soap(LR, precondition_frequency=1)
  state = tx.init(params)
  _, state = tx.update(grads, state, params)   # the next call refreshes by QR
  hlo = jax.jit(tx.update).lower(grads, state, params).compile().as_text()
  operands = _lapack_operands(hlo)
  assert operands and set(operands) == {"f32[8,8]"}, operands
  hlo = jax.jit(lambda x: (jnp.linalg.eigh(x)[1], jnp.linalg.qr(x)[0])).lower(
      grads["blocks"]["mlp"]["kernel"]).compile().as_text()
  assert set(_lapack_operands(hlo)) == {"f32[3,8,8]"}


def test_dimension_numbers_pick_the_matrix_axes():
  a, b = _normal(3, (3, 2, 2)), _normal(4, (2, 2, 3))
  # a: rows on axis 0, columns on axis 2, axis 1 a stack of two matrices;
  # b: rows on axes (0, 1) together, one 4 x 3 matrix.
  dims = lambda tree: {"a": MuonDimensionNumbers(0, 2),
                       "b": MuonDimensionNumbers((0, 1), 2)}
  grads = [{"a": _normal(30 + s, (3, 2, 2)), "b": _normal(40 + s, (2, 2, 3))}
           for s in range(3)]
  flat = lambda t: {"a0": t["a"][:, 0], "a1": t["a"][:, 1],
                    "b": t["b"].reshape(4, 3)}
  tx = optim.soap(LR, dimension_numbers=dims, **STACK_HP)
  got, _ = run(tx, _f32(grads), _f32({"a": a, "b": b}))
  want, _ = run(optim.soap(LR, **STACK_HP),
                _f32([flat(g) for g in grads]), _f32(flat({"a": a, "b": b})))
  for u, w in zip(got, want):
    for k, v in flat(jax.tree.map(np.asarray, u)).items():
      assert_close(v, w[k])


def test_adam_group_is_adamw_and_labels():
  params = {"embed": {"embedding": _normal(5, (6, 4))},
            "blocks": {"attn": {"q": {"kernel": _normal(6, (2, 4, 4))}},
                       "attn_norm": {"scale": _normal(7, (2, 4))}},
            "head": {"norm": {"scale": _normal(8, (4,))},
                     "out": {"kernel": _normal(9, (4, 6))}}}
  grads = [jax.tree.map(lambda x, s=s: _normal(50 + s, x.shape), params)
           for s in range(3)]
  got, states = run(optim.soap(LR, weight_decay=0.1), _f32(grads),
                    _f32(params))
  adam_keys = lambda t: {"embed": t["embed"], "head": t["head"],
                         "norm": t["blocks"]["attn_norm"]}
  want, _ = run(optax.adamw(LR, b1=0.95, b2=0.95, eps=1e-8, weight_decay=0.1,
                            mask=optim.weight_decay_mask),
                _f32([adam_keys(g) for g in grads]), _f32(adam_keys(params)))
  for u, w in zip(got, want):
    for x, y in zip(jax.tree.leaves(adam_keys(u)), jax.tree.leaves(w)):
      assert_close(x, y)
  # Only the hidden matrix is SOAP's; the first call moves it by decay alone.
  s = soap_state(states[-1])
  assert [x.shape for x in jax.tree.leaves(s.l_factor)] == [(2, 4, 4)]
  q = params["blocks"]["attn"]["q"]["kernel"]
  assert_close(got[0]["blocks"]["attn"]["q"]["kernel"], -LR * 0.1 * q)

  # 'soap' labels work like 'muon' ones; a vector cannot be SOAP's.
  labels = optim.param_labels(params)
  labels["blocks"]["attn"]["q"]["kernel"] = "soap"
  tx = optim.soap(LR, param_labels=labels)
  same, _ = run(tx, _f32(grads[:2]), _f32(params))
  for x, y in zip(jax.tree.leaves(same), jax.tree.leaves(got[:2])):
    assert_close(x, y)
  labels["head"]["norm"]["scale"] = "soap"
  with pytest.raises(ValueError, match="SOAP needs a matrix"):
    optim.soap(LR, param_labels=labels).init(params)


# --------------------------------------------------------------------------
# dtypes, jit, inject_hyperparams, wrappers, make_optimizer

def test_bf16_params_keep_bf16_and_state_is_float32():
  params = {"blocks": {"mlp": {"kernel": jnp.asarray(_normal(1, (2, 6, 4)),
                                                     jnp.bfloat16)}},
            "out": {"bias": jnp.asarray(_normal(2, (4,)))}}
  grads = [jax.tree.map(lambda x, s=s: jnp.asarray(_normal(60 + s, x.shape),
                                                   x.dtype), params)
           for s in range(3)]
  updates, states = run(optim.soap(LR, precondition_frequency=1), grads,
                        params)
  spec = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
  for u in updates:
    assert spec(u) == spec(params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))
  for s in states[1:]:
    assert spec(s) == spec(states[0])
  s = soap_state(states[-1])
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(s[1:]))
  assert float(jnp.max(jnp.abs(updates[-1]["blocks"]["mlp"]["kernel"]))) > 0


def test_jit_and_inject_hyperparams():
  params = _f32({"w": _normal(1, (2, 3, 2)), "b": _normal(2, (2,))})
  grads = [_f32(jax.tree.map(lambda x, s=s: _normal(70 + s, x.shape), params))
           for s in range(3)]
  tx = optax.inject_hyperparams(optim.soap)(learning_rate=0.1,
                                            precondition_frequency=1)
  got, states = run(tx, grads, params)
  want, _ = run(optim.soap(0.1, precondition_frequency=1), grads, params)
  for u, w in zip(got, want):
    for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(w)):
      assert_close(x, y)
  state = states[-1]
  update = jax.jit(tx.update)
  u_before, _ = update(grads[0], state, params)
  state.hyperparams["learning_rate"] = jnp.asarray(0.01)
  u_after, _ = update(grads[0], state, params)
  for x, y in zip(jax.tree.leaves(u_after), jax.tree.leaves(u_before)):
    assert_close(x, 0.1 * np.asarray(y), rtol=1e-5, atol=1e-8)

  # max_precond_dim fixes the state's shapes; static_args keeps it static.
  tx = optax.inject_hyperparams(optim.soap, static_args=("max_precond_dim",))(
      learning_rate=0.1, max_precond_dim=2)
  assert soap_state(jax.jit(tx.init)(params)).q_l["w"].shape == (2, 0, 0)


def test_delay_and_error_feedback_compose():
  params = _f32({"w": _normal(1, (3, 2)), "b": _normal(2, (2,))})
  grads = [_f32(jax.tree.map(lambda x, s=s: _normal(80 + s, x.shape), params))
           for s in range(4)]
  inner = optim.soap(LR, precondition_frequency=1)
  plain, _ = run(inner, grads, params)
  delayed, _ = run(optim.delay(inner), grads, params)
  for x in jax.tree.leaves(delayed[0]):
    np.testing.assert_array_equal(x, 0.0)
  for t in range(1, 4):
    for x, y in zip(jax.tree.leaves(delayed[t]), jax.tree.leaves(plain[t - 1])):
      assert_close(x, y)
  corrected, _ = run(optim.error_feedback(inner, 0.5), grads, params)
  for t in range(1, 4):
    for x, v, v_prev in zip(jax.tree.leaves(corrected[t]),
                            jax.tree.leaves(plain[t]),
                            jax.tree.leaves(plain[t - 1])):
      assert_close(x, 1.5 * np.asarray(v) - 0.5 * np.asarray(v_prev),
                   rtol=1e-6, atol=1e-7)


def test_build_and_config_keys():
  cfg = OptimizerConfig(name="soap", lr=0.01, schedule="constant",
                        warmup_steps=0, clip_norm=0.0, weight_decay=0.1,
                        soap=SoapConfig(precondition_frequency=2, shampoo_beta=0.9,
                                        max_precond_dim=2))
  params = _f32({"w": _normal(1, (3, 2)), "norm": {"scale": _normal(2, (2,))}})
  grads = [_f32(jax.tree.map(lambda x, s=s: _normal(90 + s, x.shape), params))
           for s in range(3)]
  got, states = run(optim.make_optimizer(cfg, 10), grads, params)
  want, _ = run(optim.soap(0.01, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                           shampoo_beta=0.9, precondition_frequency=2,
                           max_precond_dim=2), grads, params)
  for u, w in zip(got, want):
    for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(w)):
      assert_close(x, y)
  assert soap_state(states[-1]).q_l["w"].shape == (0, 0)

  defaults = OptimizerConfig().soap
  assert (defaults.precondition_frequency, defaults.shampoo_beta,
          defaults.max_precond_dim) == (10, 0.95, 10000)
  assert config_lib.load(None, ["optimizer.name=soap"]).optimizer.name == "soap"
  for bad in ("precondition_frequency=0", "shampoo_beta=1.0",
              "max_precond_dim=-1"):
    with pytest.raises(ConfigError, match=bad.split("=")[0]):
      config_lib.load(None, ["optimizer.name=soap", f"optimizer.soap.{bad}"])


def test_multisteps_and_partition():
  params = _f32({"w": _normal(1, (2, 3, 2)), "b": _normal(2, (2,))})
  grads = [_f32(jax.tree.map(lambda x, s=s: _normal(100 + s, x.shape),
                             params)) for s in range(4)]
  inner = lambda: optim.soap(LR, **STACK_HP)
  got, _ = run(optax.MultiSteps(inner(), every_k_schedule=2), grads, params)
  mean = [jax.tree.map(lambda a, b: (a + b) / 2, *grads[i:i + 2])
          for i in (0, 2)]
  want, _ = run(inner(), mean, params)
  for t, w in ((1, want[0]), (3, want[1])):
    for x, y in zip(jax.tree.leaves(got[t]), jax.tree.leaves(w)):
      assert_close(x, y, rtol=1e-5, atol=1e-7)
  for x in jax.tree.leaves(got[0]) + jax.tree.leaves(got[2]):
    np.testing.assert_array_equal(x, 0.0)

  outer = optax.partition({"a": inner(), "b": optax.sgd(1.0)},
                          {"net": "a", "other": "b"})
  nested = [{"net": g, "other": g["b"]} for g in grads[:3]]
  got, _ = run(outer, nested, {"net": params, "other": params["b"]})
  want, _ = run(inner(), grads[:3], params)
  for u, w, g in zip(got, want, grads):
    for x, y in zip(jax.tree.leaves(u["net"]), jax.tree.leaves(w)):
      assert_close(x, y)
    assert_close(u["other"], -np.asarray(g["b"]))


def test_state_is_parameter_shaped_for_the_trainer():
  """`optax.tree_map_params` (how the trainer shards optimizer state) sees
  every SOAP field as a copy of the params, so stacked factors and bases take
  the stack's sharding on their leading axis."""
  f32 = jnp.float32
  params = {"blocks": {"mlp": {"kernel": jax.ShapeDtypeStruct((2, 6, 4), f32)},
                       "norm": {"scale": jax.ShapeDtypeStruct((2, 4), f32)}},
            "embed": {"embedding": jax.ShapeDtypeStruct((5, 6), f32)}}
  specs = {"blocks": {"mlp": {"kernel": "stage"}, "norm": {"scale": "stage"}},
           "embed": {"embedding": "vocab"}}
  tx = optim.soap(0.1)
  state = jax.eval_shape(tx.init, params)
  masked = lambda x: isinstance(x, optax.MaskedNode)
  out = optax.tree_map_params(
      tx, lambda x, spec: x if masked(x) else spec, state, specs,
      transform_non_params=lambda _: "replicated", is_leaf=masked)
  s, shapes = soap_state(out), soap_state(state)
  assert s.count == "replicated"
  for field, shape in zip(s[1:], shapes[1:]):
    assert field["blocks"]["mlp"]["kernel"] == "stage"
    assert shape["blocks"]["mlp"]["kernel"].shape[0] == 2


def test_docstring_example_runs():
  result = doctest.testmod(_soap, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0

