"""Numerical tests of the pipeline engine against one-device references.

On an emulated 8-device CPU mesh (`conftest.py`), in float32, each with
both stashes (stage inputs recomputed in the backward, or jax.vjp residuals):
- gpipe and 1f1b against `schedule=none` on the same global batch;
- 2bw against `schedule=none` with `optim.delay(opt, 1)`, for AdamW and Muon,
  with and without `optim.error_feedback`;
- pipedream against a one-device reference with stage-dependent delays;
- (model and optimizer variants and bfloat16: test_pipeline_variants.py);
- what a 1f1b step executes on each stage, recorded from inside the step,
  against the timetable;
- the compiled 2bw step's collectives (stage-to-stage permutes, and per-tick
  reductions over 'stage' only for the vocabulary-parallel embedding and head);
- clear errors for impossible settings.

"Match" means the same loss for every batch (rtol 1e-5, atol 1e-6) and the same
final weights (atol 5e-6). Each training run is cached in `_pipeline_util`,
so a run that several tests compare is compiled and trained once.
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpipe.pipeline import make_mesh, make_schedule, step_plan, timetable

from tests import _pipeline_util as util
from tests._pipeline_util import STEPS, assert_runs_match, run, stale_reference


_max_diff, _shape_id, STASHES = util.max_diff, util.shape_id, util.STASHES
each_stash = pytest.mark.parametrize("stash", STASHES)


# --- gpipe and 1f1b ----------------------------------------------------------

# S=2 with M = S; S=2 and data=2 with M not a multiple of S; S=4 and data=2.
SYNC_SHAPES = [(2, 1, 2), (2, 2, 3), (4, 2, 4)]


# Both stashes at S=4, data 2 (the residual stash at the smaller shapes adds
# nothing that shape does not cover, and a run costs a compile).
SYNC_CASES = [(c, x, st) for c in ("gpipe", "1f1b") for x in SYNC_SHAPES for st in STASHES
              if st == "inputs" or x == (4, 2, 4)]


@pytest.mark.parametrize("schedule,shape,stash", SYNC_CASES,
                         ids=[f"{c}-{_shape_id(x)}-{st}" for c, x, st in SYNC_CASES])
def test_synchronous_schedules_match_one_device(schedule, shape, stash):
  """gpipe and 1f1b train exactly as one device on the whole batch, with either stash."""
  s, d, m = shape
  got = run(schedule, s, d, m, "adamw", stash=stash)
  want = run("none", 1, 1, m, "adamw")
  assert got.loss_steps == tuple(range(STEPS))
  assert_runs_match(got, want)


def test_the_reference_trains():
  """The comparisons above could not pass with an engine that does nothing."""
  want = run("none", 1, 1, 2, "adamw")
  assert _max_diff(want.params, util.initial_params()) > 1e-3
  assert len(set(want.losses.tolist())) == STEPS


# With `rings_in_state` (the CPU tuning's, for gpipe and zb1) a flushed
# step's stash rings stay in its state (`FlushedState.rings`): what it leaves
# there must never reach a later step.
RING_CASES = [("gpipe", (2, 1, 2), "inputs", 1), ("gpipe", (4, 2, 4), "residuals", 1),
              ("gpipe", (2, 2, 3), "residuals", 1),
              ("zb1", (2, 1, 2), "residuals", 1), ("zb1", (4, 2, 4), "inputs", 1),
              ("zb1", (4, 1, 6), "residuals", 1)]


@pytest.mark.parametrize("schedule,shape,stash,v", RING_CASES,
                         ids=[f"{c}-{_shape_id(x)}-{st}-v{v}" for c, x, st, v in RING_CASES])
def test_a_flushed_step_reads_no_ring_slot_it_did_not_write(schedule, shape, stash, v):
  """Rings that come in full of NaN give the very step that zeroed rings give."""
  s, d, m = shape
  sch = make_schedule(schedule, util.stage_fns(), util.optimizer("adamw"), make_mesh(s, d), m,
                      stash=stash, virtual_stages=v, rings_in_state=True)
  params = jax.tree.map(jnp.asarray, util.initial_params())
  (tok, tgt), = util.batches(m)[:1]
  tok, tgt = (jax.device_put(x, sch.batch_sharding()) for x in (tok, tgt))
  clean = sch.init(params, (m, util.ROWS, util.SEQ))
  fresh = sch.init(params, (m, util.ROWS, util.SEQ))
  # ...and which no checkpoint holds.
  assert jax.tree.leaves(clean.rings) and not any(jax.tree.leaves(sch.saved_fields(clean).rings))
  nan = jax.jit(lambda r: jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), r),
                out_shardings=jax.tree.map(lambda x: x.sharding, fresh.rings))
  dirty = fresh._replace(rings=nan(fresh.rings))
  outs = []
  for state in (clean, dirty):
    for _ in range(2):
      state, metrics = sch.step(state, tok, tgt)
    outs.append((jax.device_get(metrics), jax.device_get(state.params)))
  assert np.isfinite(outs[0][0]["loss"])
  for got, want in zip(jax.tree.leaves(outs[1]), jax.tree.leaves(outs[0])):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("gpipe", 1),
                                        ("zb1", 1)])
def test_flushed_schedules_make_their_rings_each_step_by_default(schedule, v):
  sch = make_schedule(schedule, util.stage_fns(), util.optimizer("adamw"), make_mesh(2, 1), 4,
                      virtual_stages=v)
  state = jax.eval_shape(lambda p: sch.init(p, (4, util.ROWS, util.SEQ)), util.initial_params())
  # A SyncState, as their checkpoints hold it.
  assert not sch.keeps_rings and type(state).__name__ == "SyncState"


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
    ("adamw", 1.0, (2, 2, 2)),
    # SOAP's stacked eigendecompositions on 2 devices (they once deadlocked
    # jaxlib's CPU thread pool) and its eigenbases split over stages.
    ("soap", 1.0, (2, 1, 2)),
]
# The case whose compiled HLO test_2bw_step_collectives reads.
HLO_CASE = ("adamw", 0.0, (4, 2, 6))
# Every case with the input stash; the residual stash for S=4, data 2 (its
# engine path is the same at every shape and optimizer, and 2bw's residual
# stash at S=2, data 1 runs again in test_tied_embeddings_match_one_device).
TWO_BW_RUNS = [(*c, st) for c in TWO_BW_CASES for st in STASHES
               if st == "inputs" or c == HLO_CASE]


def _run_2bw(opt, ef, shape, stash="inputs"):
  """The (cached) 2bw run of a TWO_BW_CASES entry."""
  s, d, m = shape
  return run("2bw", s, d, m, opt, ef=ef, stash=stash)


@pytest.mark.parametrize("opt,ef,shape,stash", TWO_BW_RUNS,
                         ids=[f"{o}-ef{e:g}-{_shape_id(x)}-{st}" for o, e, x, st in TWO_BW_RUNS])
def test_2bw_matches_one_device_with_delayed_optimizer(opt, ef, shape, stash):
  """2bw with optimizer U trains as one device with `delay(U, 1)`, with either stash.

  With the correction the pipeline runs `error_feedback(U, c)` and the
  reference `delay(error_feedback(U, c), 1)`: the pipeline first calls its
  optimizer once a delayed gradient exists (the project's order). Every
  batch's loss is compared, batch k reported by step k+1 and the last one by
  `pending_loss`; the weights are the newest version v[STEPS].
  """
  m = shape[2]
  got = _run_2bw(opt, ef, shape, stash)
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


# --- optimizer state sharded over 'data' (ZeRO-1) -------------------------------
#
# Every run above with data 2 updates sharded optimizer state (the schedules'
# default): the 2bw cases at D = 2 cover AdamW and Muon, each with and without
# the correction, against the unsharded one-device reference. These add
# `none`: AdamW's moments alone, and Muon's matrices with the correction's and
# the delay's buffers.

ZERO_NONE_CASES = [("adamw", 0.0), ("muon", 1.0)]


@pytest.mark.parametrize("opt,ef", ZERO_NONE_CASES,
                         ids=[f"{o}-ef{e:g}" for o, e in ZERO_NONE_CASES])
def test_sharded_optimizer_state_matches_one_device(opt, ef):
  """schedule=none on 2 data replicas, state split over them, trains as one device.

  With the correction, as the one-device form of 2bw (`delay(error_feedback(U))`),
  so the delay's and the correction's buffers are split too.
  """
  delay = 1 if ef else 0
  got = run("none", 1, 2, 2, opt, ef=ef, delay=delay)
  want = run("none", 1, 1, 2, opt, ef=ef, delay=delay)
  assert_runs_match(got, want)


def _abstract_state(schedule, num_stages, num_data, opt, shard, **kwargs):
  m = max(2 * (num_stages - 1), 1)
  sch = make_schedule(schedule, util.stage_fns(), util.optimizer(opt, **kwargs),
                      make_mesh(num_stages, num_data), m, shard_optimizer=shard)
  params = jax.tree.map(jnp.asarray, util.initial_params())
  state = jax.eval_shape(lambda p: sch.init(p, (m, util.ROWS, util.SEQ)), params)
  return sch, state, sch.state_shardings(state)


@pytest.mark.parametrize("schedule,stages,kwargs", [
    ("2bw", 2, dict(ef=1.0)), ("none", 1, dict(ef=1.0, delay=1))], ids=["2bw", "none-delayed"])
def test_optimizer_state_is_split_over_data(schedule, stages, kwargs):
  """Each replica holds 1/D of every parameter-shaped state leaf; unsharded, all of it.

  The tiny model's stacked blocks have 4 layers, so S x D = 4 splits each
  whole matrix onto one device (Muon's momentum, AdamW's moments, the
  correction's and the delay's buffers).
  """
  d = 2
  _, state, on = _abstract_state(schedule, stages, d, "muon", True, **kwargs)
  _, _, off = _abstract_state(schedule, stages, d, "muon", False, **kwargs)
  leaves = list(zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(on.opt_state),
                    jax.tree.leaves(off.opt_state)))
  params = state.params if schedule == "none" else state.cur
  shapes = {x.shape for x in jax.tree.leaves(params)}
  # Parameter-shaped: a parameter's shape, or one behind the delay's slot axis.
  shaped = [(x, a, b) for x, a, b in leaves if x.shape in shapes or x.shape[1:] in shapes]
  assert sum(x.ndim >= 3 for x, _, _ in shaped) >= 4   # stacked: moments, buffers
  for x, split, whole in shaped:
    n_split, n_whole = np.prod(split.shard_shape(x.shape)), np.prod(whole.shard_shape(x.shape))
    assert n_split * d == n_whole, (x.shape, split.spec, whole.spec)
  for x, split, whole in leaves:   # the rest (counts, scales) as before
    if (x, split, whole) not in shaped:
      assert split == whole


def _update_flops(num_data, shard):
  sch, state, sh = _abstract_state("none", 1, num_data, "muon", shard)
  update = lambda p, o, g: sch._update(p, o, g, jnp.array(True))[:2]  # pylint: disable=protected-access
  fn = jax.jit(update, in_shardings=(sh.params, sh.opt_state, sh.params),
               out_shardings=(sh.params, sh.opt_state))
  return fn.lower(state.params, state.opt_state, state.params).compile().cost_analysis()["flops"]


def test_newton_schulz_work_per_device_falls_with_data_degree():
  """The compiled, partitioned Muon update's FLOPs per device are about 1/D.

  Newton-Schulz is almost all of the update's arithmetic; with the state
  split over 'data' each replica orthogonalises its own matrices. Unsharded,
  every replica does all of it, whatever D.
  """
  one = _update_flops(1, True)
  assert _update_flops(2, False) == pytest.approx(one, rel=1e-3)
  assert _update_flops(2, True) < 0.55 * one
  assert _update_flops(4, True) < 0.3 * one


# --- pipedream ---------------------------------------------------------------

# Both stashes at S=4; the input stash at S=2.
PIPEDREAM_CASES = [((2, 2, 3), "inputs"), ((4, 2, 7), "inputs"), ((4, 2, 7), "residuals")]


def _pipedream_delays(num_stages):
  """Stage s lags S-1-s updates; the last stage none."""
  return tuple(num_stages - 1 - s for s in range(num_stages))


@pytest.mark.parametrize("shape,stash", PIPEDREAM_CASES,
                         ids=[f"{_shape_id(x)}-{st}" for x, st in PIPEDREAM_CASES])
def test_pipedream_matches_stage_delayed_reference(shape, stash):
  """pipedream trains as one device with stage s's weights S-1-s updates old (either stash).

  The reference keeps the weight history and runs batch k with stage s's
  blocks, and the embedding (stage 0) or head (stage S-1) of its stage, at
  version max(0, k-(S-1-s)); the gradient there updates the newest weights.
  """
  s, d, m = shape
  got = run("pipedream", s, d, m, "adamw", stash=stash)
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
  stage's version the vocabulary-split embedding and head take.
  """
  s, d, m = PIPEDREAM_CASES[0][0]
  got = run("pipedream", s, d, m, "adamw")
  other = stale_reference(wrong["delays"], m, "adamw", embed_head=wrong.get("embed_head"))
  assert _max_diff(got.params, other.params) > 1e-4


def test_stale_reference_without_delays_is_schedule_none():
  """The pipedream reference's machinery, checked against `schedule=none`."""
  assert_runs_match(stale_reference((0, 0), 3, "adamw"), run("none", 1, 1, 3, "adamw"))


@each_stash
def test_pipedream_with_one_stage_is_synchronous(stash):
  """With S=1 the only stage is the last one, whose delay is zero."""
  assert_runs_match(run("pipedream", 1, 1, 2, "adamw", stash=stash),
                    run("none", 1, 1, 2, "adamw"))


# --- what the engine executes ------------------------------------------------

# 1f1b on S=4 stages with data 2 and M=3 microbatches (fewer than S): M+2(S-1) = 9
# ticks per step, in which each stage has 3 forward and 3 backward cells; two steps.
COUNT_SHAPE = (4, 2, 3)
COUNT_STEPS = 2


def _stage_inputs(params, tokens, num_stages):
  """[stage][microbatch] the input of each stage on each microbatch, on one device."""
  mdl = util.model()
  per = util.CONFIG.n_layers // num_stages
  out = [[None] * len(tokens) for _ in range(num_stages)]
  for i, tok in enumerate(tokens):
    x = mdl.embed(params, tok)
    for s in range(num_stages):
      out[s][i] = np.asarray(x)
      part = jax.tree.map(lambda w: w[s * per:(s + 1) * per], params["blocks"])
      x, _ = mdl.apply_blocks(part, x)
  return out


@functools.cache
def _counted_1f1b():
  """What every stage of a 1f1b step ran, call by call: {(step, stage, data): [(kind, mb)]}.

  mb is the global microbatch (step * M + i) whose stage input the call
  received, found by comparing with the inputs computed on one device at the
  step's weights; None for an input of zeros (a slot the plan leaves empty).
  """
  s_, d_, m = COUNT_SHAPE
  log = []
  fns = util.stage_fns()
  fns = fns._replace(stage=util.counting_stage(fns.stage, log))
  sch = make_schedule("1f1b", fns, util.optimizer("adamw"), make_mesh(s_, d_), m,
                      stash="inputs")
  state = sch.init(jax.tree.map(jnp.asarray, util.initial_params()), (m, util.ROWS, util.SEQ))
  rows = util.ROWS // d_
  calls = {}
  for k, (tok, tgt) in enumerate(util.batches(m)[:COUNT_STEPS]):
    inputs = _stage_inputs(sch.params(state), tok, s_)
    log.clear()
    state, metrics = sch.step(state, jax.device_put(tok, sch.batch_sharding()),
                              jax.device_put(tgt, sch.batch_sharding()))
    assert bool(metrics["ran"])
    jax.effects_barrier()
    for kind, s, d, x in log:
      if not x.any():
        mb = None
      else:
        near = [i for i in range(m)
                if np.allclose(x, inputs[s][i][d * rows:(d + 1) * rows], rtol=0, atol=1e-4)]
        assert len(near) == 1, f"step {k}: stage {s} ran on an input of no microbatch"
        mb = k * m + near[0]
      calls.setdefault((k, s, d), []).append((kind, mb))
  return calls


def _planned(step, stage, idle):
  """The calls the timetable gives a stage in a step, tick by tick: F of its forward
  cell, then R and B of its backward cell. With `idle`, a tick in which some
  stage runs a forward (backward) gives every stage an F (R, B), of None where
  its own cell is empty: what a lockstep program that masks idle slots runs.
  """
  s_, _, m = COUNT_SHAPE
  plan = step_plan("1f1b", s_, m)
  table = timetable("1f1b", s_, m, num_steps=COUNT_STEPS)
  out = []
  for t in range(plan.num_ticks):
    cell, kind = table.cells[step * plan.num_ticks + t][stage], plan.kind(t)
    if cell.fwd is not None or (idle and kind.fwd):
      out.append(("F", cell.fwd))
    if cell.bwd is not None or (idle and kind.bwd):
      out += [("R", cell.bwd), ("B", cell.bwd)]
  return out


def test_1f1b_runs_the_timetable_cells():
  """Every stage's forwards, recomputations and backwards are the timetable's cells.

  Recorded from inside the step (an io_callback in the stage function, the
  microbatch recognised by its stage input): on every stage and data
  replica, the calls that received a microbatch are, in order, exactly the
  cells the plan gives that stage, tick by tick, with their global
  microbatch numbers; any other call (an input of zeros) falls on a tick in
  which that stage's cell is empty.
  """
  s_, d_, m = COUNT_SHAPE
  calls = _counted_1f1b()
  assert sorted(calls) == [(k, s, d) for k in range(COUNT_STEPS) for s in range(s_)
                           for d in range(d_)]
  for (k, s, d), got in calls.items():
    busy = _planned(k, s, idle=False)
    assert [c for c in got if c[1] is not None] == busy, (k, s, d)
    assert got in (busy, _planned(k, s, idle=True)), (k, s, d)
    assert sorted(mb for kind, mb in busy if kind == "F") == list(range(k * m, (k + 1) * m))


def test_1f1b_fill_and_drain_run_no_stage_work():
  """A 1f1b step runs M forwards, M recomputations and M backwards on each stage.

  That is what the plan asks of every stage (the 'inputs' stash recomputes
  each forward in its backward): a stage whose cell is empty in a tick in
  which other stages work (the fill and the drain) should not run its blocks
  there, on zeros or otherwise.
  """
  s_, d_, m = COUNT_SHAPE
  for (k, s, d), got in _counted_1f1b().items():
    counts = collections.Counter(kind for kind, _ in got)
    assert counts == {"F": m, "R": m, "B": m}, (f"step {k}, stage {s}, data {d}: "
                                                f"{dict(counts)}, calls {got}")


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


def _param_shapes(num_stages):
  """Every shape a gradient (or weight) leaf can have on one device or in whole.

  A block leaf per stage [L/S, *rest], per layer [*rest] and whole [L, *rest];
  a shared leaf whole and as one stage's vocabulary slice. An in-loop
  collective with one of these shapes would be a per-tick gradient (or
  weight) reduction.
  """
  params = util.initial_params()
  blocks, shared = params["blocks"], {k: v for k, v in params.items() if k != "blocks"}
  per = util.CONFIG.n_layers // num_stages
  shapes = set()
  for leaf in jax.tree.leaves(blocks):
    shapes |= {leaf.shape, leaf.shape[1:], (per,) + leaf.shape[1:]}
  axes = util.model().vocab_axes
  for leaf, a in zip(jax.tree.leaves(shared), jax.tree.leaves(axes, is_leaf=lambda a: a is None)):
    shapes.add(leaf.shape)
    if a is not None:
      local = list(leaf.shape)
      local[a] //= num_stages
      shapes.add(tuple(local))
  return shapes


def _within_data_columns(groups, num_stages, num_data) -> bool:
  """Whether every replica group lies in one data column {s*D + d : s} (a 'stage' collective)."""
  columns = [frozenset(i * num_data + j for i in range(num_stages)) for j in range(num_data)]
  return all(any(g <= c for c in columns) for g in groups)


@each_stash
def test_2bw_step_collectives(stash):
  """The 2bw step: weights stay on their stage, ticks talk within one data column.

  - each device receives only its stage's L/S blocks of both weight versions
    (and of the optimizer state), never all L, and only its 1/S of the
    embedding rows and of the output layer's columns;
  - collective-permutes run inside the tick loop and connect stage s to s+1
    (activations) and s+1 to s (cotangents) within each data column;
  - the vocabulary-parallel embedding and head need all-reduces (the
    embedding, the hidden state and their cotangents) and all-gathers (the
    softmax statistics) in every tick: each of them runs over 'stage' only,
    within one data column (devices s*D+d for a fixed d), and none has a
    parameter's shape, so no gradient is reduced over 'data' (or anything
    else) per tick: gradients are summed once per step, after the ticks;
  - no all-gather anywhere has a stage-weight shape.
  """
  opt, ef, (s, d, m) = HLO_CASE
  hlo = _run_2bw(opt, ef, (s, d, m), stash).hlo
  comps, loop = util.computations(hlo), util.loop_computations(hlo)
  in_loop = {line for name in loop for line in comps[name]}

  per, layers = util.CONFIG.n_layers // s, util.CONFIG.n_layers
  inputs = set(util.entry_parameter_shapes(hlo))
  for leaf in jax.tree.leaves(util.initial_params()["blocks"]):
    rest = leaf.shape[1:]
    assert (per,) + rest in inputs, rest
    assert not {(2, layers) + rest, (layers,) + rest} & inputs, rest
  vocab, dim = util.CONFIG.vocab_size, util.CONFIG.dim
  assert {(vocab // s, dim), (dim, vocab // s)} <= inputs
  assert not {(vocab, dim), (dim, vocab)} & inputs

  permutes = util.collectives(hlo, "collective-permute")
  assert permutes, "the compiled 2bw step has no collective-permute"
  assert all(line in in_loop for line in permutes)
  # Device (s, d) of the mesh is partition s*D + d.
  forward = {(i * d + j, (i + 1) * d + j) for i in range(s - 1) for j in range(d)}
  backward = {(b, a) for a, b in forward}
  pairs = [_permute_pairs(line) for line in permutes]
  # A subset, not equality: with S=2 both directions may share one exchange.
  assert all(p <= forward | backward for p in pairs), pairs
  assert set().union(*pairs) == forward | backward

  param_shapes = _param_shapes(s)
  for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
    lines = [line for line in util.collectives(hlo, op) if line in in_loop]
    if op in ("all-reduce", "all-gather"):
      assert lines, f"no {op} in the tick loop: the vocabulary-parallel head should need one"
    for line in lines:
      groups = util.replica_groups(line, s * d)
      assert _within_data_columns(groups, s, d), (op, groups, line[:200])
      shapes = set(util.result_shapes(line, op))
      assert not shapes & param_shapes, (op, shapes & param_shapes, line[:200])

  assert _stage_weight_gathers(hlo, s) == []


def _tick_collectives(hlo):
  """(collectives in the tick loops, all-reduce lines outside them) of a compiled step."""
  comps, loop = util.computations(hlo), util.loop_computations(hlo)
  in_loop = {line for name in loop for line in comps[name]}
  inside = {op: [line for line in util.collectives(hlo, op) if line in in_loop]
            for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")}
  outside = [line for line in util.collectives(hlo, "all-reduce") if line not in in_loop]
  return inside, outside


def test_2bw_embeds_once_per_step_and_the_last_stage_head_needs_no_tick_collective():
  """The embedding's lookup and gradient are one collective each per step, not per tick.

  Vocabulary-parallel: inside the tick loop only the head's collectives
  remain (activation-sized all-reduces, the softmax statistics' all-gather);
  the embedded inputs and their cotangents of all M microbatches cross the
  stages once each, outside the loop ([M, b, t, dim]). With the head on the
  last stage nothing but the collective-permutes runs per tick.
  """
  # M = 4: a run of ticks of one kind long enough to stay a loop (XLA
  # unrolls a loop of one iteration).
  s, d, m = 2, 1, 4
  dim, seq, rows = util.CONFIG.dim, util.SEQ, util.ROWS // d
  split = run("2bw", s, d, m, "adamw", stash="residuals")
  inside, outside = _tick_collectives(split.hlo)
  assert inside["all-reduce"] and inside["all-gather"]
  for line in inside["all-reduce"]:
    assert set(util.result_shapes(line, "all-reduce")) <= {(rows, seq, dim)}, line[:200]
  blocks = [line for line in outside if (m, rows, seq, dim) in util.result_shapes(line, "all-reduce")]
  assert len(blocks) == 2, outside  # the lookup and the cotangents, once each

  last = run("2bw", s, d, m, "adamw", stash="residuals", vocab_parallel=False)
  inside, _ = _tick_collectives(last.hlo)
  assert inside == {op: [] for op in inside}, inside
  assert util.collectives(last.hlo, "collective-permute")


@pytest.mark.parametrize("d,tied,vocab_parallel", [(1, False, True), (2, True, True),
                                                    (1, False, False)])
def test_a_2bw_step_moves_no_weights(d, tied, vocab_parallel):
  """v[k] becomes `prev` where it lies and v[k+1] is written over v[k-1].

  Every output of the step lives in a donated input's buffer, and no weight
  of either version is copied. With the state's own order (`cur` after
  `prev`) JAX gave the output `prev` the input `prev`'s buffers, so XLA
  copied both versions every step, and the new `cur` embedding, whose input
  `prev` twin the step never reads, took a fresh buffer.
  """
  s, m = 2, 4
  cfg = util.config(tie_embeddings=tied)
  sch = make_schedule("2bw", util.stage_fns(cfg), util.optimizer("adamw"), make_mesh(s, d), m,
                      stash="residuals", vocab_parallel=vocab_parallel)
  state = sch.init(jax.tree.map(jnp.asarray, util.initial_params(cfg)), (m, util.ROWS, util.SEQ))
  tok, tgt = (jax.device_put(x, sch.batch_sharding()) for x in util.batches(m)[0])
  compiled = sch.lower_step(state, tok, tgt).compile()
  # What is not aliased is the metrics (and the output's tuple), less than
  # one device's share of the embedding: no weight took a fresh buffer.
  mem = compiled.memory_analysis()
  embedding = sch.newest(state)["embed"]["embedding"]
  share = embedding.nbytes // (s if vocab_parallel else 1)
  assert mem.output_size_in_bytes - mem.alias_size_in_bytes < share
  hlo = compiled.as_text()
  # The weights' entry parameters, by the names JAX gives them: the state's
  # fields `prev` and `cur`, however the step takes them.
  weights = {name for name, _ in re.findall(
      r"(%[\w.]+) = [^\n]*? parameter\(\d+\)[^\n]*?op_name=\"(fields\[[12]\]|state\.(?:prev|cur))",
      hlo)}
  assert len(weights) == 2 * len(jax.tree.leaves(sch.newest(state)))
  copied = [n for n in re.findall(r"\bcopy\((%[\w.]+)\)", hlo) if n in weights]
  assert not copied, copied
  # And the step still runs on the state as `step` takes it.
  state, met = compiled(state, tok, tgt)
  assert int(met["loss_step"]) == -1 and bool(met["ran"])


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

  A toy shard_map whose scan body all-reduces over 'data' every iteration:
  what a per-tick gradient psum would look like in the 2bw step. The helpers
  must report the all-reduce and the permute as inside the loop, and the
  all-reduce's replica groups as crossing data columns.
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
  [reduce] = util.collectives(hlo, "all-reduce")
  groups = util.replica_groups(reduce, 8)
  assert sorted(map(sorted, groups)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert not _within_data_columns(groups, 4, 2)


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


def test_stash_choice_is_checked():
  with pytest.raises(ValueError, match=r"stash must be one of \('inputs', 'residuals'\)"):
    make_schedule("1f1b", util.stage_fns(), util.optimizer("adamw"), make_mesh(2, 1), 2,
                  stash="activations")


def test_schedule_names_and_stage_counts_are_checked():
  opt = util.optimizer("adamw")
  with pytest.raises(ValueError, match="unknown schedule 'zb'"):
    make_schedule("zb", util.stage_fns(), opt, make_mesh(2, 1), 2)
  with pytest.raises(ValueError, match="runs without stages"):
    make_schedule("none", util.stage_fns(), opt, make_mesh(2, 1), 2)


# --- model.loss_chunk -----------------------------------------------------------

# model.loss_chunk: 32 tokens per microbatch (16 per data shard at D=2), so
# chunks of 5 leave a padded last chunk. The unchunked runs are this file's.
CHUNKED = util.config(loss_chunk=5)
# none trains with StageFns.loss, whose chunking test_chunked_stage_fns_loss checks;
# every pipeline's head runs the same chunked cross-entropy (jaxpipe.xent).
SCHEDULE_CASES = [("gpipe", (2, 2, 3))]


@pytest.mark.parametrize("schedule,shape", SCHEDULE_CASES,
                         ids=[f"{c}-S{s}-D{d}-M{m}" for c, (s, d, m) in SCHEDULE_CASES])
def test_schedules_train_the_same_with_chunks(schedule, shape):
  """model.loss_chunk changes no loss and no weight of a training run.

  The chunked step does compute logits 5 tokens at a time (float32 [1, 5, V/S]
  in its HLO, which the unchunked step never has), so the match is not that
  of one program with itself.
  """
  s, d, m = shape
  got = util.run(schedule, s, d, m, "adamw", cfg=CHUNKED)
  want = util.run(schedule, s, d, m, "adamw")
  util.assert_runs_match(got, want)
  chunk_logits = re.compile(rf"f32\[(?:1,)?5,{util.CONFIG.vocab_size // s}\]")
  assert chunk_logits.search(got.hlo) and not chunk_logits.search(want.hlo)
