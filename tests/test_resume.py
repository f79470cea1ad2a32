"""Kills at any moment and resumes on another mesh: the run continues as if uninterrupted."""

import os
import random
import shutil
import signal
import time

import numpy as np
import pytest

from jaxpipe import config, resume, trainer
from jaxpipe.errors import CheckpointError, ConfigError
from tests import _runs

# 2bw on 2 stages with Muon and the correction: every kind of state a
# checkpoint holds (two versions, in-flight buffers, delay and error buffers).
KILLED = ["run.steps=8", "checkpoint.every=3", "eval.every=3", "pipeline.schedule=2bw",
          "pipeline.stages=2", "optimizer.name=muon", "optimizer.error_feedback=1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("cache"))
  os.environ["JAXPIPE_CACHE"] = path
  return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
  """The uninterrupted run: (training losses, validation losses) by step."""
  run_dir = str(tmp_path_factory.mktemp("reference"))
  p = _runs.run(run_dir, *KILLED, cache_dir=cache)
  assert p.returncode == 0, p.stderr
  return _runs.train_losses(run_dir), _runs.val_losses(run_dir)


def _attempt(run_dir, cache, *extra):
  """One attempt of the killed run's command (plus a fault hook); the finished process."""
  return _runs.run(run_dir, *KILLED, *extra, cache_dir=cache)


def _assert_as_uninterrupted(run_dir, reference):
  losses, vals = reference
  assert _runs.train_losses(run_dir) == losses
  assert _runs.val_losses(run_dir) == vals
  assert sorted(losses) == list(range(8)) and sorted(vals) == [0, 3, 6, 8]


def test_kills_at_every_moment_continue_exactly(tmp_path, cache, reference):
  """Killed before, during and after the first save, then at random: same losses, no traceback."""
  run_dir = str(tmp_path / "run")
  errs = []
  # Before any checkpoint exists: the next attempt starts over.
  p = _attempt(run_dir, cache, "run.debug_kill=record:1")
  errs.append(p.stderr)
  assert p.returncode == -signal.SIGKILL and _runs.checkpoints(run_dir) == []
  assert sorted(_runs.train_losses(run_dir)) == [0, 1]
  # While the first checkpoint is being written (asynchronously), not committed.
  p = _attempt(run_dir, cache, "run.debug_kill=save:3")
  errs.append(p.stderr)
  assert p.returncode == -signal.SIGKILL
  assert "starting over from step 0" in p.stderr
  committed = _runs.checkpoints(run_dir)
  # After the first checkpoint's save began, before the second's.
  p = _attempt(run_dir, cache, "run.debug_kill=record:5")
  errs.append(p.stderr)
  assert p.returncode == -signal.SIGKILL
  assert ("resuming from" if committed else "starting over") in p.stderr
  # At a random moment of an attempt that resumes.
  rng = random.Random(0)
  proc = _runs.start(run_dir, *KILLED, cache_dir=cache)
  try:
    assert _runs.wait_for(lambda: len(_runs.train_losses(run_dir)) >= 6, timeout=240)
    time.sleep(rng.uniform(0, 0.6))
    _runs.kill(proc, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    errs.append(err)
  finally:
    if proc.poll() is None:
      proc.kill()
  # Six records mean checkpoint 6's save began, after checkpoint 3's was committed.
  p = _attempt(run_dir, cache)
  errs.append(p.stderr)
  assert p.returncode == 0, p.stderr
  assert "resuming from" in p.stderr
  _assert_as_uninterrupted(run_dir, reference)
  assert not [e for e in errs if "Traceback" in e], errs


def _interrupted(run_dir, cache, *signals):
  """Starts a long run of the tiny config, sends `signals` once it has two records.

  Returns (exit status, stderr). The exit status does not depend on the
  schedule; what 2bw saves and resumes, test_kills_at_every_moment_continue_exactly
  and test_train.py's SIGTERM test check.
  """
  proc = _runs.start(run_dir, "run.steps=400", cache_dir=cache)
  try:
    assert _runs.wait_for(lambda: len(_runs.train_losses(run_dir)) >= 2, timeout=240)
    for sig in signals:  # two of one kind pending at once would arrive as one
      proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  return proc.returncode, err


@pytest.mark.exit_status(75)
def test_an_interrupt_saves_and_exits_with_the_resume_status(tmp_path, cache):
  run_dir = str(tmp_path / "run")
  status, err = _interrupted(run_dir, cache, signal.SIGINT)
  assert status == trainer.EXIT_INTERRUPTED == 75, err
  assert "Traceback" not in err, err
  said = [l for l in err.splitlines() if l.startswith("interrupted by SIGINT after step ")]
  assert len(said) == 1 and "checkpoint saved" in said[0], err
  stopped_at = int(said[0].split()[5])
  assert _runs.checkpoints(run_dir) == [stopped_at] and stopped_at >= 2


@pytest.mark.exit_status("128+N")
def test_a_second_signal_stops_at_once_without_saving(tmp_path, cache):
  run_dir = str(tmp_path / "run")
  status, err = _interrupted(run_dir, cache, signal.SIGTERM, signal.SIGINT)
  # Both land before the first one's save is done; whichever is handled
  # second stops the run, with the status of a death by that signal.
  assert status in (trainer.EXIT_SIGNAL + signal.SIGINT, trainer.EXIT_SIGNAL + signal.SIGTERM), err
  assert status != trainer.EXIT_INTERRUPTED
  assert "stopped at once by an interrupt, without saving" in err
  assert "Traceback" not in err, err
  assert _runs.checkpoints(run_dir) == []


def test_records_of_another_config_without_a_checkpoint_are_refused(tmp_path, cache):
  run_dir = str(tmp_path / "run")
  p = _attempt(run_dir, cache, "run.debug_kill=record:0")
  assert p.returncode == -signal.SIGKILL
  p = _runs.run(run_dir, *KILLED, "optimizer.lr=1e-3", cache_dir=cache)
  assert p.returncode == 2
  err = p.stderr.strip().splitlines()
  assert len(err) == 1 and "holds metrics of another run (optimizer.lr: 0.003 -> 0.001)" in err[0]
  assert sorted(_runs.train_losses(run_dir)) == [0], "the earlier records were touched"


def test_a_bad_kill_point_is_refused(tmp_path, cache):
  p = _runs.run(str(tmp_path / "run"), "run.debug_kill=later:3", cache_dir=cache)
  assert p.returncode == 2 and "run.debug_kill must be MOMENT:STEP" in p.stderr


def test_a_resume_that_respans_the_schedule_says_so(tmp_path, cache, capsys):
  run_dir = str(tmp_path / "run")
  _train(run_dir, "run.steps=2", "optimizer.schedule=cosine")
  capsys.readouterr()
  _train(run_dir, "run.steps=4", "optimizer.schedule=cosine")
  said = [l for l in capsys.readouterr().err.splitlines() if "schedule now spans" in l]
  # tiny.yaml: lr 3e-3, floor 0.1 of it. Step 2 was the end of a 2-step cosine
  # (the floor); of 4 steps it is the middle: 3e-4 + 2.7e-3 / 2.
  assert said == ["run.steps 2 -> 4: the cosine schedule now spans 4 steps instead of 2; "
                  "the rate at step 2 changes from 0.0003 to 0.00165"]
  lr = {r["step"]: r["lr"] for r in _runs.records(run_dir) if "loss" in r}
  assert lr[2] == pytest.approx(1.65e-3, rel=1e-6)


def test_schedule_change_names_what_a_new_horizon_does():
  def cfg(schedule, steps):
    return config.load(_runs.TINY, [f"optimizer.schedule={schedule}", f"run.steps={steps}"])
  assert resume.schedule_change(cfg("constant", 20), 10, 10) is None
  assert resume.schedule_change(cfg("cosine", 10), 10, 10) is None
  assert resume.schedule_change(cfg("cosine", 20), None, 10) is None  # no run.steps saved
  # wsd decays over its last 20%: extended while stable, only later rates change.
  assert resume.schedule_change(cfg("wsd", 100), 50, 20) == (
      "run.steps 50 -> 100: the wsd schedule now spans 100 steps instead of 50; "
      "the rate at step 20 stays 0.003, later ones change")
  assert resume.schedule_change(cfg("wsd", 100), 50, 50) == (
      "run.steps 50 -> 100: the wsd schedule now spans 100 steps instead of 50; "
      "the rate at step 50 changes from 0.0003 to 0.003")


# --- the decision alone: fresh, restart, resume, relayout, refusal -------------------
# `resume.decide` reads the newest checkpoint's step and meta item and run.dir's
# records; a stand-in checkpointer gives those, so nothing is built or compiled.


class _Checkpoints:
  """What `decide` reads of a Checkpointer: the newest step and its meta item."""

  def __init__(self, directory, latest=None, saved=None):
    self.directory, self.latest, self.saved = str(directory), latest, saved

  def latest_step(self):
    return self.latest

  def read_meta(self, step):
    assert step == self.latest, "decide read another checkpoint than the newest"
    return {"config": self.saved, "step": step}


class _KeepsStages:
  """A schedule that continues a checkpoint of another data degree, not of another stage count."""

  def __init__(self, stages):
    self.stages, self.asked = stages, []

  def check_relayout(self, saved_stages, saved_data):
    self.asked.append((saved_stages, saved_data))
    if saved_stages != self.stages:
      raise ValueError(f"pipeline.stages={saved_stages} cannot continue with {self.stages}")


def _cfg(run_dir, *overrides):
  return config.load(_runs.TINY, [f"run.dir={run_dir}", "model.vocab_size=257",
                                  "pipeline.schedule=1f1b", "pipeline.stages=2", *overrides])


def _saved(run_dir, *overrides):
  return config.to_dict(_cfg(run_dir, *overrides))


def test_decide_starts_fresh_in_an_empty_run_dir(tmp_path):
  cfg, schedule = _cfg(tmp_path), _KeepsStages(2)
  d = resume.decide(cfg, schedule, _Checkpoints(tmp_path / "checkpoints"))
  assert d.latest is None and not d.restart and d.meta == {} and d.saved_config == {}
  assert d.layout == resume.Layout(2, 1, False, True) and not d.relayout
  assert schedule.asked == []
  with pytest.raises(CheckpointError, match=r"^--resume: no checkpoint in .*checkpoints$"):
    resume.decide(cfg, schedule, _Checkpoints(tmp_path / "checkpoints"), require_resume=True)


def test_decide_starts_over_the_records_of_the_same_config_only(tmp_path):
  import yaml  # pylint: disable=g-import-not-at-top
  ckpt = _Checkpoints(tmp_path / "checkpoints")
  (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n')
  with pytest.raises(CheckpointError, match=r"holds metrics of another run \(no config.yaml\)"):
    resume.decide(_cfg(tmp_path), _KeepsStages(2), ckpt)
  # Keys a resume may change (run.steps, the mesh) do not make it another run.
  (tmp_path / "config.yaml").write_text(yaml.safe_dump(_saved(tmp_path, "run.steps=5",
                                                              "mesh.data=2")))
  d = resume.decide(_cfg(tmp_path), _KeepsStages(2), ckpt)
  assert d.latest is None and d.restart
  with pytest.raises(CheckpointError, match=r"holds metrics of another run "
                                            r"\(optimizer.lr: 0.003 -> 0.001\) and no checkpoint"):
    resume.decide(_cfg(tmp_path, "optimizer.lr=1e-3"), _KeepsStages(2), ckpt)
  assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0, "loss": 5.0}\n'


def test_decide_resumes_the_newest_checkpoint_in_place(tmp_path):
  schedule = _KeepsStages(2)
  ckpt = _Checkpoints(tmp_path / "checkpoints", 3, _saved(tmp_path, "run.steps=10"))
  d = resume.decide(_cfg(tmp_path), schedule, ckpt)
  assert d.latest == 3 and not d.restart and not d.relayout
  assert d.saved_config["run"]["steps"] == 10 and d.meta["step"] == 3
  assert schedule.asked == []   # the same mesh: nothing to ask the schedule


def test_decide_relays_out_what_the_schedule_can_carry_and_refuses_the_rest(tmp_path):
  schedule = _KeepsStages(2)
  ckpt = _Checkpoints(tmp_path / "checkpoints", 3, _saved(tmp_path, "mesh.data=2"))
  d = resume.decide(_cfg(tmp_path), schedule, ckpt)
  assert d.latest == 3 and d.relayout
  assert d.saved == resume.Layout(2, 2, False, True) and d.layout.data == 1
  assert schedule.asked == [(2, 2)]
  ckpt = _Checkpoints(tmp_path / "checkpoints", 3, _saved(tmp_path, "pipeline.stages=4"))
  with pytest.raises(CheckpointError, match=r"^cannot resume .*checkpoints/3: "
                                            r"pipeline.stages=4 cannot continue with 2$"):
    resume.decide(_cfg(tmp_path), schedule, ckpt)


def test_decide_reads_keys_an_older_checkpoint_lacks_as_they_were(tmp_path):
  # Before pipeline.head the head was split over the stages; before
  # mesh.expert_parallel the experts were whole on every replica.
  moe = ["model.moe.num_experts=4", "mesh.data=2", "mesh.expert_parallel=true",
         "pipeline.head=last_stage"]
  saved = _saved(tmp_path, *moe)
  del saved["pipeline"]["head"], saved["mesh"]["expert_parallel"]
  d = resume.decide(_cfg(tmp_path, *moe), _KeepsStages(2),
                    _Checkpoints(tmp_path / "checkpoints", 3, saved))
  assert d.saved == resume.Layout(2, 2, False, True)
  assert d.layout == resume.Layout(2, 2, True, False) and d.relayout


def test_decide_refuses_another_config_and_fewer_steps_than_done(tmp_path):
  ckpt = _Checkpoints(tmp_path / "checkpoints", 3, _saved(tmp_path, "model.n_layers=2"))
  with pytest.raises(CheckpointError, match=r"written with a different config "
                                            r"\(model.n_layers: 2 -> 4\)"):
    resume.decide(_cfg(tmp_path), _KeepsStages(2), ckpt)
  ckpt = _Checkpoints(tmp_path / "checkpoints", 30, _saved(tmp_path))
  with pytest.raises(ConfigError, match=r"^run.steps=20 is below the newest checkpoint's step "
                                        r"\(30\) in .*; give run.steps >= 30$"):
    resume.decide(_cfg(tmp_path), _KeepsStages(2), ckpt)


# --- resuming on another mesh -------------------------------------------------------


def _train(run_dir, *overrides):
  cfg = config.load(_runs.TINY, [f"run.dir={run_dir}", "checkpoint.async_save=false",
                                 "eval.every=3", *overrides])
  return trainer.train(cfg)


MESHES = {
    # The in-flight state rebuilt for another data and stage count at once (2 x 2 to 4 x 1).
    "2bw stages 2 -> 4, data 2 -> 1": (["pipeline.schedule=2bw", "pipeline.microbatches=8",
                                        "data.batch_size=16",
                                        "optimizer.name=muon", "optimizer.error_feedback=1"],
                                       ["pipeline.stages=2", "mesh.data=2"],
                                       ["pipeline.stages=4", "mesh.data=1"]),
    # The same mesh, the experts on every replica before (as in a checkpoint
    # from before expert parallelism) and split over data after: 2bw's
    # in-flight accumulator and residual stash change their per-device layout.
    "2bw moe, experts whole -> split": (["pipeline.schedule=2bw", "pipeline.microbatches=2",
                                         "pipeline.stash=residuals", "pipeline.stages=2",
                                         "mesh.data=2", "model.moe.num_experts=4",
                                         "model.moe.ffn_dim=64"],
                                        ["mesh.expert_parallel=false"], []),
    "1f1b stages 2 -> 4, data 1 -> 2": (["pipeline.schedule=1f1b", "pipeline.microbatches=4"],
                                        ["pipeline.stages=2"],
                                        ["pipeline.stages=4", "mesh.data=2"]),
}


@pytest.mark.parametrize("name", list(MESHES))
def test_resume_on_another_mesh_equals_the_uninterrupted_run(tmp_path, cache, name):
  common, before, after = MESHES[name]
  _train(str(tmp_path / "whole"), "run.steps=6", "checkpoint.every=3", *common, *before)
  # The same run as if it had stopped after step 3 (records past it are
  # replaced on resume): its checkpoint 3, written on the old mesh.
  half = str(tmp_path / "half")
  shutil.copytree(str(tmp_path / "whole"), half)
  shutil.rmtree(os.path.join(half, "checkpoints", "6"))
  if name.startswith("1f1b"):
    # This case resumes from the older checkpoint format, the pair (state,
    # the run's key): the relayout reads the pair's arrays.
    _to_older_pair(os.path.join(half, "checkpoints"), 3)
  resumed = _train(half, "run.steps=6", "checkpoint.every=3", *common, *after)
  assert resumed["start_step"] == 3
  a, b = _runs.train_losses(str(tmp_path / "whole")), _runs.train_losses(half)
  assert sorted(a) == sorted(b) == list(range(6))
  # Reductions run in another order on the new mesh: float32 rounding apart.
  np.testing.assert_allclose([b[k] for k in range(6)], [a[k] for k in range(6)],
                             rtol=1e-6, atol=0)
  va, vb = _runs.val_losses(str(tmp_path / "whole")), _runs.val_losses(half)
  assert sorted(va) == sorted(vb) == [0, 3, 6]
  np.testing.assert_allclose([vb[k] for k in va], [va[k] for k in va], rtol=1e-6, atol=0)
  # Weights are not compared element by element: Adam's update of a row
  # whose gradient is rounding noise (a byte never seen) is that noise's sign
  # times the learning rate, so one ulp apart in a gradient is a step apart.


def test_pipedream_refuses_another_stage_count_and_takes_another_data_degree(tmp_path, cache):
  run_dir = str(tmp_path / "run")
  common = ["pipeline.schedule=pipedream", "pipeline.microbatches=4"]
  _train(run_dir, "run.steps=2", *common, "pipeline.stages=2")
  with pytest.raises(CheckpointError, match="pipeline.stages=2 cannot continue with 4"):
    _train(run_dir, "run.steps=4", *common, "pipeline.stages=4")
  assert _runs.checkpoints(run_dir) == [2]
  resumed = _train(run_dir, "run.steps=4", *common, "pipeline.stages=2", "mesh.data=2")
  assert resumed["start_step"] == 2 and sorted(_runs.train_losses(run_dir)) == [0, 1, 2, 3]


def test_config_yaml_records_the_tokenizer_of_the_data(tmp_path, cache):
  import yaml  # pylint: disable=g-import-not-at-top
  from jaxpipe import data  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / "gpt2-data")
  rng = np.random.default_rng(0)
  data.write_tokens(path, {"train": rng.integers(0, 500, 3000).astype(np.uint16),
                           "val": rng.integers(0, 500, 500).astype(np.uint16)},
                    vocab_size=50257, eos_id=50256, tokenizer="gpt2")
  run_dir = str(tmp_path / "run")
  # tiny.yaml says data.tokenizer: byte, which only the embedded corpus uses.
  _train(run_dir, "run.steps=1", f"data.path={path}")
  with open(os.path.join(run_dir, "config.yaml")) as f:
    saved = yaml.safe_load(f)
  assert saved["data"]["tokenizer"] == "gpt2" and saved["model"]["vocab_size"] == 50257


def test_a_key_newer_than_the_checkpoint_counts_as_its_default():
  now = config.to_dict(config.load(_runs.TINY, []))
  older = {k: dict(v) if isinstance(v, dict) else v for k, v in now.items()}
  del older["model"]["loss_chunk"]   # written before the key existed
  assert resume.config_differences(older, now) == []
  older["model"]["dim"] = 16
  assert resume.config_differences(older, now) == ["model.dim: 16 -> 32"]


def test_run_steps_below_the_checkpoint_is_refused(tmp_path, cache):
  run_dir = str(tmp_path / "run")
  _train(run_dir, "run.steps=3")
  p = _runs.run(run_dir, "run.steps=2", cache_dir=cache)
  assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
  assert "run.steps=2 is below the newest checkpoint's step (3)" in p.stderr


# --- the older checkpoint format ------------------------------------------------------


def _to_older_pair(ckpt_dir, step):
  """Rewrites checkpoint `step` as the format before the unused RNG key was dropped.

  That format saved the pair (state, the run's key) as the state item.
  """
  import jax
  import orbax.checkpoint as ocp
  manager = ocp.CheckpointManager(ckpt_dir, item_names=("state", "data", "meta"))
  out = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore(),
      meta=ocp.args.JsonRestore()))
  key = np.asarray(jax.random.key_data(jax.random.key(0)))
  shutil.rmtree(os.path.join(ckpt_dir, str(step)))
  manager.reload()
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave((out["state"], key)), data=ocp.args.JsonSave(out["data"]),
      meta=ocp.args.JsonSave(out["meta"])), force=True)
  manager.wait_until_finished()
  manager.close()
  from jaxpipe.checkpoint import saved_pair
  assert saved_pair(_saved_tree(ckpt_dir, step))


