"""Interleaved 1F1B against the one-device reference, and what its step executes.

On the emulated 8-device CPU mesh (`conftest.py`), in float32, on the tiny
model of `_pipeline_util` with 8 blocks (S*v chunks must divide them):
- interleaved at S=2 v=2, S=4 v=2 and S=2 v=4, with data 1 and 2, both
  stashes, tied embeddings, `model.remat=dots`, a gradient clip that binds
  and the head on the last stage, each against `schedule=none` on the same
  global batch (it flushes every step: no delay);
- the state's own layer order (device s's chunks s, s+S, ...) against the
  natural order `params` returns;
- what every stage of an interleaved step runs, recorded from inside the
  step, against the timetable's cells (chunks included).

"Match" is `_pipeline_util.assert_runs_match` (losses rtol 1e-5, weights
atol 5e-6). The timetable's own properties are in test_timetable.py.
"""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.pipeline import layer_order, make_mesh, make_schedule, step_plan, timetable

from tests import _pipeline_util as util
from tests._pipeline_util import STEPS, assert_runs_match, run

# 8 blocks: S*v = 4 and 8 both divide them.
EIGHT = util.config(n_layers=8)

# (S, D, M, v, stash, variant): every (S, v) of the issue with data 1 and 2;
# the variants ride on shapes that cover them cheaply (each run is a compile).
CASES = [
    (2, 1, 4, 2, "inputs", "plain"),
    (2, 2, 2, 2, "residuals", "clip"),
    (4, 1, 4, 2, "residuals", "dots"),
    (4, 2, 4, 2, "inputs", "plain"),
    (2, 1, 2, 4, "residuals", "tied"),
    (2, 2, 4, 4, "inputs", "last_stage"),
]
CLIP = 0.1   # below every gradient norm of these runs: the clip binds


def _variant(variant):
  """(model config, optimizer kwargs, run kwargs) of a variant."""
  if variant == "tied":
    return util.config(n_layers=8, tie_embeddings=True), {}, {}
  if variant == "dots":
    return util.config(n_layers=8, remat="dots"), {}, {}
  if variant == "clip":
    return EIGHT, {"clip": CLIP}, {}
  if variant == "last_stage":
    return EIGHT, {}, {"vocab_parallel": False}
  return EIGHT, {}, {}


def _run_case(s, d, m, v, stash, variant):
  cfg, opt, extra = _variant(variant)
  return run("interleaved", s, d, m, "adamw", stash=stash, cfg=cfg, virtual_stages=v,
             **opt, **extra)


def _reference(m, variant):
  cfg, opt, _ = _variant(variant)
  # remat recomputes the same float32 operations: the plain model is the reference.
  cfg = EIGHT if variant == "dots" else cfg
  return run("none", 1, 1, m, "adamw", cfg=cfg, **opt)


@pytest.mark.parametrize("s,d,m,v,stash,variant", CASES,
                         ids=[f"S{s}-D{d}-M{m}-v{v}-{st}-{x}" for s, d, m, v, st, x in CASES])
def test_interleaved_matches_one_device(s, d, m, v, stash, variant):
  """Interleaved trains exactly as one device on the whole batch.

  Every batch's loss at the weights it ran on, and the final weights in
  their natural order, to float32 rounding.
  """
  got = _run_case(s, d, m, v, stash, variant)
  want = _reference(m, variant)
  assert got.loss_steps == tuple(range(STEPS))
  assert_runs_match(got, want)
  if variant == "clip":
    assert np.all(got.grad_norms > 2 * CLIP)
    np.testing.assert_allclose(got.grad_norms, want.grad_norms, rtol=1e-5)
  if variant == "tied":
    assert "out" not in got.params["head"]


def test_the_comparisons_can_fail():
  """The references are far apart beyond the tolerance from near misses.

  The clip changes the run, and the state's blocks are not in the natural
  order: had `params` not put them back (or the engine run the chunks in
  another order), the weights would miss by far more than the tolerance.
  """
  clipped = _run_case(2, 2, 2, 2, "residuals", "clip")
  assert util.max_diff(clipped.params, _reference(2, "plain").params) > 1e-4
  got = _run_case(4, 2, 4, 2, "inputs", "plain")
  order = layer_order(8, 4, 2)
  assert list(order) == [0, 4, 1, 5, 2, 6, 3, 7]
  held, natural = got.state_params["blocks"], got.params["blocks"]
  for h, n in zip(jax.tree.leaves(held), jax.tree.leaves(natural)):
    np.testing.assert_array_equal(h, np.asarray(n)[order])
  assert util.max_diff(held, natural) > 1e-3


