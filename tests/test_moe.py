"""The Mixture-of-Experts model in every schedule against its one-device reference.

The same checks as the dense model's in test_pipeline.py, on a model whose
blocks route tokens to 4 experts (top 2, capacity 1.25) and add a
load-balancing loss, which every stage's backward must carry. On meshes with
2 data replicas the experts are split over them (expert parallelism: each
replica holds 2 of the 4 and tokens travel by all-to-all), and every schedule
must still train as one device does.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxpipe import model as model_lib
from jaxpipe import optim
from jaxpipe import trainer
from jaxpipe.config import ModelConfig, MoEConfig
from jaxpipe.pipeline import expert_exchange, make_mesh, make_schedule
from tests import _pipeline_util as util

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                  moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.25,
                                aux_loss_coeff=0.1))
ROWS, SEQ, STEPS = 4, 8, 4
MODEL = model_lib.make_model(CFG, exchange=expert_exchange)
FNS = trainer.stage_fns(MODEL)


def _opt(delay=0, name="adamw", ef=0.0):
  # eps 1e-6: see tests/_pipeline_util.py on Adam and rounding-level gradients.
  tx = (optim.adamw(1e-3, eps=1e-6) if name == "adamw"
        else optim.muon(0.02, adam_learning_rate=1e-3, eps=1e-6))
  if ef:
    tx = optim.error_feedback(tx, ef)
  return optim.delay(tx, delay) if delay else tx


def _batches(m):
  rng = np.random.default_rng(7 + m)
  seq = [rng.integers(0, 64, (m, ROWS, SEQ + 1)).astype(np.int32) for _ in range(STEPS)]
  return [(s[..., :-1].copy(), s[..., 1:].copy()) for s in seq]


_INIT = jax.device_get(jax.jit(MODEL.init)(jax.random.key(0)))


def _schedule(schedule, stages, data, m, tx, stash="inputs", expert_parallel=True):
  return make_schedule(schedule, FNS, tx, make_mesh(stages, data), m, stash=stash,
                       expert_parallel=expert_parallel)


def _run(schedule, stages, data, m, tx, stash="inputs", expert_parallel=True, hlo=None):
  """(losses by batch, final weights, {batch: its gradient's norm}); the compiled
  step's HLO is appended to `hlo`."""
  sch = _schedule(schedule, stages, data, m, tx, stash, expert_parallel)
  state = sch.init(jax.tree.map(jnp.asarray, _INIT), (m, ROWS, SEQ))
  losses, norms = {}, {}
  for tok, tgt in _batches(m):
    tok, tgt = (jax.device_put(x, sch.batch_sharding()) for x in (tok, tgt))
    if hlo is not None and not hlo:
      hlo.append(sch.lower_step(state, tok, tgt).compile().as_text())
    state, met = sch.step(state, tok, tgt)
    if int(met["loss_step"]) >= 0:
      losses[int(met["loss_step"])] = float(met["loss"])
      norms[int(met["loss_step"])] = float(met["grad_norm"])
  if sch.pending_loss(state) is not None:
    losses[STEPS - 1] = float(sch.pending_loss(state))
  return (np.array([losses[k] for k in range(STEPS)]), jax.device_get(sch.params(state)),
          norms)


def _match(got, want):
  """Losses and final weights; and the gradient norms of the batches both report.

  The norms catch what Adam's and Muon's scale invariance would hide in the
  weights: an expert gradient summed over the replicas once too often.
  """
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=5e-6), got[1], want[1])
  if len(got) > 2 and len(want) > 2:
    both = sorted(set(got[2]) & set(want[2]))
    assert len(both) >= STEPS - 1, both
    np.testing.assert_allclose([got[2][k] for k in both], [want[2][k] for k in both],
                               rtol=1e-5)


def test_moe_aux_loss_is_in_the_objective():
  tok, tgt = _batches(1)[0]
  params = jax.tree.map(jnp.asarray, _INIT)
  x, aux = MODEL.apply_blocks(params["blocks"], MODEL.embed(params, tok[0]))
  assert float(aux) > 0
  np.testing.assert_allclose(float(MODEL.loss(params, tok[0], tgt[0])),
                             float(MODEL.head_loss(params, x, tgt[0]) + aux), rtol=1e-6)


@pytest.mark.parametrize("schedule,stages,data,m", [
    ("gpipe", 2, 2, 2), ("1f1b", 4, 2, 4), ("zb1", 2, 2, 2), ("none", 1, 2, 2)])
