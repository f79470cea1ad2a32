"""Nothing lost: exact resume for every kind of state, kills mid-save, the NaN guard, bad input."""

import dataclasses
import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from jaxpipe import config, trainer
from tests import _runs

PIPE = {
    "none": ["optimizer.name=adamw"],
    "2bw": ["pipeline.schedule=2bw", "pipeline.stages=2", "mesh.data=2", "optimizer.name=muon",
            "optimizer.error_feedback=1"],
    "1f1b": ["pipeline.schedule=1f1b", "pipeline.stages=2", "pipeline.microbatches=4",
             "optimizer.name=adamw"],
    # Split backward, two stash rings (state with `rings_in_state`: below).
    "zb1": ["pipeline.schedule=zb1", "pipeline.stages=2", "pipeline.microbatches=4",
            "pipeline.stash=residuals", "optimizer.name=adamw"],
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("cache"))
  os.environ["JAXPIPE_CACHE"] = path
  return path


def _train(run_dir, *overrides):
  cfg = config.load(_runs.TINY, [f"run.dir={run_dir}", "checkpoint.async_save=false",
                                 *overrides])
  return trainer.train(cfg)


def _params(summary):
  run = summary["run"]
  return jax.tree.map(np.asarray, run.schedule.params(summary["state"]))


# none resumes through the same code with less state; test_resume.py resumes
# it on another mesh, and 2bw after kills at any moment and test_train.py after
# SIGTERM, bit for bit in every loss. A flushed schedule whose rings are
# state restores all but them, which the resumed run makes afresh (below).
@pytest.mark.parametrize("name", ["1f1b", "zb1"])
def test_resumed_run_equals_uninterrupted_run(tmp_path, cache, name):
  """Stop after 3 steps, resume to 6: same losses and final parameters, bit for bit."""
  whole = _train(str(tmp_path / "whole"), "run.steps=6", "checkpoint.every=3", *PIPE[name])
  # The same run as if it had stopped after step 3: its checkpoint 3 (the
  # records past it are replaced on resume).
  half = str(tmp_path / "half")
  shutil.copytree(str(tmp_path / "whole"), half)
  shutil.rmtree(os.path.join(half, "checkpoints", "6"))
  resumed = _train(half, "run.steps=6", "checkpoint.every=3", *PIPE[name])
  assert resumed["start_step"] == 3
  a, b = _runs.train_losses(str(tmp_path / "whole")), _runs.train_losses(half)
  assert sorted(a) == sorted(b) == list(range(6))
  assert [a[k] for k in range(6)] == [b[k] for k in range(6)]
  jax.tree.map(np.testing.assert_array_equal, _params(whole), _params(resumed))
  # The optimizer state (with delay and correction buffers) must match too.
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(whole["state"]),
               jax.device_get(resumed["state"]))


def test_sigkill_during_a_checkpoint_save_resumes_from_the_previous(tmp_path, cache):
  run_dir = str(tmp_path / "run")
  ckpt_dir = os.path.join(run_dir, "checkpoints")
  proc = _runs.start(run_dir, "run.steps=400", "checkpoint.every=1", "checkpoint.keep=3",
                     *PIPE["2bw"], cache_dir=cache)
  partial = lambda: [d for d in (os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else [])
                     if "tmp" in d and _runs.checkpoints(run_dir)]
  # A save of this tiny state can finish between the poll that sees it and the
  # kill, so the run is frozen first (SIGSTOP stops every thread, the saving ones
  # too) and killed only if a save is still under way in what is frozen; else it
  # goes on until the next save.
  caught = False
  try:
    for _ in range(50):
      if not _runs.wait_for(partial, timeout=180, interval=0.0005):
        break
      proc.send_signal(signal.SIGSTOP)
      # The signal is delivered asynchronously: read the directory only once the
      # kernel reports every thread stopped.
      assert _runs.wait_for(lambda: _runs.stopped(proc), timeout=10, interval=0.0005)
      if partial():
        caught = True
        break
      proc.send_signal(signal.SIGCONT)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert caught, "never stopped the run while a checkpoint was being written"
  left = [d for d in os.listdir(ckpt_dir) if not d.isdigit()]
  complete = _runs.checkpoints(run_dir)
  assert left, "the kill did not land during a save"
  last = complete[-1]
  p = _runs.run(run_dir, f"run.steps={last + 3}", "checkpoint.every=1", "checkpoint.keep=3",
                *PIPE["2bw"], cache_dir=cache)
  assert p.returncode == 0, p.stderr
  assert f"resuming from {ckpt_dir}/{last} " in p.stderr
  losses = _runs.train_losses(run_dir)
  assert sorted(losses) == list(range(last + 3))
  assert all(np.isfinite(v) for v in losses.values())


def test_nan_is_skipped_and_counted(tmp_path, cache):
  run_dir = str(tmp_path / "run")
  p = _runs.run(run_dir, "run.steps=5", "run.debug_nan_step=2", *PIPE["2bw"], cache_dir=cache)
  assert p.returncode == 0, p.stderr
  lines = [l for l in p.stderr.splitlines() if "skipped" in l]
  # 2bw learns batch 2's gradient is bad when it would apply it, at step 3.
  assert lines == ["skipped the update of step 3: non-finite loss or gradient of batch 2 in "
                   "the blocks of stage 0, 1 and in the embedding/head parameters (stage 0 / "
                   "stage 1) (1 skipped so far)"]
  recs = {r["step"]: r for r in _runs.records(run_dir) if "loss" in r}
  assert recs[2]["loss"] is None and recs[4]["skipped"] == 1
  assert all(np.isfinite(recs[k]["loss"]) for k in (0, 1, 3, 4))