def test_config_arithmetic_is_refused_by_the_library():
  """v > 1 for another schedule, or M not a multiple of S, is a ValueError naming it."""
  opt = util.optimizer("adamw")
  with pytest.raises(ValueError, match="virtual_stages=2 needs schedule interleaved"):
    make_schedule("1f1b", util.stage_fns(EIGHT), opt, make_mesh(2, 1), 2, virtual_stages=2)
  with pytest.raises(ValueError, match="multiple of the 2 stages, got 3"):
    make_schedule("interleaved", util.stage_fns(EIGHT), opt, make_mesh(2, 1), 3,
                  virtual_stages=2)


# --- what the engine executes ------------------------------------------------

# S=2 stages of 2 chunks on data 2, M=4: 12 ticks, every stage runs each
# microbatch through each of its chunks once forward and once backward.
COUNT = (2, 2, 4, 2)


def _chunk_inputs(params, tokens, num_stages, v):
  """{(stage, chunk): [input of each microbatch]}, on one device in the natural order."""
  mdl = util.model(EIGHT)
  per = EIGHT.n_layers // (num_stages * v)
  out = collections.defaultdict(list)
  for tok in tokens:
    x = mdl.embed(params, tok)
    for g in range(num_stages * v):       # the pipeline's virtual stage g = j*S + s
      out[(g % num_stages, g // num_stages)].append(np.asarray(x))
      part = jax.tree.map(lambda w: w[g * per:(g + 1) * per], params["blocks"])
      x, _ = mdl.apply_blocks(part, x)
  return out


@functools.cache
def _counted():
  """{(step, stage, data): [(kind, global microbatch or None, chunk or None)]} of two steps."""
  s_, d_, m, v = COUNT
  log = []
  fns = util.stage_fns(EIGHT)
  fns = fns._replace(stage=util.counting_stage(fns.stage, log))
  sch = make_schedule("interleaved", fns, util.optimizer("adamw"), make_mesh(s_, d_), m,
                      stash="inputs", virtual_stages=v)
  state = sch.init(jax.tree.map(jnp.asarray, util.initial_params(EIGHT)),
                   (m, util.ROWS, util.SEQ))
  rows = util.ROWS // d_
  calls = {}
  for k, (tok, tgt) in enumerate(util.batches(m, EIGHT.vocab_size)[:2]):
    inputs = _chunk_inputs(sch.params(state), tok, s_, v)
    log.clear()
    state, metrics = sch.step(state, jax.device_put(tok, sch.batch_sharding()),
                              jax.device_put(tgt, sch.batch_sharding()))
    assert bool(metrics["ran"])
    jax.effects_barrier()
    for kind, s, d, x in log:
      if not x.any():
        found = (None, None)
      else:
        near = [(i, j) for j in range(v) for i in range(m)
                if np.allclose(x, inputs[(s, j)][i][d * rows:(d + 1) * rows], rtol=0, atol=1e-4)]
        assert len(near) == 1, f"step {k}: stage {s} ran on an input of no (microbatch, chunk)"
        found = (k * m + near[0][0], near[0][1])
      calls.setdefault((k, s, d), []).append((kind, *found))
  return calls


def _planned(step, stage):
  """The calls the timetable gives a stage in a step: F of its forward cell, then R and B
  of its backward cell, each with its global microbatch and chunk."""
  s_, _, m, v = COUNT
  plan = step_plan("interleaved", s_, m, v)
  table = timetable("interleaved", s_, m, num_steps=2, virtual_stages=v)
  out = []
  for t in range(plan.num_ticks):
    c = table.cells[step * plan.num_ticks + t][stage]
    assert (c.fwd_chunk, c.bwd_chunk) == (
        None if c.fwd is None else int(plan.fwd_chunk[t, stage]),
        None if c.bwd is None else int(plan.bwd_chunk[t, stage]))
    if c.fwd is not None:
      out.append(("F", c.fwd, c.fwd_chunk))
    if c.bwd is not None:
      out += [("R", c.bwd, c.bwd_chunk), ("B", c.bwd, c.bwd_chunk)]
  return out


def test_interleaved_runs_the_timetable_cells():
  """Every stage's forwards, recomputations and backwards are the drawn cells, chunks included.

  Recorded from inside the step (an io_callback in the stage function; the
  microbatch and the chunk recognised by the input, against the inputs of
  every virtual stage computed on one device): on every stage and data
  replica the calls that received a microbatch are, in order, the cells
  the timetable draws for that stage, tick by tick. A stage whose cell is
  empty runs nothing: each runs each microbatch through each of its chunks
  once forward, once recomputed and once backward.
  """
  s_, d_, m, v = COUNT
  calls = _counted()
  assert sorted(calls) == [(k, s, d) for k in range(2) for s in range(s_) for d in range(d_)]
  for (k, s, d), got in calls.items():
    assert got == _planned(k, s), (k, s, d)
    counts = collections.Counter(kind for kind, _, _ in got)
    assert counts == {"F": m * v, "R": m * v, "B": m * v}
