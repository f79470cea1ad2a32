"""End-to-end runs of train.py on the tiny config: its documented contract (metrics.jsonl, run directory, exit codes, resume)."""

import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml

from jaxpipe import trainer
from tests import _runs

CONFIGS = sorted(glob.glob(os.path.join(_runs.ROOT, "configs", "*.yaml")))
PIPE = ("pipeline.schedule=2bw", "pipeline.stages=2", "mesh.data=2", "optimizer.name=muon",
        "optimizer.lr=0.02", "optimizer.error_feedback=1")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(c) for c in CONFIGS])
def test_every_config_parses(path):
  from jaxpipe import config
  cfg = config.load(path)
  assert cfg.run.steps >= 1
  with open(path) as f:
    assert set(yaml.safe_load(f)) <= set(config.to_dict(cfg))


@pytest.fixture(scope="module")
def pulse(tmp_path_factory, cache):
  """A finished two-step run of the tiny config: (run_dir, the process)."""
  run_dir = str(tmp_path_factory.mktemp("pulse") / "run")
  # With progress on, as a user's run has it; its stderr is a pipe, as in a redirected log.
  return run_dir, _runs.run(run_dir, "run.steps=2", "run.progress=true", cache_dir=cache)


def _kjv(cache):
  """The embedded corpus the tiny config trains on (already tokenised into `cache`)."""
  from jaxpipe import data  # pylint: disable=g-import-not-at-top
  return data.open_tokens(data.prepare_embedded("kjv", "byte", cache))


@pytest.mark.exit_status(0)
def test_pulse(pulse, cache):
  """Two steps write config, metrics, a checkpoint and a summary line."""
  run_dir, p = pulse
  assert p.returncode == 0, p.stderr
  assert "jaxpipe none" in p.stdout and "val loss" in p.stdout
  # The summary says what to do next, as commands that run from here.
  nxt = p.stdout[p.stdout.index("next:"):]
  for tool in ("generate.py --run", "plot_loss.py", "export_hf.py --run", "--logdir"):
    assert f"{tool} " in nxt and run_dir in nxt, nxt
  # The sampling prompt is the opening of the run's own validation text.
  sample = shlex.split(next(l for l in nxt.splitlines() if "generate.py" in l))
  prompt = sample[sample.index("--prompt") + 1]
  data = _kjv(cache)
  val_text = data.load_tokenizer().decode(data.split("val")[:200].tolist())
  assert len(prompt.split()) >= 3 and val_text.startswith(prompt), (prompt, val_text[:80])
  recs = _runs.records(run_dir)
  train = [r for r in recs if "loss" in r]
  assert [r["step"] for r in train] == [0, 1]
  for r in train:
    assert set(r) >= {"step", "loss", "lr", "tokens", "epoch", "step_time_s", "grad_norm",
                      "skipped"}
    assert np.isfinite(r["loss"]) and r["loss"] > 0
  assert train[1]["tokens"] == 2 * 8 * 32
  assert sorted(_runs.val_losses(run_dir)) == [0, 2]
  with open(os.path.join(run_dir, "config.yaml")) as f:
    text = f.read()
  assert text.startswith("# jaxpipe resolved config; commit ")
  assert yaml.safe_load(text)["model"]["vocab_size"] == 257  # resolved from the byte corpus
  assert _runs.checkpoints(run_dir) == [2]
  assert os.listdir(os.path.join(run_dir, "tb"))


def test_epochs_are_passes_over_the_training_split(pulse, cache):
  """Each record's epoch is (k+1) x batch / the split's sequences; the summary shows it."""
  run_dir, p = pulse
  assert p.returncode == 0, p.stderr
  windows = _kjv(cache).num_sequences("train", 32)
  train = [r for r in _runs.records(run_dir) if "loss" in r]
  assert [r["epoch"] for r in train] == [pytest.approx((k + 1) * 8 / windows, rel=1e-5)
                                         for k in (0, 1)]
  assert f"epoch {2 * 8 / windows:.2f})" in p.stdout


