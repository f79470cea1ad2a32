"""ZB-H1 (`zb1`) against the one-device reference, and what its step executes.

On the emulated 8-device CPU mesh (`conftest.py`), in float32, on the tiny
model of `_pipeline_util`:
- zb1 at S=2 and S=4, data 1 and 2, both stashes, tied embeddings,
  `model.remat=dots`, a gradient clip that binds, the head on the last
  stage and M below S, each against `schedule=none` on the same global
  batch (it flushes every step: no delay);
- what every stage of a zb1 step runs, recorded from inside the step,
  against the timetable's cells: with `stash='residuals'` exactly one
  forward per microbatch and stage (B and W recompute nothing), with
  'inputs' one more, in B;
- the plan's rings: every B reads what its F stashed, every W what its B
  kept, and a received input or cotangent waits for its F or B in one buffer;
- two steps through train.py, and the checkpoint's weights as export reads them.

"Match" is `_pipeline_util.assert_runs_match` (losses rtol 1e-5, weights
atol 5e-6).
"""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import io_callback

from jaxpipe import runs
from jaxpipe.pipeline import facts, make_mesh, make_schedule, step_plan, timetable

from tests import _pipeline_util as util
from tests import _runs
from tests._pipeline_util import STEPS, assert_runs_match, run

# (S, D, M, stash, variant): S=2 and 4, data 1 and 2, both stashes; the
# variants ride on shapes that cover them cheaply (each run is a compile).
CASES = [
    (2, 1, 8, "residuals", "tied"),
    (2, 2, 4, "inputs", "clip"),
    (4, 1, 8, "residuals", "dots"),
    (4, 2, 4, "inputs", "plain"),
    (4, 2, 2, "residuals", "last_stage"),
]
CLIP = 0.1   # below every gradient norm of these runs: the clip binds


def _variant(variant):
  """(model config, optimizer kwargs, run kwargs) of a variant."""
  if variant == "tied":
    return util.config(tie_embeddings=True), {}, {}
  if variant == "dots":
    return util.config(remat="dots"), {}, {}
  if variant == "clip":
    return util.CONFIG, {"clip": CLIP}, {}
  if variant == "last_stage":
    return util.CONFIG, {}, {"vocab_parallel": False}
  return util.CONFIG, {}, {}


def _reference(m, variant):
  cfg, opt, _ = _variant(variant)
  # remat recomputes the same float32 operations: the plain model is the reference.
  cfg = util.CONFIG if variant == "dots" else cfg
  return run("none", 1, 1, m, "adamw", cfg=cfg, **opt)


@pytest.mark.parametrize("s,d,m,stash,variant", CASES,
                         ids=[f"S{s}-D{d}-M{m}-{st}-{x}" for s, d, m, st, x in CASES])
def test_zb1_matches_one_device(s, d, m, stash, variant):
  """zb1 trains exactly as one device on the whole batch.

  Every batch's loss at the weights it ran on, and the final weights, to
  float32 rounding: B and W together give the unsplit gradient, each W
  adds into the step's accumulator once.
  """
  cfg, opt, extra = _variant(variant)
  got = run("zb1", s, d, m, "adamw", stash=stash, cfg=cfg, **opt, **extra)
  want = _reference(m, variant)
  assert got.loss_steps == tuple(range(STEPS))
  assert_runs_match(got, want)
  if variant == "clip":
    assert np.all(got.grad_norms > 2 * CLIP)
    np.testing.assert_allclose(got.grad_norms, want.grad_norms, rtol=1e-5)
  if variant == "tied":
    assert "out" not in got.params["head"]


# --- what the engine executes ------------------------------------------------

# S=4 stages on data 2, M=4: 10 ticks.
COUNT = (4, 2, 4)


