"""Numerical tests of the pipeline engine against one-device references.

On an emulated 8-device CPU mesh (`conftest.py`), in float32:
- gpipe and 1f1b against `schedule=none` on the same global batch;
- 2bw against `schedule=none` with `optim.delay(opt, 1)`, for AdamW and Muon,
  with and without `optim.error_feedback`;
- pipedream against a one-device reference with stage-dependent delays;
- the compiled 2bw step's collectives (stage-to-stage permutes only);
- clear errors for impossible settings.

"Match" means the same loss for every batch (rtol 1e-5, atol 1e-6) and the same
final weights (atol 5e-6). Each training run is cached in `_pipeline_util`,
so a run that several tests compare is compiled and trained once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpipe.pipeline import make_mesh, make_schedule

from tests import _pipeline_util as util
from tests._pipeline_util import STEPS, assert_runs_match, run, stale_reference


def _max_diff(a, b) -> float:
  """Largest absolute difference between two weight trees."""
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _shape_id(shape) -> str:
  """A readable test id for an (S, D, M) shape."""
  s, d, m = shape
  return f"S{s}-D{d}-M{m}"


# --- gpipe and 1f1b ----------------------------------------------------------

# S=2 with M = S; S=2 and data=2 with M not a multiple of S; S=4 and data=2.
SYNC_SHAPES = [(2, 1, 2), (2, 2, 3), (4, 2, 4)]


@pytest.mark.parametrize("shape", SYNC_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_synchronous_schedules_match_one_device(schedule, shape):
  """gpipe and 1f1b train exactly as one device on the whole batch."""
  s, d, m = shape
  got = run(schedule, s, d, m, "adamw")
  want = run("none", 1, 1, m, "adamw")
  assert got.loss_steps == tuple(range(STEPS))
  assert_runs_match(got, want)


def test_the_reference_trains():
  """The comparisons above could not pass with an engine that does nothing."""
  want = run("none", 1, 1, 2, "adamw")
  assert _max_diff(want.params, util.initial_params()) > 1e-3
  assert len(set(want.losses.tolist())) == STEPS


# --- 2bw ---------------------------------------------------------------------

# (optimizer, error-feedback coefficient, (S, D, M)): every optimizer with and
# without the correction; S=2 and S=4, data 1 and 2, M at 2bw's minimum 2(S-1)
# and above it (M=3 and 7: not multiples of S).
TWO_BW_CASES = [
    ("adamw", 0.0, (2, 1, 2)),
    ("adamw", 0.0, (4, 2, 6)),
    ("adamw", 1.0, (4, 1, 7)),
    ("muon", 0.0, (2, 2, 3)),
    ("muon", 1.0, (4, 2, 6)),
]
# The case whose compiled HLO test_2bw_step_collectives reads.
HLO_CASE = ("adamw", 0.0, (4, 2, 6))


def _run_2bw(opt, ef, shape):
  """The (cached) 2bw run of a TWO_BW_CASES entry."""
  s, d, m = shape
  return run("2bw", s, d, m, opt, ef=ef)


@pytest.mark.parametrize("opt,ef,shape", TWO_BW_CASES,
                         ids=[f"{o}-ef{e:g}-{_shape_id(x)}" for o, e, x in TWO_BW_CASES])
def test_2bw_matches_one_device_with_delayed_optimizer(opt, ef, shape):
  """2bw with optimizer U trains as one device with `delay(U, 1)`.

  With the correction the pipeline runs `error_feedback(U, c)` and the
  reference `delay(error_feedback(U, c), 1)`: the pipeline first calls its
  optimizer once a delayed gradient exists (the project's order). Every
  batch's loss is compared, batch k reported by step k+1 and the last one by
  `pending_loss`; the weights are the newest version v[STEPS].
  """
  m = shape[2]
  got = _run_2bw(opt, ef, shape)
  want = run("none", 1, 1, m, opt, ef=ef, delay=1)
  assert got.loss_steps == tuple(range(-1, STEPS - 1))
  assert_runs_match(got, want)


def test_2bw_is_distinguishable_from_synchronous_training():
  """The one-step delay moves the weights far beyond the tolerance.

  So matching the delayed reference above says something: a 2bw that
  updated with the fresh gradient would fail it.
  """
  delayed = _run_2bw("adamw", 0.0, (2, 1, 2))
  sync = run("none", 1, 1, 2, "adamw")
  assert _max_diff(delayed.params, sync.params) > 1e-4
  assert np.max(np.abs(delayed.losses[2:] - sync.losses[2:])) > 1e-4
  # Batch 0 ran on the initial weights in both.
  np.testing.assert_allclose(delayed.losses[0], sync.losses[0], rtol=1e-6)


@pytest.mark.parametrize("other", [dict(ef=0.0), dict(ef=1.0, ef_outside=True)],
                         ids=["no-correction", "correction-outside-delay"])
def test_2bw_correction_is_distinguishable(other):
  """2bw with the correction differs, beyond the tolerance, from the near misses.

  Without the correction, and with the other order `error_feedback(delay(U))`,
  whose first real update is (1+c) times larger: so the match above pins
  down both that the correction runs and where it sits.
  """
  opt, ef, (s, d, m) = next(case for case in TWO_BW_CASES if case[0] == "adamw" and case[1])
  got = run("2bw", s, d, m, opt, ef=ef)
  # The one-device arithmetic of `none` with that optimizer, on the compiled
  # gradient that the pipedream reference of the same M already needs.
  miss = stale_reference((0,) * s, m, opt, delay=1, **other)
  assert _max_diff(got.params, miss.params) > 1e-4


# --- pipedream ---------------------------------------------------------------

PIPEDREAM_SHAPES = [(2, 2, 3), (4, 2, 7)]


def _pipedream_delays(num_stages):
  """Stage s lags S-1-s updates; the last stage none."""
  return tuple(num_stages - 1 - s for s in range(num_stages))


@pytest.mark.parametrize("shape", PIPEDREAM_SHAPES, ids=_shape_id)
def test_pipedream_matches_stage_delayed_reference(shape):
  """pipedream trains as one device with stage s's weights S-1-s updates old.

  The reference keeps the weight history and runs batch k with stage s's
  blocks, and the embedding (stage 0) or head (stage S-1) of its stage, at
  version max(0, k-(S-1-s)); the gradient there updates the newest weights.
  """
  s, d, m = shape
  got = run("pipedream", s, d, m, "adamw")
  want = stale_reference(_pipedream_delays(s), m, "adamw")
  assert got.loss_steps == tuple(range(STEPS))
  assert_runs_match(got, want)


@pytest.mark.parametrize("wrong", [
    dict(delays=(0, 0)),                        # synchronous
    dict(delays=(1, 1)),                        # every stage one step behind
    dict(delays=(1, 0), embed_head=(0, 0)),     # embedding not stage 0's version
    dict(delays=(1, 0), embed_head=(1, 1)),     # head not the last stage's version
], ids=["sync", "uniform", "fresh-embed", "stale-head"])
def test_pipedream_reference_is_discriminating(wrong):
  """Near misses of the pipedream model miss by far more than the tolerance.

  So the match above pins down the stage-dependent delays, including which
  stage's version the replicated embedding and head take.
  """
  s, d, m = PIPEDREAM_SHAPES[0]
  got = run("pipedream", s, d, m, "adamw")
  other = stale_reference(wrong["delays"], m, "adamw", embed_head=wrong.get("embed_head"))
  assert _max_diff(got.params, other.params) > 1e-4


def test_stale_reference_without_delays_is_schedule_none():
  """The pipedream reference's machinery, checked against `schedule=none`."""
  assert_runs_match(stale_reference((0, 0), 3, "adamw"), run("none", 1, 1, 3, "adamw"))


def test_pipedream_with_one_stage_is_synchronous():
  """With S=1 the only stage is the last one, whose delay is zero."""
  assert_runs_match(run("pipedream", 1, 1, 2, "adamw"), run("none", 1, 1, 2, "adamw"))


# --- the compiled 2bw step ---------------------------------------------------


def _stage_weight_gathers(hlo, num_stages):
  """all-gathers in `hlo` whose result is (part of) the stacked block weights.

  A gathered block leaf keeps its per-layer shape `rest` and gets a layer axis
  holding more than one stage's L/S layers: [n, *rest] or, with 2bw's version
  axis, [2, n, *rest], n = k*L/S for k = 2..S. That is what XLA's SPMD
  partitioner emits when a stage-sharded operand has to be replicated (see
  test_stage_weight_gathers_are_detected). Activations ([b, t, dim]) and
  small metrics do not have these shapes.
  """
  per = util.CONFIG.n_layers // num_stages
  rests = {leaf.shape[1:] for leaf in jax.tree.leaves(util.initial_params()["blocks"])}
  gathered = {(lead + (k * per,) + rest)
              for rest in rests for k in range(2, num_stages + 1) for lead in ((), (2,))}
  return [line for line in util.collectives(hlo, "all-gather")
          if gathered & set(util.result_shapes(line, "all-gather"))]


def _permute_pairs(line):
  """source_target_pairs of a collective-permute line, as a set of (src, dst)."""
  text = line.split("source_target_pairs={", 1)[1].split("}}", 1)[0]
  return {tuple(int(x) for x in pair.strip("{}").split(",")) for pair in text.split("},{")}


def test_2bw_step_collectives():
  """The 2bw step talks between stages by ppermute only, weights stay put.

  - each device receives only its stage's L/S blocks of both weight versions
    (and of the optimizer state), never all L;
  - collective-permutes run inside the tick loop and connect stage s to s+1
    (activations) and s+1 to s (cotangents) within each data column;
  - no all-gather anywhere has a stage-weight shape, and none runs in the loop;
  - no all-reduce runs in the loop: gradients are summed over `data` (and the
    replicated parameters' over `stage`) once per step, after the ticks.
  """
  opt, ef, (s, d, m) = HLO_CASE
  hlo = _run_2bw(opt, ef, (s, d, m)).hlo
  comps, loop = util.computations(hlo), util.loop_computations(hlo)
  in_loop = {line for name in loop for line in comps[name]}

  per, layers = util.CONFIG.n_layers // s, util.CONFIG.n_layers
  inputs = set(util.entry_parameter_shapes(hlo))
  for leaf in jax.tree.leaves(util.initial_params()["blocks"]):
    rest = leaf.shape[1:]
    assert (2, per) + rest in inputs and (per,) + rest in inputs, rest
    assert not {(2, layers) + rest, (layers,) + rest} & inputs, rest

  permutes = util.collectives(hlo, "collective-permute")
  assert permutes, "the compiled 2bw step has no collective-permute"
  assert all(line in in_loop for line in permutes)
  # Device (s, d) of the mesh is partition s*D + d.
  forward = {(i * d + j, (i + 1) * d + j) for i in range(s - 1) for j in range(d)}
  backward = {(b, a) for a, b in forward}
  pairs = [_permute_pairs(line) for line in permutes]
  assert all(p <= forward | backward for p in pairs), pairs
  assert set().union(*pairs) == forward | backward

  assert _stage_weight_gathers(hlo, s) == []
  assert not [line for line in util.collectives(hlo, "all-gather") if line in in_loop]
  assert not [line for line in util.collectives(hlo, "all-reduce") if line in in_loop]


def test_stage_weight_gathers_are_detected():
  """The check above fires on a program that replicates the stage-sharded blocks.

  Replicating 2bw's [2, L, ...] weight versions (what a pipeline that ran the
  whole model on every stage would do) compiles to, e.g.
  `f32[2,4,32,96] all-gather(f32[2,1,32,96]), dimensions={1}`, one per block
  leaf; the check must name every leaf.
  """
  s, d = 4, 2
  mesh = make_mesh(s, d)
  blocks = jax.tree.map(lambda x: jnp.broadcast_to(x, (2,) + x.shape),
                        util.initial_params()["blocks"])
  blocks = jax.device_put(blocks, NamedSharding(mesh, P(None, "stage")))
  replicate = jax.jit(lambda t: jax.tree.map(lambda x: 2 * x, t),
                      out_shardings=NamedSharding(mesh, P()))
  hlo = replicate.lower(blocks).compile().as_text()
  # XLA may gather a tuple of leaves in one instruction; count shapes.
  found = [shape for line in _stage_weight_gathers(hlo, s)
           for shape in util.result_shapes(line, "all-gather")]
  assert len(found) >= len(jax.tree.leaves(blocks))


def test_loop_and_collective_parsing_on_a_known_program():
  """The HLO helpers find a psum and a ppermute placed inside a scan.

  A toy shard_map whose scan body all-reduces every iteration: what a
  per-tick gradient psum would look like in the 2bw step. The helpers must
  report the all-reduce and the permute as inside the loop.
  """
  mesh = make_mesh(4, 2)

  def body(x):
    def tick(c, _):
      c = jax.lax.ppermute(c, "stage", [(i, i + 1) for i in range(3)])
      return c + jax.lax.psum(c, "data"), None
    return jax.lax.scan(tick, x, None, length=3)[0]

  fn = jax.shard_map(body, mesh=mesh, in_specs=P("stage", "data"), out_specs=P("stage", "data"))
  x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("stage", "data")))
  hlo = jax.jit(fn).lower(x).compile().as_text()
  comps, loop = util.computations(hlo), util.loop_computations(hlo)
  in_loop = {line for name in loop for line in comps[name]}
  for op in ("collective-permute", "all-reduce"):
    lines = util.collectives(hlo, op)
    assert lines and all(line in in_loop for line in lines), op
  [permute] = util.collectives(hlo, "collective-permute")
  assert _permute_pairs(permute) == {(0, 2), (2, 4), (4, 6), (1, 3), (3, 5), (5, 7)}