def test_a_redirected_log_has_plain_lines_and_no_carriage_returns(pulse):
  """Progress where stderr is not a terminal: a line per run.log_every steps, no bar."""
  run_dir, p = pulse
  assert p.returncode == 0, p.stderr
  assert "\r" not in p.stderr and "\r" not in p.stdout
  lines = [l for l in p.stderr.splitlines() if l.startswith("none step ")]
  assert [l.split(" | ")[0] for l in lines] == ["none step 1/2", "none step 2/2"], p.stderr
  assert all(" | loss " in l and " | epoch " in l for l in lines), lines
  assert "tokens/s" in lines[1]


def test_data_parallel_matches_one_device(tmp_path, cache, pulse):
  """mesh.data=2 on two emulated devices gives the one-device losses (the pulse run's)."""
  one, two = pulse[0], str(tmp_path / "two")
  assert pulse[1].returncode == 0
  p = _runs.run(two, "run.steps=2", "mesh.data=2", cache_dir=cache)
  assert p.returncode == 0, p.stderr
  assert "emulating 2 devices" in p.stderr
  a, b = _runs.train_losses(one), _runs.train_losses(two)
  assert sorted(a) == sorted(b) == [0, 1]
  np.testing.assert_allclose([b[k] for k in range(2)], [a[k] for k in range(2)],
                             rtol=2e-6, atol=0)
  np.testing.assert_allclose(list(_runs.val_losses(two).values()),
                             list(_runs.val_losses(one).values()), rtol=2e-6)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
  """An uninterrupted 2bw run (Muon, error feedback) of 30 steps."""
  run_dir = str(tmp_path_factory.mktemp("reference"))
  p = _runs.run(run_dir, "run.steps=30", "checkpoint.every=3", *PIPE, cache_dir=cache)
  assert p.returncode == 0, p.stderr
  return _runs.train_losses(run_dir), _runs.val_losses(run_dir)


def _assert_same_run(run_dir, reference):
  losses, vals = reference
  got = _runs.train_losses(run_dir)
  assert sorted(got) == list(range(30))
  # The resumed run must be the uninterrupted one, bit for bit.
  assert [got[k] for k in range(30)] == [losses[k] for k in range(30)]
  assert _runs.val_losses(run_dir)[30] == vals[30]


# SIGKILL at any moment, with exact continuation: tests/test_resume.py.