def _counting(stage, log):
  """`stage` reporting every forward it runs (stage, data, input) from the device, in order.

  The report is in the forward itself and in the forward of its vjp (a
  custom_vjp whose backward is the stage's own pullback, from the stage's
  residuals: nothing recomputed there), so a forward that B recomputes
  (`stash='inputs'`) reports too.
  """
  def report(x):
    record = lambda s, d, x: log.append((int(s), int(d), np.array(x)))
    io_callback(record, None, lax.axis_index("stage"), lax.axis_index("data"), x, ordered=True)

  @jax.custom_vjp
  def counted(blocks, x):
    report(x)
    return stage(blocks, x)

  def forward(blocks, x):
    report(x)
    out, pull = jax.vjp(stage, blocks, x)
    return out, pull

  def backward(pull, g):
    return pull(g)

  counted.defvjp(forward, backward)
  return counted


def _stage_inputs(params, tokens, num_stages):
  """{stage: [input of each microbatch]}, on one device."""
  mdl = util.model(util.CONFIG)
  per = util.CONFIG.n_layers // num_stages
  out = collections.defaultdict(list)
  for tok in tokens:
    x = mdl.embed(params, tok)
    for s in range(num_stages):
      out[s].append(np.asarray(x))
      part = jax.tree.map(lambda w: w[s * per:(s + 1) * per], params["blocks"])
      x, _ = mdl.apply_blocks(part, x)
  return out


@functools.cache
def _counted(stash):
  """{(step, stage, data): [global microbatch of each forward]} of two steps."""
  s_, d_, m = COUNT
  log = []
  fns = util.stage_fns(util.CONFIG)
  fns = fns._replace(stage=_counting(fns.stage, log))
  sch = make_schedule("zb1", fns, util.optimizer("adamw"), make_mesh(s_, d_), m, stash=stash)
  state = sch.init(jax.tree.map(jnp.asarray, util.initial_params(util.CONFIG)),
                   (m, util.ROWS, util.SEQ))
  rows = util.ROWS // d_
  calls = {}
  for k, (tok, tgt) in enumerate(util.batches(m, util.CONFIG.vocab_size)[:2]):
    inputs = _stage_inputs(sch.params(state), tok, s_)
    log.clear()
    state, metrics = sch.step(state, jax.device_put(tok, sch.batch_sharding()),
                              jax.device_put(tgt, sch.batch_sharding()))
    assert bool(metrics["ran"])
    jax.effects_barrier()
    for s, d, x in log:
      near = [i for i in range(m)
              if np.allclose(x, inputs[s][i][d * rows:(d + 1) * rows], rtol=0, atol=1e-4)]
      assert len(near) == 1, f"step {k}: stage {s} ran on the input of no microbatch"
      calls.setdefault((k, s, d), []).append(k * m + near[0])
  return calls


def _planned(step, stage, with_b):
  """The forwards the timetable gives a stage in a step, in tick order: its F cells
  (and, `with_b`, its B cells, which recompute the forward)."""
  s_, _, m = COUNT
  plan = step_plan("zb1", s_, m)
  table = timetable("zb1", s_, m, num_steps=2)
  out = []
  for t in range(plan.num_ticks):
    c = table.cells[step * plan.num_ticks + t][stage]
    for mb, column in ((c.fwd, plan.fwd), (c.bwd, plan.bwd)):
      assert mb == (None if column[t, stage] < 0 else step * m + int(column[t, stage]))
    assert c.wgt == tuple(step * m + int(w) for w in plan.wgt[t, stage] if w >= 0)
    if c.fwd is not None:
      out.append(c.fwd)
    if with_b and c.bwd is not None:
      out.append(c.bwd)
  return out


@pytest.mark.parametrize("stash", ["residuals", "inputs"])
def test_zb1_runs_one_forward_per_microbatch_and_stage(stash):
  """Every stage's forwards are the drawn cells, in order, and nothing else runs one.

  Recorded from inside the step (an io_callback in the stage function's
  forward; the microbatch recognised by the input against every stage's
  inputs computed on one device). With `stash='residuals'` each stage runs
  each microbatch's forward exactly once, at its F: neither B nor W
  recomputes it. With 'inputs', B recomputes it once, and W never does.
  """
  s_, d_, m = COUNT
  calls = _counted(stash)
  assert sorted(calls) == [(k, s, d) for k in range(2) for s in range(s_) for d in range(d_)]
  for (k, s, d), got in calls.items():
    assert got == _planned(k, s, stash == "inputs"), (k, s, d)
    per = collections.Counter(got)
    assert set(per.values()) == {1 if stash == "residuals" else 2}
    assert sorted(per) == list(range(k * m, (k + 1) * m))


