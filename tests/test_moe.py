"""The Mixture-of-Experts model in every schedule against its one-device reference.

The same checks as the dense model's in test_pipeline.py, on a model whose
blocks route tokens to 4 experts (top 2, capacity 1.25) and add a
load-balancing loss, which every stage's backward must carry.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpipe import model as model_lib
from jaxpipe import optim
from jaxpipe import trainer
from jaxpipe.config import ModelConfig, MoEConfig
from jaxpipe.pipeline import make_mesh, make_schedule

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                  moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.25,
                                aux_loss_coeff=0.1))
ROWS, SEQ, STEPS = 4, 8, 4
MODEL = model_lib.build(CFG)
FNS = trainer.stage_fns(MODEL)


def _opt(delay=0):
  # eps 1e-6: see tests/_pipeline_util.py on Adam and rounding-level gradients.
  tx = optim.adamw(1e-3, eps=1e-6)
  return optim.delay(tx, delay) if delay else tx


def _batches(m):
  rng = np.random.default_rng(7 + m)
  seq = [rng.integers(0, 64, (m, ROWS, SEQ + 1)).astype(np.int32) for _ in range(STEPS)]
  return [(s[..., :-1].copy(), s[..., 1:].copy()) for s in seq]


_INIT = jax.device_get(jax.jit(MODEL.init)(jax.random.key(0)))


def _run(schedule, stages, data, m, tx, stash="inputs"):
  sch = make_schedule(schedule, FNS, tx, make_mesh(stages, data), m, stash=stash)
  state = sch.init(jax.tree.map(jnp.asarray, _INIT), (m, ROWS, SEQ))
  losses = {}
  for tok, tgt in _batches(m):
    state, met = sch.step(state, jax.device_put(tok, sch.batch_sharding()),
                          jax.device_put(tgt, sch.batch_sharding()))
    if int(met["loss_step"]) >= 0:
      losses[int(met["loss_step"])] = float(met["loss"])
  if sch.pending_loss(state) is not None:
    losses[STEPS - 1] = float(sch.pending_loss(state))
  return np.array([losses[k] for k in range(STEPS)]), jax.device_get(sch.params(state))


def _match(got, want):
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=5e-6), got[1], want[1])


def test_moe_aux_loss_is_in_the_objective():
  tok, tgt = _batches(1)[0]
  params = jax.tree.map(jnp.asarray, _INIT)
  x, aux = MODEL.apply_blocks(params["blocks"], MODEL.embed(params, tok[0]))
  assert float(aux) > 0
  np.testing.assert_allclose(float(MODEL.loss(params, tok[0], tgt[0])),
                             float(MODEL.head_loss(params, x, tgt[0]) + aux), rtol=1e-6)


@pytest.mark.parametrize("schedule,stages,data,m", [
    ("gpipe", 2, 2, 2), ("1f1b", 4, 1, 4)])
def test_synchronous_schedules_match_one_device(schedule, stages, data, m):
  _match(_run(schedule, stages, data, m, _opt()), _run("none", 1, 1, m, _opt()))


def test_2bw_matches_one_device_with_delay():
  """With the residual stash the routing and the load-balancing loss of the forward
  are what the backward pulls back through, not a recomputation (the other
  schedules here recompute from the stashed inputs)."""
  _match(_run("2bw", 2, 2, 2, _opt(), "residuals"), _run("none", 1, 1, 2, _opt(delay=1)))


def test_pipedream_matches_stale_reference():
  """Stage s runs batch k on its weights of max(0, k-(S-1-s)) updates ago."""
  stages, m = 2, 2
  got = _run("pipedream", stages, 1, m, _opt())
  tx = _opt()
  per = CFG.n_layers // stages

  @jax.jit
  def grads(params, tok, tgt):
    def micro(c, b):
      loss, g = jax.value_and_grad(MODEL.loss)(params, *b)
      return (jax.tree.map(jnp.add, c[0], g), c[1] + loss), None
    (g, loss), _ = jax.lax.scan(micro, (jax.tree.map(jnp.zeros_like, params), 0.0), (tok, tgt))
    return loss / m, jax.tree.map(lambda x: x / m, g)

  @jax.jit
  def update(g, state, params):
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state

  history, state, losses = [_INIT], tx.init(_INIT), []
  for k, (tok, tgt) in enumerate(_batches(m)):
    old = history[max(0, k - 1)]  # stage 0 lags one update, stage 1 none
    point = {"embed": old["embed"], "head": history[k]["head"],
             "blocks": jax.tree.map(lambda a, b: np.concatenate([a[:per], b[per:]]),
                                    old["blocks"], history[k]["blocks"])}
    loss, g = grads(point, tok, tgt)
    params, state = update(g, state, history[-1])
    history.append(jax.device_get(params))
    losses.append(float(loss))
  _match(got, (np.array(losses), history[-1]))