# --- errors ------------------------------------------------------------------


def test_2bw_refuses_too_few_microbatches():
  """2bw needs M >= 2(S-1): the gradient of batch k-1 must be complete in step k."""
  opt = util.optimizer("adamw")
  with pytest.raises(ValueError, match=r"2bw with 4 stages needs at least 6 microbatches"):
    make_schedule("2bw", util.stage_fns(), opt, make_mesh(4, 2), 5)
  with pytest.raises(ValueError, match=r"at least 2 microbatches"):
    make_schedule("2bw", util.stage_fns(), opt, make_mesh(2, 1), 1)
  make_schedule("2bw", util.stage_fns(), opt, make_mesh(4, 2), 6)
  make_schedule("1f1b", util.stage_fns(), opt, make_mesh(4, 2), 1)


def test_mesh_needs_enough_devices():
  with pytest.raises(ValueError, match=r"4 x 4 = 16 devices, but only 8"):
    make_mesh(4, 4)
  with pytest.raises(ValueError, match=r"9 x 1 = 9 devices"):
    make_mesh(9, 1)
  assert make_mesh(4, 2).shape == {"stage": 4, "data": 2}


def test_schedule_names_and_stage_counts_are_checked():
  opt = util.optimizer("adamw")
  with pytest.raises(ValueError, match="unknown schedule 'zb'"):
    make_schedule("zb", util.stage_fns(), opt, make_mesh(2, 1), 2)
  with pytest.raises(ValueError, match="runs without stages"):
    make_schedule("none", util.stage_fns(), opt, make_mesh(2, 1), 2)