def test_zb1_traces_w_under_its_own_phase():
  """A profile tells B from W: the compiled step's dots fall in both phases.

  Each stage's weight-gradient matmuls are W's (`pipe_weight_grad`), its
  input-gradient matmuls B's (`pipe_backward`); 1f1b's unsplit backward has
  no W phase.
  """
  from tools.cpu import account  # pylint: disable=g-import-not-at-top
  m = 4

  def dots_by_phase(name):
    sch = make_schedule(name, util.stage_fns(), util.optimizer("adamw"), make_mesh(2, 1), m,
                        stash="residuals")
    state = sch.init(jax.tree.map(jnp.asarray, util.initial_params()), (m, util.ROWS, util.SEQ))
    tok, tgt = (jax.device_put(x, sch.batch_sharding()) for x in util.batches(m)[0])
    ops = account.hlo_ops(sch.lower_step(state, tok, tgt).compile().as_text())
    return collections.Counter(phase for opcode, phase in ops.values() if opcode == "dot")

  zb1, plain = dots_by_phase("zb1"), dots_by_phase("1f1b")
  assert zb1["weight_grad"] > 0 and zb1["backward"] > 0, zb1
  assert plain["weight_grad"] == 0 and plain["backward"] > 0, plain


# --- the plan -----------------------------------------------------------------

@pytest.mark.parametrize("s", [2, 3, 4, 8])
def test_zb1_plan_rings_hold_each_value_until_it_is_read(s):
  """Replaying the plan's slots: every B reads its F's stash entry, every W its B's.

  In the engine's order within a tick, per stage: F writes its entry
  (slot mod the ring), B reads one and writes W's stash, then the tick's
  W's read theirs. A received input (cotangent) is read by the stage's F
  (B) of that microbatch before the neighbour sends the next one
  (`inbox_slots` 1). The rings are 1F1B's 2(S-1)+1 slots and at most S+1
  of W's, as `w_slots` says.
  """
  for m in range(1, 13):
    plan = step_plan("zb1", s, m)
    assert plan.split_backward and plan.slots == 2 * s - 1
    assert 1 <= plan.w_slots <= s + 1
    assert plan.inbox_slots == 1
    for st in range(s):
      ring, wring, ran = {}, {}, []
      for t in range(plan.num_ticks):
        f, b = int(plan.fwd[t, st]), int(plan.bwd[t, st])
        if f >= 0:
          ring[int(plan.fwd_slot[t, st]) % plan.slots] = f
        if b >= 0:
          assert ring[int(plan.bwd_slot[t, st]) % plan.slots] == b
          wring[int(plan.bwd_wslot[t, st])] = b
        for w, slot in zip(plan.wgt[t, st], plan.wgt_slot[t, st]):
          if w >= 0:
            assert 0 <= slot < plan.w_slots and wring.pop(int(slot)) == w
            ran.append(int(w))
      assert sorted(ran) == list(range(m)) and not wring


# Step length in units (F = B = W = 1): 1F1B's 3(M+S-1), ZB-H1's own
# 3M+S-1, and zb1's on 1F1B's ticks (`_zbh1`): ZB-H1's at S=2, between the
# two beyond.
ZB1_UNITS = {(2, 8): 25, (2, 32): 97, (4, 4): 17, (4, 8): 29, (8, 16): 61}


