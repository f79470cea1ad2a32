"""Interleaved 1F1B through train.py: config errors, a pulse, a resume on another stage count.

The tiny config with 8 blocks and 4 microbatches (S*v chunks must divide
the blocks, and M must be a multiple of S): two steps of interleaved at
S=2, v=2 with a checkpoint at each step, then a resume of the same run on
S=4 stages for a third; `schedule=none` on the same global batch is the
reference for every loss and, through `jaxpipe.runs.load_params` (what
export and generation read), for the weights of every checkpoint, whichever
stage count wrote it.
"""

import os
import subprocess

import jax
import numpy as np
import pytest

from jaxpipe import config as config_lib
from jaxpipe import runs
from jaxpipe.errors import ConfigError
from tests import _runs

# Adam's eps at 1e-6, as in the pipeline tests (`_pipeline_util.ADAM_EPS`): at
# 1e-8 a gradient entry that is zero up to rounding turns a difference in
# summation order into a weight difference above the tolerance.
BASE = ("model.n_layers=8", "pipeline.microbatches=4", "checkpoint.every=1", "optimizer.eps=1e-6")
INTERLEAVED = ("pipeline.schedule=interleaved", "pipeline.virtual_stages=2")


@pytest.mark.parametrize("overrides,named", [
    (("pipeline.schedule=1f1b", "pipeline.stages=2", "pipeline.virtual_stages=2"),
     ("pipeline.virtual_stages=2", "pipeline.schedule=interleaved or pipeline.virtual_stages=1")),
    (("pipeline.schedule=interleaved", "pipeline.stages=2"),
     ("pipeline.virtual_stages >= 2", "set pipeline.virtual_stages=2")),
    (("pipeline.schedule=interleaved", "pipeline.stages=2", "pipeline.virtual_stages=4"),
     ("model.n_layers=4", "pipeline.stages x pipeline.virtual_stages = 2 x 4 = 8")),
    (("pipeline.schedule=interleaved", "pipeline.stages=4", "pipeline.virtual_stages=2",
      "model.n_layers=8", "pipeline.microbatches=2"),
     ("pipeline.microbatches=2", "a multiple of 4, e.g. 4")),
    (("pipeline.schedule=interleaved", "pipeline.stages=2", "pipeline.virtual_stages=0"),
     ("pipeline.virtual_stages must be >= 1",)),
])
def test_config_refuses_what_interleaved_cannot_run(overrides, named):
  """Each refusal is one ConfigError naming the key and the fix."""
  with pytest.raises(ConfigError) as e:
    config_lib.load(_runs.TINY, list(overrides))
  message = str(e.value)
  assert "\n" not in message
  for text in named:
    assert text in message, message


def test_train_py_refuses_a_bad_config_with_exit_2(tmp_path):
  """train.py exits 2 with one line, and writes nothing."""
  run_dir = str(tmp_path / "run")
  p = subprocess.run(_runs.command(run_dir, "pipeline.schedule=interleaved", "pipeline.stages=2",
                                   "pipeline.virtual_stages=2", "pipeline.microbatches=3",
                                   "data.batch_size=6"),
                     capture_output=True, text=True, timeout=120, cwd=_runs.ROOT)
  assert p.returncode == 2, p.stderr
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and "pipeline.microbatches=3" in lines[0], p.stderr
  assert not os.path.exists(run_dir)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
  """schedule=none, three steps, a checkpoint at each."""
  run_dir = str(tmp_path_factory.mktemp("none") / "run")
  p = _runs.run(run_dir, "run.steps=3", *BASE, cache_dir=cache)
  assert p.returncode == 0, p.stderr
  return run_dir


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory, cache):
  """Two steps of interleaved at S=2, then the same run resumed on S=4 for a third."""
  run_dir = str(tmp_path_factory.mktemp("interleaved") / "run")
  first = _runs.run(run_dir, "run.steps=2", *BASE, *INTERLEAVED, "pipeline.stages=2",
                    cache_dir=cache)
  second = _runs.run(run_dir, "run.steps=3", *BASE, *INTERLEAVED, "pipeline.stages=4",
                     cache_dir=cache)
  return run_dir, first, second


def test_pulse_and_resume_on_another_stage_count(interleaved, reference):
  """The run trains as `none` before and after moving from 2 stages to 4.

  Steps 0 and 1 on S=2 and step 2 on S=4 (the blocks and their optimizer
  state taken from the S=2 order into the S=4 one) give the reference's
  losses to float32 rounding.
  """
  run_dir, first, second = interleaved
  assert first.returncode == 0, first.stderr
  assert "jaxpipe interleaved" in first.stdout
  assert "emulating 2 devices" in first.stderr
  assert second.returncode == 0, second.stderr
  assert "resharded the checkpoint from 2 stage(s) x 1 data to 4 x 1" in second.stderr
  got, want = _runs.train_losses(run_dir), _runs.train_losses(reference)
  assert sorted(got) == sorted(want) == [0, 1, 2]
  np.testing.assert_allclose([got[k] for k in range(3)], [want[k] for k in range(3)],
                             rtol=1e-5, atol=1e-6)
  assert _runs.checkpoints(run_dir) == [2, 3]


@pytest.mark.parametrize("step", [2, 3])
def test_exported_weights_are_in_the_natural_order(interleaved, reference, step):
  """`runs.load_params` (export, generation) reads an interleaved checkpoint in the natural
  layer order, whether S=2 (step 2) or S=4 (step 3) wrote it: the reference's weights."""
  run_dir = interleaved[0]
  assert interleaved[2].returncode == 0, interleaved[2].stderr
  cfg, got, at = runs.load_params(run_dir, step)
  assert at == step and cfg.pipeline.stages == 4   # config.yaml is the resumed run's
  _, want, _ = runs.load_params(reference, step)
  flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
  for (path, g), w in zip(flat_got, jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=5e-6,
                               err_msg=jax.tree_util.keystr(path))
  # Distinct layers: the order is a real one, not equal weights in any order.
  for leaf in jax.tree.leaves(got["blocks"]):
    if np.asarray(leaf).ndim >= 3:
      assert np.abs(np.asarray(leaf)[0] - np.asarray(leaf)[1]).max() > 1e-3
