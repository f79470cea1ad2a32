"""tools/delay_study.py on the tiny config and two steps: table, resume, sweep, 2bw check."""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from tests import _runs

TOOL = os.path.join(_runs.ROOT, "tools", "delay_study.py")
SETTINGS = ("sync", "delay", "delay-ef")
# Two steps of the tiny model; a checkpoint after every step, so that a run can
# be cut back to "checkpointed but unfinished". Three jobs: the three settings
# compile at once, which is most of the time these runs take.
TINY = ("--config", _runs.TINY, "--steps", "2", "--optimizers", "adamw", "--jobs", "3",
        "checkpoint.every=1")

sys.path.insert(0, os.path.join(_runs.ROOT, "tools"))
import delay_study  # pylint: disable=g-import-not-at-top,wrong-import-position


def tool(*args: str, cache: str, timeout: float = 240) -> subprocess.CompletedProcess:
  """Runs the tool to completion."""
  return subprocess.run([sys.executable, TOOL, *args], env=_runs.env(cache), cwd=_runs.ROOT,
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def study(tmp_path_factory, cache):
  """The study of one optimizer in all three settings, two steps each."""
  out = str(tmp_path_factory.mktemp("study"))
  p = tool(*TINY, "--out", out, cache=cache)
  assert p.returncode == 0, p.stdout + p.stderr
  return out


def _final_val(run_dir: str, steps: int = 2) -> float:
  return _runs.val_losses(run_dir)[steps]


def test_table_has_every_cell_and_the_recovered_share_is_right(study):
  with open(os.path.join(study, "results.json")) as f:
    res = json.load(f)
  row = res["summary"]["optimizers"]["adamw"]
  vals = {s: _final_val(os.path.join(study, f"adamw-{s}-s0")) for s in SETTINGS}
  for s in SETTINGS:
    assert row["settings"][s]["n"] == 1
    assert row["settings"][s]["mean"] == pytest.approx(vals[s], abs=1e-12)
  gap = vals["delay"] - vals["sync"]
  assert row["gap"] == pytest.approx(gap, abs=1e-12)
  assert row["corrected_gap"] == pytest.approx(vals["delay-ef"] - vals["sync"], abs=1e-12)
  if gap > 0:
    assert row["recovered"] == pytest.approx((vals["delay"] - vals["delay-ef"]) / gap)
  else:
    assert row["recovered"] is None
  # The gap at every evaluation (eval.every=1 at two steps: 0, 1, 2).
  assert sorted(map(int, row["gap_curve"]["delay"])) == [0, 1, 2]
  last = res["meta"]["invocations"][-1]
  assert last["runs"]["done"] == 3 and last["jaxpipe_commit"] and last["elapsed_s"] > 0
  assert last["machine"]["cpus"] >= 1 and "delay_study.py --config" in last["command"]
  with open(os.path.join(study, "results.md")) as f:
    md = f.read()
  line = next(l for l in md.splitlines() if l.startswith("| adamw |"))
  for s in SETTINGS:
    assert f"{vals[s]:.4f}" in line
  assert f"{gap:+.4f}" in line
  for png in ("val_curves.png", "gap_vs_length.png"):
    assert os.path.getsize(os.path.join(study, png)) > 1000
  # Each cell is an ordinary run directory that plot_loss reads.
  from jaxpipe.cli import plot_loss  # pylint: disable=g-import-not-at-top
  train, val = plot_loss.read_metrics(os.path.join(study, "adamw-delay-ef-s0"))
  assert [r["step"] for r in train] == [0, 1] and val[-1]["step"] == 2


def test_the_simulated_settings_differ(study):
  """The delay changes training: a study whose settings all trained alike would mean nothing."""
  train = {s: _runs.train_losses(os.path.join(study, f"adamw-{s}-s0")) for s in SETTINGS}
  assert train["sync"][0] == train["delay"][0]    # batch 0 runs on the initial weights
  assert train["sync"][1] != train["delay"][1]    # the delayed run has not moved yet


def _mtimes(out: str) -> dict[str, float]:
  return {s: os.path.getmtime(os.path.join(out, f"adamw-{s}-s0", "metrics.jsonl"))
          for s in SETTINGS}


def _cut_metrics(run_dir: str, after: int) -> None:
  """Leaves the records a kill right after step `after`'s checkpoint would leave."""
  path = os.path.join(run_dir, "metrics.jsonl")
  with open(path) as f:
    recs = [json.loads(l) for l in f if l.strip()]
  with open(path, "w") as f:
    for r in recs:
      if r["step"] < after or ("val_loss" in r and r["step"] <= after):
        f.write(json.dumps(r) + "\n")


def test_resume_keeps_finished_runs_and_continues_the_others(study, cache):
  """sync is finished and stays untouched; delay was killed after its step-1
  checkpoint (what a kill leaves: no later checkpoint, no later records) and
  resumes from it; delay-ef left metrics but no checkpoint and starts over."""
  before = _mtimes(study)
  finals = {s: _final_val(os.path.join(study, f"adamw-{s}-s0")) for s in SETTINGS}
  killed = os.path.join(study, "adamw-delay-s0")
  shutil.rmtree(os.path.join(killed, "checkpoints", "2"))
  _cut_metrics(killed, after=1)
  no_ckpt = os.path.join(study, "adamw-delay-ef-s0")
  shutil.rmtree(os.path.join(no_ckpt, "checkpoints"))
  _cut_metrics(no_ckpt, after=1)
  p = tool(*TINY, "--out", study, cache=cache)
  assert p.returncode == 0, p.stdout + p.stderr
  assert "1 finished already, 1 to resume from a checkpoint, 1 to restart" in p.stdout
  assert "adamw-sync-s0" not in "".join(l for l in p.stdout.splitlines(True) if "start" in l)
  assert _mtimes(study)["sync"] == before["sync"]
  with open(os.path.join(killed, "study.log")) as f:
    assert "resuming from" in f.read()
  # Both continue to the same numbers as before: the runs are deterministic.
  for s in ("delay", "delay-ef"):
    assert _final_val(os.path.join(study, f"adamw-{s}-s0")) == pytest.approx(finals[s], rel=1e-6)
  # Both invocations are on record, each finished, in the results and the journal.
  with open(os.path.join(study, "results.json")) as f:
    history = json.load(f)["meta"]["invocations"]
  assert [h["finished"] for h in history] == [True, True]
  assert [h["runs"]["done"] for h in history] == [3, 3]
  assert delay_study.read_history(os.path.join(study, "results.json")) == history


def test_a_directory_of_another_config_is_refused(study, cache):
  p = tool(*TINY, "--out", study, "--lr", "adamw=1e-3", cache=cache)
  assert p.returncode == 2
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and "another config" in lines[0] and "optimizer.lr" in lines[0]


def test_lr_sweep_writes_its_json_and_the_study_reads_it(tmp_path, cache):
  out = str(tmp_path)
  # The grid 3e-3, 1.2e-2: its first run compiles what the study's adamw-sync run did.
  p = tool("--lr-sweep", *TINY, "--out", out, "--sweep-points", "2", "--sweep-steps", "2",
           "--lr", "adamw=6e-3", "--sweep-factor", "4", cache=cache)
  assert p.returncode == 0, p.stdout + p.stderr
  with open(os.path.join(out, "lr_sweep.json")) as f:
    sweep = json.load(f)
  losses = sweep["val_loss"]["adamw"]
  assert sorted(map(float, losses)) == [3e-3, 1.2e-2]
  rates = {float(lr): v for lr, v in losses.items()}
  assert sweep["best"]["adamw"] == min(rates, key=rates.get)
  for lr, v in rates.items():
    run_dir = os.path.join(out, "lr_sweep", f"adamw-lr{delay_study.fmt_lr(lr)}-s0")
    assert _final_val(run_dir) == v
  args = argparse.Namespace(lr="from-sweep", sweep_json="")
  assert delay_study.resolve_lrs(args, ["adamw"], out)["adamw"] == sweep["best"]["adamw"]


def test_check_2bw_passes(tmp_path, cache):
  # AdamW, whose simulated run the study compiled already (the default is Muon).
  p = tool("--check-2bw", "--config", _runs.TINY, "--check-steps", "2", "--out", str(tmp_path),
           "--check-optimizer", "adamw", "--jobs", "2", cache=cache)
  assert p.returncode == 0, p.stdout + p.stderr
  assert "PASS" in p.stdout
  with open(os.path.join(tmp_path, "check_2bw.json")) as f:
    check = json.load(f)
  assert check["passed"] and len(check["pipe_losses"]) == 2
  assert check["max_rel_diff"] <= check["rtol"]


@pytest.mark.parametrize("args,named", [
    (("--optimizers", "adamw,sgdx"), "sgdx"),
    (("--lr", "nadam=1e-3"), "nadam"),
    (("optimizer.lr=1e-3",), "optimizer.lr"),
    (("--bogus",), "--bogus"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, cache, args, named):
  out = tmp_path / "out"
  p = tool(*TINY, "--out", str(out), *args, cache=cache)
  assert p.returncode == 2
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], p.stderr
  assert not out.exists()


def test_an_invocation_killed_part_way_stays_on_record(tmp_path):
  path = str(tmp_path / "results.json")
  args = argparse.Namespace(jobs=2, threads=1)
  # Journalled at its start and after its first run; then killed, so never finished.
  delay_study.journal_update(path, args, 100.0, {}, finished=False)
  delay_study.journal_update(path, args, 100.0, {"a": "done"}, finished=False)
  # The next invocation resumes and finishes.
  history = delay_study.journal_update(path, args, 200.0, {"a": "done", "b": "done"},
                                       finished=True)
  assert [h["t0"] for h in history] == [100.0, 200.0]
  assert [h["finished"] for h in history] == [False, True]
  assert [h["runs"]["done"] for h in history] == [1, 2]
  assert delay_study.read_history(path) == history
  meta = {"invocations": history, "elapsed_total_s": sum(h["elapsed_s"] for h in history)}
  lines = delay_study._how_it_ran(meta, [{"wall_s": 1.0}])
  assert "over 2 invocation(s), 1 of them stopped before the end" in lines[1]
  # A result file written before journals existed still gives its own list.
  old = tmp_path / "old" / "results.json"
  old.parent.mkdir()
  old.write_text(json.dumps({"meta": {"invocations": [{"command": "x", "elapsed_s": 1.0}]}}))
  assert delay_study.read_history(str(old)) == [{"command": "x", "elapsed_s": 1.0}]


def test_recovered_share():
  assert delay_study.recovered_share(1.0, 1.2, 1.05) == pytest.approx(0.75)
  assert delay_study.recovered_share(1.0, 0.99, 0.98) is None      # no gap, no share
  assert delay_study.recovered_share(1.0, math.nan, 1.0) is None
  assert delay_study.sweep_grid(3e-3, 3, 3.0) == [1e-3, 3e-3, 9e-3]


def test_a_directory_the_tool_did_not_make_is_left_alone(tmp_path):
  run_dir = tmp_path / "adamw-sync-s0"
  run_dir.mkdir()
  (run_dir / "metrics.jsonl").write_text('{"step": 0, "val_loss": 5.0}\n')
  cell = delay_study.Cell("adamw-sync-s0", str(run_dir), "adamw", "sync", 0, 3e-3, 2, ())
  with pytest.raises(delay_study.StudyError, match="not made by this tool"):
    delay_study.cell_state(cell, _runs.TINY)
  assert (run_dir / "metrics.jsonl").exists()
