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

from jaxpipe import config as config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxpipe import study as study_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxpipe.study import _report  # pylint: disable=g-import-not-at-top,wrong-import-position


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
  recs = _runs.records(run_dir)
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
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
  assert study_lib.read_history(os.path.join(study, "results.json")) == history


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
    run_dir = os.path.join(out, "lr_sweep", f"adamw-lr{study_lib.fmt_lr(lr)}-s0")
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
  study_lib.journal_update(path, args, 100.0, {}, finished=False)
  study_lib.journal_update(path, args, 100.0, {"a": "done"}, finished=False)
  # The next invocation resumes and finishes.
  history = study_lib.journal_update(path, args, 200.0, {"a": "done", "b": "done"},
                                       finished=True)
  assert [h["t0"] for h in history] == [100.0, 200.0]
  assert [h["finished"] for h in history] == [False, True]
  assert [h["runs"]["done"] for h in history] == [1, 2]
  assert study_lib.read_history(path) == history
  meta = {"invocations": history, "elapsed_total_s": sum(h["elapsed_s"] for h in history)}
  lines = _report._how_it_ran(meta, [{"wall_s": 1.0}])
  assert "over 2 invocation(s), 1 of them stopped before the end" in lines[1]
  # A result file written before journals existed still gives its own list.
  old = tmp_path / "old" / "results.json"
  old.parent.mkdir()
  old.write_text(json.dumps({"meta": {"invocations": [{"command": "x", "elapsed_s": 1.0}]}}))
  assert study_lib.read_history(str(old)) == [{"command": "x", "elapsed_s": 1.0}]


def test_recovered_share():
  assert study_lib.recovered_share(1.0, 1.2, 1.05) == pytest.approx(0.75)
  assert study_lib.recovered_share(1.0, 0.99, 0.98) is None      # no gap, no share
  assert study_lib.recovered_share(1.0, math.nan, 1.0) is None
  assert study_lib.sweep_grid(3e-3, 3, 3.0) == [1e-3, 3e-3, 9e-3]


def test_a_directory_the_tool_did_not_make_is_left_alone(tmp_path):
  run_dir = tmp_path / "adamw-sync-s0"
  run_dir.mkdir()
  (run_dir / "metrics.jsonl").write_text('{"step": 0, "val_loss": 5.0}\n')
  cell = study_lib.Cell("adamw-sync-s0", str(run_dir), "adamw", "sync", 0, 3e-3, 2, ())
  with pytest.raises(study_lib.StudyError, match="not made by this tool"):
    study_lib.cell_state(cell, _runs.TINY)
  assert (run_dir / "metrics.jsonl").exists()


def test_weight_prediction_setting_is_enumerated_summarised_and_tabled(tmp_path):
  """delay-wp, from fixture metrics: its cell sets the trainer key, its gap and
  recovered share are computed like the correction's, and the table grows its columns."""
  plan = study_lib.Plan(_runs.TINY, config_lib.load(_runs.TINY, []), (),
                          str(tmp_path))
  cells = study_lib.study_cells(plan, ["adamw"], list(study_lib.SETTINGS), [0],
                                  {"adamw": 1e-3}, 4, 2)
  wp = next(c for c in cells if c.setting == "delay-wp")
  assert "optimizer.weight_prediction=1.0" in wp.overrides
  assert "optimizer.delay=1" in wp.overrides
  assert all("optimizer.weight_prediction=0.0" in c.overrides for c in cells if c is not wp)
  finals = {"sync": 2.0, "delay": 2.4, "delay-ef": 2.1, "delay-wp": 2.3}
  for c in cells:
    os.makedirs(c.run_dir)
    with open(os.path.join(c.run_dir, "metrics.jsonl"), "w") as f:
      for step, val in ((0, 5.0), (2, finals[c.setting] + 0.5), (4, finals[c.setting])):
        f.write(json.dumps({"step": step, "val_loss": val}) + "\n")
  row = study_lib.summarize(cells, ["adamw"], [0], 1000, 100)["optimizers"]["adamw"]
  assert row["predicted_gap"] == pytest.approx(0.3)
  assert row["recovered_wp"] == pytest.approx(0.25)
  assert row["recovered"] == pytest.approx(0.75)
  assert row["gap_curve"]["delay-wp"] == {0: 0.0, 2: pytest.approx(0.3), 4: pytest.approx(0.3)}
  table = study_lib.markdown_table({"optimizers": {"adamw": row}})
  assert "recovered by WP" in table.splitlines()[0]
  assert "| 2.3000 | +0.3000 | 25% |" in table
  # Without delay-wp runs the table keeps its old columns.
  cells3 = [c for c in cells if c is not wp]
  row3 = study_lib.summarize(cells3, ["adamw"], [0], 1000, 100)["optimizers"]["adamw"]
  assert "WP" not in study_lib.markdown_table({"optimizers": {"adamw": row3}})


def test_size_report_orders_sizes_and_tables_the_gaps(tmp_path):
  """--size-report from fixture results.json files: smallest model first, every gap."""
  dirs = []
  for name, params, gap in (("big", 200_000, 0.04), ("small", 20_000, 0.09)):
    d = tmp_path / name
    d.mkdir()
    row = {"lr": 0.012, "gap": gap, "corrected_gap": gap / 4, "recovered": 0.75,
           "settings": {"sync": {"mean": 1.0}, "delay": {"mean": 1.0 + gap},
                        "delay-ef": {"mean": 1.0 + gap / 4}}}
    opts = {"muon": row, **({"lion": row} if name == "big" else {})}  # lion: one size only
    (d / "results.json").write_text(json.dumps({
        "summary": {"params": params, "optimizers": opts},
        "meta": {"tokens_per_param": 13.4, "epochs": 0.75}}))
    dirs.append(str(d))
  out = tmp_path / "sizes"
  p = tool("--size-report", ",".join(dirs), "--out", str(out), cache=str(tmp_path / "c"))
  assert p.returncode == 0, p.stderr
  got = json.loads((out / "sizes.json").read_text())["optimizers"]
  assert list(got) == ["muon"]
  got = got["muon"]
  assert [r["params"] for r in got] == [20_000, 200_000]
  assert [r["gap"] for r in got] == [0.09, 0.04]
  md = (out / "sizes.md").read_text()
  assert "| muon | 20,000 | 13.4 | 0.012 | 1.0000 | 1.0900 | 1.0225 | +0.0900 | +0.0225 | 75% |" in md
  assert (out / "gap_vs_size.png").stat().st_size > 1000
  bad = tool("--size-report", dirs[0], "--out", str(out), cache=str(tmp_path / "c"))
  assert bad.returncode == 2 and "at least two" in bad.stderr