def _saved_tree(ckpt_dir, step):
  from jaxpipe.runs import _reader
  manager = _reader(ckpt_dir)
  try:
    return manager.item_metadata(step)["state"].tree
  finally:
    manager.close()


def test_a_checkpoint_with_the_older_rng_key_resumes_exactly(tmp_path, cache):
  """The older (state, key) pair resumes bit for bit and gives the tools the same weights."""
  import jax
  from jaxpipe import runs
  from jaxpipe.checkpoint import saved_pair
  whole = str(tmp_path / "whole")
  common = ["run.steps=6", "checkpoint.every=3", "optimizer.name=adamw"]
  _train(whole, *common)
  assert not saved_pair(_saved_tree(os.path.join(whole, "checkpoints"), 3))
  older = str(tmp_path / "older")
  shutil.copytree(whole, older)
  shutil.rmtree(os.path.join(older, "checkpoints", "6"))
  _to_older_pair(os.path.join(older, "checkpoints"), 3)
  # The weights a tool reads (export, generation) are those of the new format.
  _, new_params, _ = runs.load_params(whole, 3)
  _, old_params, _ = runs.load_params(older, 3)
  for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(old_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The same mesh: the run continues bit for bit, and its next checkpoint is the new format.
  assert _train(older, *common)["start_step"] == 3
  assert _runs.train_losses(older) == _runs.train_losses(whole)
  assert _runs.val_losses(older) == _runs.val_losses(whole)
  assert not saved_pair(_saved_tree(os.path.join(older, "checkpoints"), 6))
  # On another mesh the pair is read by the relayout path: the case
  # "1f1b stages 2 -> 4, data 1 -> 2" of
  # test_resume_on_another_mesh_equals_the_uninterrupted_run.


def test_a_state_with_zero_size_arrays_saves_and_restores(tmp_path):
  """SOAP's unrotated sides are [..., 0, 0] arrays, which orbax cannot save as they are.

  The checkpointer saves a stand-in and restores the template's empty
  array; every other leaf comes back as it was, in its sharding.
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jaxpipe import optim
  from jaxpipe.checkpoint import Checkpointer, path_key
  from jaxpipe.pipeline import make_mesh
  mesh = make_mesh(2, 1)
  params = {"blocks": {"mlp": {"kernel": jax.device_put(
      jnp.arange(24.0).reshape(2, 3, 4), NamedSharding(mesh, P("stage")))}}}
  tx = optim.soap(0.1, max_precond_dim=3)   # the side of 4 is not rotated
  state = tx.init(params)
  _, state = tx.update(params, state, params)
  empty = [x for x in jax.tree.leaves(state) if x.size == 0]
  assert empty and all(x.shape == (2, 0, 0) for x in empty)
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, state, {"pos": 1}, {"step": 1})
  ckpt.wait()
  restored, data, _ = ckpt.restore(1, jax.tree.map(jnp.zeros_like, state))
  assert data == {"pos": 1}
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    assert a.shape == b.shape and a.dtype == b.dtype and a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Another mesh's path (jaxpipe.resume's relayout): every array but the empty ones, by name.
  shapes = ckpt.saved_shapes(1)
  flat = {path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
  wanted = {k: jax.ShapeDtypeStruct(shapes[k], x.dtype, sharding=x.sharding)
            for k, x in flat.items() if x.size}
  arrays, _ = ckpt.restore_arrays(1, wanted)
  assert sorted(arrays) == sorted(wanted)
  for k, x in arrays.items():
    np.testing.assert_array_equal(np.asarray(x), np.asarray(flat[k]))
  ckpt.close()


def test_an_interrupt_in_a_save_wait_logs_no_traceback(tmp_path, caplog):
  """orbax logs what reaches it while it waits for a save; the second signal's interrupt is not logged."""
  from absl import logging as absl_logging
  from jaxpipe.checkpoint import Checkpointer
  Checkpointer(str(tmp_path / "ckpt"), async_save=False).close()
  with caplog.at_level("ERROR", logger="absl"):
    for exc in (KeyboardInterrupt(), RuntimeError("disk full")):
      try:
        raise exc
      except BaseException:  # pylint: disable=broad-except
        absl_logging.error("Save Finalize thread failed.", exc_info=True)
  assert [r.exc_info[0] for r in caplog.records] == [RuntimeError]


# --- lean checkpoints: 2bw's in-flight state is recomputed, not saved ------------------

# 2bw with a residual stash, Muon and the correction: the largest in-flight
# state (the vjp's residuals per slot) beside every kind of saved state.
LEAN = ["run.steps=6", "checkpoint.every=3", "pipeline.schedule=2bw", "pipeline.stages=2",
        "pipeline.microbatches=2", "pipeline.stash=residuals", "optimizer.name=muon",
        "optimizer.error_feedback=1"]


def _same_bits(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _saved_arrays(run_dir, step):
  """{dotted name: orbax's array metadata} of the arrays checkpoint `step`'s state holds."""
  from jaxpipe.runs import _saved_tree as saved_tree
  _, flat = saved_tree(os.path.join(run_dir, "checkpoints"), step)
  return {k: v for k, v in flat.items() if hasattr(v, "shape")}


def _state_values(run_dir, step):
  """{dotted name: NumPy array} of every array checkpoint `step`'s state holds, as saved."""
  import jax
  import orbax.checkpoint as ocp
  from jaxpipe.checkpoint import path_key
  manager = ocp.CheckpointManager(os.path.join(run_dir, "checkpoints"),
                                  item_names=("state", "data", "meta"))
  try:
    out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  finally:
    manager.close()
  flat = jax.tree_util.tree_flatten_with_path(out["state"])[0]
  return {path_key(p): np.asarray(x) for p, x in flat}


def _disk_bytes(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@pytest.fixture(scope="module")
def lean_run(tmp_path_factory, cache):
  """The uninterrupted 2bw run of LEAN, with checkpoints 3 and 6."""
  run_dir = str(tmp_path_factory.mktemp("lean"))
  _train(run_dir, *LEAN)
  return run_dir


def _resume_from_3(source, run_dir):
  """Copies a run, drops its checkpoint 6 and continues it from checkpoint 3."""
  shutil.copytree(source, run_dir)
  shutil.rmtree(os.path.join(run_dir, "checkpoints", "6"))
  assert _train(run_dir, *LEAN)["start_step"] == 3


def _assert_same_run(a, b):
  """Equal losses and an equal checkpoint 6, bit for bit."""
  assert _runs.train_losses(a) == _runs.train_losses(b)
  assert _runs.val_losses(a) == _runs.val_losses(b)
  va, vb = _state_values(a, 6), _state_values(b, 6)
  assert sorted(va) == sorted(vb)
  assert [k for k in va if not _same_bits(va[k], vb[k])] == []


def test_a_2bw_checkpoint_holds_no_in_flight_arrays_and_resumes_bit_for_bit(tmp_path, lean_run):
  import jax
  cfg = config.load(_runs.TINY, [f"run.dir={lean_run}", *LEAN])
  run = trainer.make_run(cfg)
  abstract = jax.eval_shape(lambda r: run.schedule.init_sharded(run.model.init, r,
                                                                run.batch_shape),
                            jax.random.key(0))
  nbytes = lambda tree: sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                            for x in jax.tree.leaves(tree))
  saved = _saved_arrays(lean_run, 3)
  # Of the in-flight state only batch k-1's tokens are saved; the stash, the
  # buffers in transit and the partial gradient are recomputed at resume.
  assert sorted(k for k in saved if k.startswith("inflight.")) == ["inflight.targets",
                                                                   "inflight.tokens"]
  checkpointed = run.schedule.checkpointed(abstract)
  dotted = lambda path: ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))
                                 for k in path)
  # The optimizer's state is left out of the comparison: the listing of
  # `_saved_tree` names its nested tuples differently (the bit-exact resumes
  # below show it is all saved).
  expected = {dotted(path) for path, _ in jax.tree_util.tree_flatten_with_path(checkpointed)[0]}
  assert {k for k in saved if not k.startswith("opt_state.")} == {
      k for k in expected if not k.startswith("opt_state.")}
  assert nbytes(checkpointed) < nbytes(abstract) / 2
  resumed = str(tmp_path / "resumed")
  _resume_from_3(lean_run, resumed)
  _assert_same_run(lean_run, resumed)