def test_sigterm_saves_and_resumes_exactly(tmp_path, cache, reference):
  run_dir = str(tmp_path / "preempted")
  proc = _runs.start(run_dir, "run.steps=30", "checkpoint.every=3", *PIPE, cache_dir=cache)
  try:
    assert _runs.wait_for(lambda: len(_runs.train_losses(run_dir)) >= 2)
    _runs.kill(proc, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == trainer.EXIT_INTERRUPTED == 75, err
  assert "interrupted by SIGTERM" in err and "Traceback" not in err
  stopped_at = _runs.checkpoints(run_dir)[-1]
  assert 0 < stopped_at < 30
  p = _runs.run(run_dir, "run.steps=30", "checkpoint.every=3", *PIPE, cache_dir=cache)
  assert p.returncode == 0, p.stderr
  _assert_same_run(run_dir, reference)


def test_larger_steps_continue_a_finished_run(tmp_path, cache, reference):
  run_dir = str(tmp_path / "continued")
  assert _runs.run(run_dir, "run.steps=12", *PIPE, cache_dir=cache).returncode == 0
  p = _runs.run(run_dir, "run.steps=30", *PIPE, cache_dir=cache)
  assert p.returncode == 0, p.stderr
  # tiny.yaml's learning rate is constant, so the continued run is the 30-step one,
  # and nothing is said about the schedule.
  assert "schedule now spans" not in p.stderr
  _assert_same_run(run_dir, reference)


BAD = [
    (["model.bogus=1"], "model.bogus"),
    (["run.steps=abc"], "run.steps"),
    (["optimizer.lr=fast"], "optimizer.lr"),
    (["data.path=/nonexistent/tokens"], "/nonexistent/tokens"),
    (["pipeline.schedule=gpipe", "pipeline.stages=3"], "pipeline.stages=3"),
    (["pipeline.microbatches=3"], "pipeline.microbatches=3"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay"),
    (["mesh.data=3"], "mesh.data=3"),
    (["pipeline.schedule=2bw", "pipeline.stages=4", "pipeline.microbatches=4",
      "data.batch_size=16"], "2*(stages-1) = 6"),
    (["pipeline.schedule=gpipe", "pipeline.stages=4", "mesh.data=4", "data.batch_size=32"],
     "16 devices"),
    (["pipeline.schedule=2bw", "pipeline.stages=2", "pipeline.microbatches=2", "mesh.data=4",
      "model.moe.num_experts=6"], "mesh.expert_parallel=false"),
]


@pytest.mark.exit_status(2)
@pytest.mark.parametrize("overrides,named", BAD, ids=[b[1] for b in BAD])
def test_bad_input_exits_2_with_one_line(tmp_path, cache, overrides, named):
  run_dir = tmp_path / "run"
  p = _runs.run(str(run_dir), *overrides, cache_dir=cache)
  assert p.returncode == 2
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
  assert named in lines[0]
  assert not run_dir.exists()


def test_config_that_is_a_directory_exits_2_with_one_line(tmp_path, cache):
  run_dir = tmp_path / "run"
  p = _runs.run(str(run_dir), cache_dir=cache, config=str(tmp_path))
  assert p.returncode == 2, p.stderr
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and "is a directory" in lines[0], p.stderr
  assert not run_dir.exists()


def _tree(path):
  """Every file and folder under path, relative to it."""
  return sorted(os.path.relpath(os.path.join(d, n), path)
                for d, dirs, files in os.walk(path) for n in dirs + files)


NOT_CONFIGS = {
    # An executable, as `--config /bin/ls` gives: not UTF-8 text.
    "binary": (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8, "not a text file"),
    # A run on every default is never what an empty file meant.
    "empty": (b"", "holds no settings"),
    "only comments": (b"# run:\n#   steps: 5\n", "holds no settings"),
}


@pytest.mark.parametrize("kind", NOT_CONFIGS)
def test_a_config_file_that_is_not_a_config_exits_2_and_creates_nothing(tmp_path, cache, kind):
  content, said = NOT_CONFIGS[kind]
  path = tmp_path / "config.yaml"
  path.write_bytes(content)
  p = _runs.run(str(tmp_path / "run"), cache_dir=cache, config=str(path))
  assert p.returncode == 2, p.stderr
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], p.stderr
  assert said in lines[0]
  assert _tree(tmp_path) == ["config.yaml"]


def test_an_explicit_empty_mapping_means_every_default(tmp_path):
  from jaxpipe import config  # pylint: disable=g-import-not-at-top
  path = tmp_path / "defaults.yaml"
  path.write_text("{}\n")
  assert config.load(str(path)) == config.Config()


@pytest.mark.parametrize("where", ["a new directory", "a directory without checkpoints"])
def test_resume_without_a_checkpoint_exits_2_and_creates_nothing(tmp_path, cache, where):
  run_dir = tmp_path / "run"
  if where == "a directory without checkpoints":
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine\n")
  before = _tree(tmp_path)
  p = _runs.run(str(run_dir), "--resume", cache_dir=cache)
  assert p.returncode == 2, p.stderr
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: --resume: no checkpoint in "), p.stderr
  assert _tree(tmp_path) == before


def test_help_lists_every_config_key_with_its_default():
  from jaxpipe import config  # pylint: disable=g-import-not-at-top
  p = subprocess.run([sys.executable, _runs.TRAIN, "--help"], capture_output=True, text=True,
                     timeout=60, cwd=_runs.ROOT)
  assert p.returncode == 0, p.stderr
  assert "--resume" in p.stdout and "75" in p.stdout

  def sections(tree, prefix=""):
    keys = {k: v for k, v in tree.items() if not isinstance(v, dict)}
    yield prefix, keys
    for k, v in tree.items():
      if isinstance(v, dict):
        yield from sections(v, f"{prefix}{k}.")

  lines = p.stdout.splitlines()
  for name, keys in sections(config.to_dict(config.Config())):
    if not name:
      continue
    at = lines.index(f"{name[:-1]}:")
    block = lines[at + 1:at + 1 + len(keys)]
    assert [l.split(":")[0].strip() for l in block] == list(keys), (name, block)
    for line, (key, default) in zip(block, keys.items()):
      assert line.startswith(f"  {key}: {json.dumps(default)}"), line
  assert "  steps: 100  # optimizer steps" in p.stdout  # the field's own comment comes along


def test_mismatched_resume_is_refused_and_nothing_is_lost(tmp_path, cache, pulse):
  run_dir = str(tmp_path / "run")
  assert pulse[1].returncode == 0
  shutil.copytree(pulse[0], run_dir)
  before = {p: open(p, "rb").read() for p in glob.glob(run_dir + "/**", recursive=True)
            if os.path.isfile(p)}
  p = _runs.run(run_dir, "run.steps=4", "model.dim=64", cache_dir=cache)
  assert p.returncode == 2
  assert "model.dim: 32 -> 64" in p.stderr and len(p.stderr.strip().splitlines()) == 1
  after = {p: open(p, "rb").read() for p in glob.glob(run_dir + "/**", recursive=True)
           if os.path.isfile(p)}
  assert after == before


def test_moe_in_bfloat16_trains_with_2bw(tmp_path, cache):
  """The accelerator path on the emulated mesh: MoE blocks split over 2 replicas,
  bfloat16 compute, 2bw."""
  run_dir = str(tmp_path / "moe")
  p = _runs.run(run_dir, "run.steps=3", "model.compute_dtype=bfloat16", "mesh.data=2",
                cache_dir=cache, config=os.path.join(_runs.ROOT, "configs", "tiny-moe.yaml"))
  assert p.returncode == 0, p.stderr
  losses = _runs.train_losses(run_dir)
  assert sorted(losses) == [0, 1, 2] and all(np.isfinite(v) for v in losses.values())
  vals = _runs.val_losses(run_dir)
  assert vals[3] < vals[0]


def test_plot_tool_draws_a_run(tmp_path, pulse):
  run_dir, p = pulse
  assert p.returncode == 0
  out = tmp_path / "loss.png"
  p = subprocess.run([sys.executable, os.path.join(_runs.ROOT, "tools", "plot_loss.py"),
                      run_dir, run_dir, "--labels", "a", "b", "--out", str(out)],
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
  bad = subprocess.run([sys.executable, os.path.join(_runs.ROOT, "tools", "plot_loss.py"),
                        str(tmp_path / "missing"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2 and bad.stderr.startswith("error: ")


def test_the_own_corpus_example_runs_as_written(tmp_path, cache):
  """configs/my-corpus.yaml's commands, on a small text file of one's own (the LICENSE)."""
  path = os.path.join(_runs.ROOT, "configs", "my-corpus.yaml")
  commands = [shlex.split(l.lstrip("# ")) for l in open(path) if l.startswith("#   .venv/bin/")]
  assert [c[1] for c in commands] == ["tools/prepare_data.py", "train.py"], commands
  text = tmp_path / "text.txt"
  shutil.copy(os.path.join(_runs.ROOT, "LICENSE"), text)
  out, run_dir = str(tmp_path / "data"), str(tmp_path / "run")
  mine = {"path/to/your/text.txt": str(text), "data/my-corpus": out}
  prepare = [sys.executable] + [mine.get(a, a) for a in commands[0][1:]]
  p = subprocess.run(prepare, capture_output=True, text=True, timeout=120, cwd=_runs.ROOT)
  assert p.returncode == 0, p.stderr
  # As written, but for where it writes and how long it runs.
  train = [sys.executable] + commands[1][1:] + [f"run.dir={run_dir}", f"data.path={out}",
                                                 "run.steps=2"]
  p = subprocess.run(train, capture_output=True, text=True, timeout=300, cwd=_runs.ROOT,
                     env=_runs.env(cache))
  assert p.returncode == 0, p.stderr
  losses = _runs.train_losses(run_dir)
  assert sorted(losses) == [0, 1] and all(np.isfinite(v) for v in losses.values())
  assert sorted(_runs.val_losses(run_dir)) == [0, 2]