def test_synchronous_schedules_match_one_device(schedule, stages, data, m):
  _match(_run(schedule, stages, data, m, _opt()), _run("none", 1, 1, m, _opt()))


@pytest.mark.parametrize("opt,ef,stash", [("adamw", 0.0, "residuals"), ("muon", 1.0, "inputs")])
def test_2bw_matches_one_device_with_delay(opt, ef, stash):
  """With the residual stash the routing and the load-balancing loss of the forward
  are what the backward pulls back through, not a recomputation (the input
  stash recomputes them). Muon orthogonalises each expert's matrices on the
  replica that holds them."""
  _match(_run("2bw", 2, 2, 2, _opt(name=opt, ef=ef), stash),
         _run("none", 1, 1, 2, _opt(delay=1, name=opt, ef=ef)))


def test_experts_are_split_over_data_and_tokens_travel_by_all_to_all():
  """Each replica holds E/D experts of its stage's blocks; without expert
  parallelism every replica holds all of them, and both train the same."""
  on_hlo, off_hlo = [], []
  sch = _schedule("2bw", 2, 2, 2, _opt())
  state = jax.eval_shape(lambda p: sch.init(p, (2, ROWS, SEQ)), _INIT)
  shardings = sch.state_shardings(state)
  for name in ("gate", "up", "down"):
    spec = shardings.cur["blocks"]["moe"][name]["kernel"].spec
    shape = state.cur["blocks"]["moe"][name]["kernel"].shape
    assert spec == P("stage", "data"), spec
    local = shardings.cur["blocks"]["moe"][name]["kernel"].shard_shape(shape)
    assert local[:2] == (CFG.n_layers // 2, CFG.moe.num_experts // 2)
  assert shardings.cur["blocks"]["moe"]["router"]["kernel"].spec == P("stage")
  on = _run("2bw", 2, 2, 2, _opt(), hlo=on_hlo)
  off = _run("2bw", 2, 2, 2, _opt(), expert_parallel=False, hlo=off_hlo)
  assert util.collectives(on_hlo[0], "all-to-all")
  assert not util.collectives(off_hlo[0], "all-to-all")
  _match(on, off)


def test_expert_parallelism_needs_the_replicas_to_divide_the_experts():
  sch = _schedule("2bw", 1, 8, 2, _opt())
  with pytest.raises(ValueError, match="does not divide them"):
    sch.init(jax.tree.map(jnp.asarray, _INIT), (2, 8, SEQ))
  # Behind pipedream's version axis the experts are the third axis, not the
  # second: 6 layers x 4 experts over 4 replicas is a valid split.
  sch = _schedule("pipedream", 2, 4, 2, _opt())
  versions = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2, 6) + x.shape[1:], x.dtype),
                          _INIT["blocks"])
  axes = sch.expert_axes(versions, lead=1)
  assert axes["moe"]["gate"]["kernel"] == 1 and axes["moe"]["router"]["kernel"] is None


def _update_flops(data):
  sch = _schedule("2bw", 2, data, 2, _opt(name="muon"))
  state = jax.eval_shape(lambda p: sch.init(p, (2, ROWS, SEQ)), _INIT)
  sh = sch.state_shardings(state)
  update = lambda p, o, g: sch._update(p, o, g, jnp.array(True))[:2]  # pylint: disable=protected-access
  fn = jax.jit(update, in_shardings=(sh.cur, sh.opt_state, sh.cur),
               out_shardings=(sh.cur, sh.opt_state))
  return fn.lower(state.cur, state.opt_state, state.cur).compile().cost_analysis()["flops"]


def test_newton_schulz_of_split_experts_stays_on_their_replica():
  """The partitioned Muon update's FLOPs per device halve from D=1 to D=2.

  An expert leaf [layers, experts, in, out] is split over 'stage' on its
  layers and over 'data' on its experts; flattening both into one batch
  axis (as optax's Muon does) would gather the stack, and every replica
  would orthogonalise every expert.
  """
  assert _update_flops(2) < 0.6 * _update_flops(1)


def test_pipedream_matches_stale_reference():
  """Stage s runs batch k on its weights of max(0, k-(S-1-s)) updates ago."""
  stages, m = 2, 2
  got = _run("pipedream", stages, 2, m, _opt())
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