def test_an_older_checkpoint_with_in_flight_arrays_resumes_bit_for_bit(tmp_path, lean_run,
                                                                        monkeypatch):
  """Checkpoints written before they were lean hold 2bw's in-flight arrays: they are left unread."""
  from jaxpipe.pipeline._schedules import TwoBW
  older = str(tmp_path / "older")
  with monkeypatch.context() as m:
    m.setattr(TwoBW, "checkpointed", lambda self, state: state)   # the older format
    _train(older, *LEAN)
  saved = _saved_arrays(older, 3)
  assert any(k.startswith("inflight.stash.") for k in saved)
  assert _disk_bytes(os.path.join(older, "checkpoints", "3")) > _disk_bytes(
      os.path.join(lean_run, "checkpoints", "3"))
  resumed = str(tmp_path / "resumed")
  _resume_from_3(older, resumed)
  _assert_same_run(lean_run, resumed)
  # The resumed run writes the lean format.
  assert not any(k.startswith("inflight.stash.") for k in _saved_arrays(resumed, 6))


def _live_slots(plan, k):
  """Per stage, the stash slots step k reads before it writes them: batch k-1's entries."""
  base = (k * plan.num_microbatches) % plan.slots
  live = [set() for _ in range(plan.num_stages)]
  for t in range(plan.num_ticks):
    for s in range(plan.num_stages):
      b = plan.bwd[t, s]
      # The last stage runs a microbatch's forward in the very tick of its
      # backward: that slot is written in step k before it is read.
      if 0 <= b < plan.history and b not in plan.fwd[:t + 1, s]:
        live[s].add((base + int(plan.bwd_slot[t, s])) % plan.slots)
  return live


