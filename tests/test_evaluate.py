"""A pipeline's evaluation (forward ticks, the head's loss alone) against the one-device loss.

Every schedule evaluates with the forward, head and transfers of its own
step (`jaxpipe.pipeline._evaluate`): GPipe's forward ticks, and with v > 1
chunks interleaved's, each group of microbatches round the ring v times.
Each must give the loss that schedule `none` gives at the same weights, on
the same batch (float32, LOSS_TOL), with the vocabulary split over the
stages and whole on the last, with and without data parallelism.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.pipeline import make_mesh, make_schedule

from tests import _pipeline_util as util

# (schedule, (S, D, M), v, vocab_parallel)
CASES = [
    ("gpipe", (2, 2, 3), 1, False),
    ("1f1b", (4, 1, 4), 1, True),
    ("2bw", (2, 1, 2), 1, True),
    ("zb1", (4, 1, 4), 1, False),
    ("pipedream", (4, 1, 4), 1, True),
    ("interleaved", (2, 1, 4), 2, True),
    ("interleaved", (2, 2, 4), 2, False),
]


def _params():
  """CONFIG's initial weights moved off their initialisation (no symmetry left to hide in)."""
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda x: x + 0.01 * rng.standard_normal(x.shape).astype(x.dtype),
                      util.initial_params())


def _eval_loss(schedule: str, shape, v: int = 1, vocab_parallel: bool = True,
               shuffle: bool = False) -> float:
  """The schedule's evaluation loss of the first batch at `_params()` (targets shuffled if asked)."""
  s, d, m = shape
  kwargs = {} if schedule == "none" else dict(virtual_stages=v, vocab_parallel=vocab_parallel)
  sch = make_schedule(schedule, util.stage_fns(), util.optimizer("adamw"), make_mesh(s, d), m,
                      **kwargs)
  state = sch.init(jax.tree.map(jnp.asarray, _params()), (m, util.ROWS, util.SEQ))
  tok, tgt = util.batches(m)[0]
  if shuffle:
    tgt = np.ascontiguousarray(tgt[::-1])
  tok, tgt = (jax.device_put(a, sch.batch_sharding()) for a in (tok, tgt))
  return float(sch.eval_loss(state, tok, tgt))


@pytest.mark.parametrize("schedule,shape,v,vocab_parallel", CASES,
                         ids=[f"{c}-{util.shape_id(x)}-v{v}-{'vp' if p else 'whole'}"
                              for c, x, v, p in CASES])
def test_evaluation_matches_one_device(schedule, shape, v, vocab_parallel):
  """The pipeline's evaluation loss is the one-device loss of the same batch."""
  got = _eval_loss(schedule, shape, v, vocab_parallel)
  want = _eval_loss("none", (1, 1, shape[2]))
  np.testing.assert_allclose(got, want, **util.LOSS_TOL)


def test_the_evaluation_check_can_fail():
  """Targets of the batch's microbatches swapped around: the loss moves well beyond LOSS_TOL."""
  got = _eval_loss("interleaved", (2, 1, 4), 2, shuffle=True)
  want = _eval_loss("none", (1, 1, 4))
  assert abs(got - want) > 100 * (util.LOSS_TOL["atol"] + util.LOSS_TOL["rtol"] * abs(want))