@pytest.mark.exit_status(3)
def test_nan_stops_with_the_last_good_state_saved(tmp_path, cache):
  run_dir = str(tmp_path / "run")
  p = _runs.run(run_dir, "run.steps=6", "run.debug_nan_step=1", "run.nan_policy=stop",
                cache_dir=cache)
  assert p.returncode == trainer.EXIT_NONFINITE
  err = [l for l in p.stderr.splitlines() if l.strip()]
  assert len(err) == 1 and err[0].startswith("stopped: non-finite loss or gradient of batch 1 "
                                             "(step 1)"), p.stderr
  assert _runs.checkpoints(run_dir) == [2]
  # The saved state is the last good one: resuming without the fault finishes.
  p = _runs.run(run_dir, "run.steps=4", cache_dir=cache)
  assert p.returncode == 0, p.stderr
  assert sorted(_runs.train_losses(run_dir)) == [0, 1, 2, 3]


@pytest.mark.parametrize("change,named", [
    ("model.n_layers=2", "model.n_layers: 4 -> 2"),
    ("pipeline.schedule=gpipe", "pipeline.schedule: 'none' -> 'gpipe'"),
    ("optimizer.name=muon", "optimizer.name: 'adamw' -> 'muon'"),
    ("data.batch_size=16", "data.batch_size: 8 -> 16"),
])
def test_resume_with_a_different_config_is_refused(tmp_path, cache, change, named):
  run_dir = str(tmp_path / "run")
  _train(run_dir, "run.steps=1")
  p = _runs.run(run_dir, "run.steps=2", change, cache_dir=cache)
  assert p.returncode == 2
  assert named in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, cache):
  """A small valid token dataset (byte vocabulary) to damage in different ways."""
  from jaxpipe import data
  out = str(tmp_path_factory.mktemp("data") / "good")
  rng = np.random.default_rng(0)
  data.write_tokens(out, {"train": rng.integers(0, 256, 4000).astype(np.uint16),
                          "val": rng.integers(0, 256, 1000).astype(np.uint16)},
                    vocab_size=257, eos_id=256, tokenizer="byte")
  return out


def _damaged(dataset, tmp_path, how):
  path = str(tmp_path / "bad")
  shutil.copytree(dataset, path)
  meta_path = os.path.join(path, "meta.json")
  with open(meta_path) as f:
    meta = json.load(f)
  if how == "truncated":
    with open(os.path.join(path, "train.bin"), "r+b") as f:
      f.truncate(1000)
    return path, "train.bin"
  if how == "header":
    meta["format"] = "something-else"
  elif how == "vocab":
    ids = np.memmap(os.path.join(path, "val.bin"), dtype=np.uint16, mode="r+")
    ids[10] = 300
    ids.flush()
    return path, "val.bin"
  elif how == "short":
    return path, None
  with open(meta_path, "w") as f:
    json.dump(meta, f)
  return path, "meta.json"


@pytest.mark.parametrize("how", ["truncated", "header", "vocab", "short"])
def test_bad_data_exits_2_naming_the_file(tmp_path, cache, dataset, how):
  path, name = _damaged(dataset, tmp_path, how)
  extra = ["data.seq_len=2048"] if how == "short" else []
  run_dir = tmp_path / "run"
  p = _runs.run(str(run_dir), f"data.path={path}", *extra, cache_dir=cache)
  assert p.returncode == 2, p.stderr
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
  assert path in lines[0] and (name is None or name in lines[0])
  assert not run_dir.exists()


@pytest.mark.parametrize("first,then", [(True, False), (False, True)],
                         ids=["rings-then-none", "none-then-rings"])
def test_a_flushed_run_resumes_whether_or_not_its_rings_are_state(tmp_path, cache, monkeypatch,
                                                                  first, then):
  """A gpipe checkpoint written with its stash rings in the state (the CPU tuning's
  `rings_in_state`) resumes without them, and the other way round: the losses of
  the run that never stopped, bit for bit."""
  from jaxpipe import launch  # pylint: disable=g-import-not-at-top
  args = ("pipeline.schedule=gpipe", "pipeline.stages=2", "pipeline.microbatches=4",
          "optimizer.name=adamw", "checkpoint.every=3")

  def rings(on):
    monkeypatch.setattr(launch, "schedule_options",
                        lambda cfg, name, o: dataclasses.replace(o, rings_in_state=on))

  rings(False)
  _train(str(tmp_path / "whole"), "run.steps=6", *args)
  half = str(tmp_path / "half")
  rings(first)
  first_run = _train(half, "run.steps=3", *args)
  assert type(first_run["state"]).__name__ == ("FlushedState" if first else "SyncState")
  rings(then)
  resumed = _train(half, "run.steps=6", *args)
  assert resumed["start_step"] == 3
  assert type(resumed["state"]).__name__ == ("FlushedState" if then else "SyncState")
  assert _runs.train_losses(half) == _runs.train_losses(str(tmp_path / "whole"))