def test_zb1_step_is_3m_plus_2s_minus_3_units():
  """On 1F1B's ticks W fills all it can: 3M+2S-3 units for M >= S, one more below.

  At S=2 that is ZB-H1's own 3M+S-1 (M >= 2); beyond, S units less than
  1F1B's 3(M+S-1) for every M.
  """
  for s in range(2, 9):
    for m in range(1, 25):
      cost = facts("zb1", s, m).step_cost
      assert cost == 3 * m + 2 * s - 3 + (m < s), (s, m)
      assert cost == facts("1f1b", s, m).step_cost - s + (m < s), (s, m)


@pytest.mark.parametrize("s,m", sorted(ZB1_UNITS))
def test_zb1_facts(s, m):
  """1F1B's M+2(S-1) ticks, each as long as its busiest stage's F, B and W's.

  The same from the facts, the plan's tick costs and the drawn cells; at
  S=2 the step is ZB-H1's 3M+S-1 units (bubble (S-1)/(3M+S-1)), never
  longer than 1F1B's; one weight version, no delay, 1F1B's stash slots.
  """
  f = facts("zb1", s, m)
  assert f.ticks == m + 2 * (s - 1) == facts("1f1b", s, m).ticks
  assert f.step_cost == ZB1_UNITS[(s, m)]
  assert 3 * m + s - 1 <= f.step_cost < facts("1f1b", s, m).step_cost
  assert f.bubble == pytest.approx(1 - 3 * m / f.step_cost)
  if s == 2:
    assert f.bubble == pytest.approx((s - 1) / (3 * m + s - 1))
  assert (f.versions, f.gradient_delay, f.flushes, f.stash_slots) == (1, "none", True,
                                                                       2 * s - 1)
  tt = timetable("zb1", s, m, num_steps=1)
  assert tt.idle_fraction(0) == pytest.approx(f.bubble)
  assert "W0" in tt.ascii() and f"idle {f.bubble:.1%}" in tt.ascii()


# --- through train.py -----------------------------------------------------------

def test_train_py_trains_zb1_as_one_device_and_exports_its_weights(tmp_path):
  """Two steps of zb1 at S=2, M=4 through train.py give `none`'s losses, and
  `runs.load_params` (export, generation) reads its checkpoint as `none`'s weights."""
  base = ("run.steps=2", "pipeline.microbatches=4", "checkpoint.every=2", "optimizer.eps=1e-6")
  cache = str(tmp_path / "cache")
  zb1_dir, none_dir = str(tmp_path / "zb1"), str(tmp_path / "none")
  p = _runs.run(zb1_dir, *base, "pipeline.schedule=zb1", "pipeline.stages=2", cache_dir=cache)
  assert p.returncode == 0, p.stderr
  assert "jaxpipe zb1" in p.stdout
  q = _runs.run(none_dir, *base, cache_dir=cache)
  assert q.returncode == 0, q.stderr
  got, want = _runs.train_losses(zb1_dir), _runs.train_losses(none_dir)
  assert sorted(got) == sorted(want) == [0, 1]
  np.testing.assert_allclose([got[k] for k in (0, 1)], [want[k] for k in (0, 1)],
                             rtol=1e-5, atol=1e-6)
  _, params, at = runs.load_params(zb1_dir, 2)
  _, ref, _ = runs.load_params(none_dir, 2)
  assert at == 2
  for g, w in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=5e-6)


def test_config_takes_any_m_and_refuses_chunks():
  """zb1 runs any M >= 1 (its plan holds for M < S too) and one chunk per device:
  virtual_stages=2 is one ConfigError naming the key and the fix."""
  from jaxpipe import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe.errors import ConfigError  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(_runs.TINY, ["pipeline.schedule=zb1", "pipeline.stages=4",
                                     "pipeline.microbatches=1", "data.batch_size=4"])
  assert (cfg.pipeline.schedule, cfg.pipeline.microbatches) == ("zb1", 1)
  with pytest.raises(ConfigError) as e:
    config_lib.load(_runs.TINY, ["pipeline.schedule=zb1", "pipeline.stages=2",
                                 "pipeline.virtual_stages=2"])
  message = str(e.value)
  assert "\n" not in message
  assert "pipeline.virtual_stages=2" in message and "pipeline.virtual_stages=1" in message