@pytest.mark.parametrize("stash,shape,guarded", [("residuals", (2, 1, 2), True),
                                                 ("inputs", (2, 2, 3), False)])
def test_the_recomputed_in_flight_state_is_what_was_in_flight(stash, shape, guarded):
  """`TwoBW.resume` remakes the in-flight state from the saved arrays, bit for bit where read.

  Compared array by array with the uninterrupted run's after 3 steps
  (buffers in transit, partial gradient and loss whole; the stash in the
  slots the next step reads), then over two more steps of both.
  """
  import jax
  from jaxpipe.pipeline import make_mesh, make_schedule
  from tests import _pipeline_util as pu
  s_, d_, m = shape
  sched = make_schedule("2bw", pu.stage_fns(), pu.optimizer("muon", ef=1.0),
                        make_mesh(s_, d_), m, stash=stash)
  batch_shape = (m, pu.ROWS, pu.SEQ)
  data = [tuple(jax.device_put(x, sched.batch_sharding()) for x in b) for b in pu.batches(m)]
  go = jax.device_put(np.asarray(True), sched.replicated()) if guarded else None
  state, k = sched.init(pu.initial_params(), batch_shape), 3
  for tokens, targets in data[:k]:
    state, _ = sched.step(state, tokens, targets, go)
  saved = jax.device_get(state)
  fresh = sched.init(pu.initial_params(), batch_shape)
  # What a checkpoint gives: copies of the saved arrays, the fresh state's elsewhere.
  restored = jax.tree.map(lambda keep, x, y: jax.device_put(x, y.sharding) if keep else y,
                          sched.saved_fields(state), saved, fresh)
  rebuilt = sched.resume(restored, fresh, guarded=guarded)
  got, want = jax.device_get(rebuilt.inflight), saved.inflight
  for name in ("fwd_buf", "bwd_buf", "acc", "loss", "tokens", "targets"):
    assert all(_same_bits(a, b) for a, b in zip(jax.tree.leaves(getattr(got, name)),
                                                jax.tree.leaves(getattr(want, name)))), name
  live = _live_slots(sched.plan, k)
  assert any(live)   # the last stage has none: its backward follows its forward
  for a, b in zip(jax.tree.leaves(got.stash), jax.tree.leaves(want.stash)):  # [S, D, slot, ...]
    for s in range(s_):
      for slot in live[s]:
        assert _same_bits(a[s, :, slot], b[s, :, slot])
  assert all(_same_bits(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(rebuilt.prev)),
                                              jax.tree.leaves(saved.prev)))
  for tokens, targets in data[k:k + 2]:
    state, met_a = sched.step(state, tokens, targets, go)
    rebuilt, met_b = sched.step(rebuilt, tokens, targets, go)
    assert _same_bits(met_a["loss"], met_b["loss"])
  # Two steps on: the weights, the optimizer state and batch k+1's partial gradient.
  pick = lambda st: jax.device_get((st.prev, st.cur, st.opt_state, st.inflight.acc,
                                    st.inflight.loss))
  assert all(_same_bits(a, b) for a, b in zip(jax.tree.leaves(pick(rebuilt)),
                                              jax.tree.leaves(pick(state))))
