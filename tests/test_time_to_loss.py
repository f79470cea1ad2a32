"""tools/time_to_loss.py and jaxpipe.time_to_loss: the arithmetic on known curves, the report
from its JSON, resuming, bad input, the planner's projection, and (slow) a tiny study end to end."""

import json
import math
import os
import subprocess
import sys

import pytest

from jaxpipe import runs as runs_lib
from jaxpipe import time_to_loss as ttl
from jaxpipe.errors import InputError
from tests import _runs

TOOL = os.path.join(_runs.ROOT, "tools", "time_to_loss.py")
PLANNER = os.path.join(_runs.ROOT, "tools", "planner.py")

sys.path.insert(0, os.path.join(_runs.ROOT, "tools"))
import time_to_loss as tool  # pylint: disable=g-import-not-at-top,wrong-import-position


def _cli(*args: str, script: str = TOOL, cache: str = "", timeout: float = 120):
  env = _runs.env(cache) if cache else dict(os.environ)
  return subprocess.run([sys.executable, script, *args], env=env, cwd=_runs.ROOT,
                        capture_output=True, text=True, timeout=timeout)


def _one_line_error(p: subprocess.CompletedProcess, named: str = "") -> None:
  assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
  assert named in lines[0], lines[0]


# --- known curves ---------------------------------------------------------------------
#
# A synthetic run: steps before 3 and those before an evaluation take odd
# times (compilation, evaluations), every other step `step_s`, so the counted
# clock at step k is exactly k * step_s. Evaluations every 10 of 40 steps.
EVALS = (0, 10, 20, 30, 40)


def _run(cell: str, seed: int, step_s: float, vals, evals=EVALS) -> dict:
  steps = evals[-1]
  times = [step_s] * steps
  times[0], times[1], times[2] = 7.0, 0.9, 0.8
  for e in evals[1:-1]:
    times[e - 1] = 3.0
  return {"cell": cell, "seed": seed, "steps": steps, "step_time_s": times,
          "val": [[s, v] for s, v in zip(evals, vals)], "overrides": []}


# The reference reaches 3.0 and 2.8 at step 20 (target 2.9, their mean); 2bw
# with Muon needs 26 steps of 0.16 s; 2bw with AdamW never gets there.
RUNS = {
    "1f1b-muon-s0": _run("1f1b-muon", 0, 0.2, [5, 4, 3, 2, 1]),
    "1f1b-muon-s1": _run("1f1b-muon", 1, 0.2, [5, 4, 2.8, 2, 1]),
    "2bw-muon-s0": _run("2bw-muon", 0, 0.16, [5, 4.5, 3.5, 2.5, 1.5]),
    "2bw-muon-s1": _run("2bw-muon", 1, 0.16, [5, 4.5, 3.5, 2.5, 1.5]),
    "2bw-adamw-s0": _run("2bw-adamw", 0, 0.15, [5, 4.5, 4, 3.8, 3.6]),
}


def test_first_crossing_is_linear_between_points():
  xs, ys = [0, 10, 20, 30], [4.0, 3.0, 2.0, 1.5]
  assert ttl.first_crossing(xs, ys, 2.5) == pytest.approx(15.0)
  assert ttl.first_crossing(xs, ys, 1.75) == pytest.approx(25.0)
  assert ttl.first_crossing(xs, ys, 2.0) == 20.0       # exactly at a point
  assert ttl.first_crossing(xs, ys, 4.5) == 0.0        # reached before training
  assert ttl.first_crossing(xs, ys, 1.0) is None       # never
  # The first crossing counts, not a later one after a rise.
  assert ttl.first_crossing([0, 1, 2, 3], [3.0, 1.0, 2.0, 0.0], 1.5) == pytest.approx(0.75)


def test_time_and_steps_to_target_come_from_the_same_segment():
  c = ttl.Curve(steps=(0, 10, 20), val=(4.0, 3.0, 2.0), seconds=(0.0, 7.0, 15.0), step_s=0.7)
  assert ttl.to_target(c, 2.5) == pytest.approx({"seconds": 11.0, "steps": 15.0})
  assert ttl.to_target(c, 2.0) == pytest.approx({"seconds": 15.0, "steps": 20.0})
  assert ttl.to_target(c, 1.9) == {"seconds": None, "steps": None}


def test_compile_and_evaluation_steps_count_as_the_median():
  times = [30.0, 0.5, 0.4, 0.2, 0.3, 0.9, 0.2, None, 0.25]
  # Evaluations after 6 updates (inside step 5's interval) and after the last step (none).
  counted = ttl.counted_step_times(times, [0, 6, 9])
  m = 0.225  # median of steps 3, 4, 6, 8
  assert counted == pytest.approx([m, m, m, 0.2, 0.3, m, 0.2, m, 0.25])
  with pytest.raises(InputError):
    ttl.counted_step_times([9.0, 1.0, 1.0], [0, 3])


def test_a_runs_clock_is_its_counted_steps_summed():
  c = ttl.curve(RUNS["2bw-muon-s0"])
  assert c.steps == (0, 10, 20, 30, 40)
  assert c.seconds == pytest.approx((0.0, 1.6, 3.2, 4.8, 6.4))
  assert c.step_s == pytest.approx(0.16)
  # A run whose step 5 ran long (not before an evaluation) keeps it.
  run = _run("x-y", 0, 0.1, [5, 4, 3, 2, 1])
  run["step_time_s"][5] = 1.1
  assert ttl.curve(run).seconds[1] == pytest.approx(10 * 0.1 + 1.0)


def test_seeds_aggregate_into_a_spread_and_a_mean_curve():
  assert ttl.spread([10.0, 14.0]) == {"each": [10.0, 14.0], "reached": 2, "of": 2,
                                      "mean": 12.0, "min": 10.0, "max": 14.0}
  # A seed that never reached it: no mean and no largest, but the fastest seed stands.
  assert ttl.spread([10.0, None]) == {"each": [10.0, None], "reached": 1, "of": 2,
                                      "mean": None, "min": 10.0, "max": None}
  a = ttl.Curve((0, 10, 20), (4.0, 3.0, 2.0), (0.0, 2.0, 4.0), 0.2)
  b = ttl.Curve((0, 10, 20, 30), (4.0, 2.0, 1.0, 0.5), (0.0, 4.0, 8.0, 12.0), 0.4)
  m = ttl.mean_curve([a, b])
  assert m.steps == (0, 10, 20) and m.val == pytest.approx((4.0, 2.5, 1.5))
  assert m.seconds == pytest.approx((0.0, 3.0, 6.0)) and m.step_s == pytest.approx(0.3)


def test_summary_of_known_runs():
  target = ttl.target_from(RUNS, "1f1b-muon", 20)
  assert target == pytest.approx(2.9)
  s = ttl.summarize(RUNS, target)["cells"]
  ref = s["1f1b-muon"]
  # Seed 0 crosses 2.9 a tenth into 20-30, seed 1 eleven twelfths into 10-20.
  assert ref["steps"]["each"] == pytest.approx([21.0, 10 + 10 * 1.1 / 1.2])
  assert ref["seconds"]["each"] == pytest.approx([4.2, 0.2 * (10 + 10 * 1.1 / 1.2)])
  # Their mean curve passes through 2.9 at step 20 exactly.
  assert ref["mean_curve"] == pytest.approx({"steps": 20.0, "seconds": 4.0})
  assert ref["time_vs_reference"] == 1.0
  two = s["2bw-muon"]
  assert two["mean_curve"] == pytest.approx({"steps": 26.0, "seconds": 26 * 0.16})
  assert two["time_vs_reference"] == pytest.approx(26 * 0.16 / 4.0)
  assert two["seconds"]["mean"] == pytest.approx(4.16) and two["step_s"] == pytest.approx(0.16)
  never = s["2bw-adamw"]
  assert never["mean_curve"] == {"seconds": None, "steps": None}
  assert never["seconds"]["reached"] == 0 and never["time_vs_reference"] is None
  assert never["final_val"]["mean"] == pytest.approx(3.6)


def test_projection_is_steps_ratio_times_the_schedules_step():
  summary = ttl.summarize(RUNS, 2.9)
  p = ttl.project(summary, [(4, 8), (4, 4), (2, 8)])
  assert p["ratios"]["2bw-muon"] == {"source": "2bw-muon", "steps_ratio": pytest.approx(1.3)}
  assert p["ratios"]["2bw-adamw"]["steps_ratio"] is None
  row = {(r["stages"], r["microbatches"], r["cell"]): r for r in p["rows"]}
  # S=4, M=8: 1F1B's step M + S - 1 = 11 units, 2BW's M = 8.
  assert row[4, 8, "1f1b-muon"]["step_units"] == 11 and row[4, 8, "2bw-muon"]["step_units"] == 8
  assert row[4, 8, "2bw-muon"]["time"] == pytest.approx(1.3 * 8 / 32)
  assert row[4, 8, "1f1b-muon"]["time"] == pytest.approx(11 / 32)
  assert row[4, 8, "2bw-muon"]["vs_reference"] == pytest.approx(1.3 * 8 / 11)
  assert row[2, 8, "2bw-muon"]["vs_reference"] == pytest.approx(1.3 * 8 / 9)
  # 2bw refuses M < 2(S-1); a cell that never reached the target has no time.
  assert row[4, 4, "2bw-muon"]["vs_reference"] is None
  assert row[4, 8, "2bw-adamw"]["vs_reference"] is None
  # Interleaved: M + (S-1)/v, and only where S v divides the blocks.
  assert ttl.step_units("interleaved", 4, 8, 2) == pytest.approx(8 + 3 / 2)
  assert ttl.step_units("interleaved", 4, 8, 2, num_layers=4) is None


def test_projection_at_two_stages_against_the_measurement():
  summary = ttl.summarize(RUNS, 2.9)
  check = {r["cell"]: r for r in ttl.check_two_stages(summary, microbatches=8)}
  # c = 2bw's step / M = 0.02 s; 1f1b's step at S=2, M=8 is 9 of them; 20 steps.
  assert check["1f1b-muon"]["c_s"] == pytest.approx(0.02)
  assert check["1f1b-muon"]["projected_s"] == pytest.approx(0.02 * 9 * 20)
  assert check["1f1b-muon"]["ratio"] == pytest.approx(3.6 / 4.0)
  assert check["1f1b-muon"]["within"] is True
  assert check["2bw-muon"]["ratio"] == pytest.approx(1.0)
  assert check["2bw-adamw"]["ratio"] is None


# --- the tool without training ----------------------------------------------------------


def _result_json(out: str, runs: dict) -> str:
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "time_to_loss.json")
  with open(path, "w") as f:
    json.dump({"tool": "tools/time_to_loss.py", "runs": runs, "settings": {
        "steps": 20, "steps_per_run": 40, "microbatches": 8, "eval_every": 10}}, f)
  return path


def test_report_recomputes_the_same_numbers_from_the_json(tmp_path, capsys):
  out = str(tmp_path / "out")
  path = _result_json(out, RUNS)
  assert tool.main(["--out", out, "--report"]) == 0
  with open(path) as f:
    first = json.load(f)
  assert first["summary"] == json.loads(json.dumps(ttl.summarize(RUNS, 2.9)))
  assert first["summary"]["target"] == pytest.approx(2.9)
  assert first["runs"] == RUNS
  assert os.path.getsize(os.path.join(out, "time_to_loss.png")) > 0
  assert tool.main(["--out", out, "--report"]) == 0
  with open(path) as f:
    again = json.load(f)
  for key in ("summary", "projection", "check", "target_source", "runs", "commit", "machine"):
    assert again[key] == first[key], key
  # A report keeps the commit and machine the runs were made on.
  with open(path, "w") as f:
    json.dump({**again, "commit": "abc+dirty", "machine": {"load_avg_1m": 0.5}}, f)
  assert tool.main(["--out", out, "--report"]) == 0
  with open(path) as f:
    kept = json.load(f)
  assert kept["commit"] == "abc+dirty" and kept["machine"] == {"load_avg_1m": 0.5}
  # Another target, nothing trained.
  assert tool.main(["--out", out, "--report", "--target", "3.5"]) == 0
  with open(path) as f:
    other = json.load(f)
  assert other["summary"]["cells"]["2bw-muon"]["mean_curve"]["steps"] == pytest.approx(20.0)
  assert "| 2bw-adamw | not reached |" in capsys.readouterr().out


def test_markdown_goes_between_the_markers(tmp_path):
  out = str(tmp_path / "out")
  _result_json(out, RUNS)
  doc = tmp_path / "doc.md"
  doc.write_text(f"# Title\n\nbefore\n\n{ttl.BEGIN}\nold\n{ttl.END}\n\nafter\n")
  assert tool.main(["--out", out, "--report", "--markdown", str(doc)]) == 0
  text = doc.read_text()
  assert text.startswith("# Title\n\nbefore\n\n" + ttl.BEGIN)
  assert text.endswith(ttl.END + "\n\nafter\n")
  assert "old" not in text and "| 2bw-muon | 4.16 |" in text
  assert "| 2bw-muon | 1.300 | 0.867 |" in text  # S=2, M=2: 1.3 x 2 units / 1F1B's 3
  with open(os.path.join(out, "time_to_loss.md")) as f:
    assert f.read().strip() == text[text.index(ttl.BEGIN):text.index(ttl.END) + len(ttl.END)]
  bare = tmp_path / "bare.md"
  bare.write_text("no markers\n")
  assert tool.main(["--out", out, "--report", "--markdown", str(bare)]) == 2
  assert bare.read_text() == "no markers\n"


def _write_finished(args, name: str, run_dir: str, steps: int, final: bool = True) -> None:
  """A run folder as train.py and the tool leave it, with synthetic numbers."""
  cell = ttl.CellName.parse(name.rpartition("-s")[0])
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, tool.MARKER), "w") as f:
    json.dump({"overrides": tool.run_overrides(args, cell, 0)}, f)
  with open(os.path.join(run_dir, runs_lib.METRICS), "w") as f:
    for k in range(steps if final else steps // 2):
      f.write(json.dumps({"step": k, "loss": 3.0, "step_time_s": 0.1}) + "\n")
      if (k + 1) % args.eval_every == 0 and (final or k + 1 < steps):
        f.write(json.dumps({"step": k + 1, "val_loss": 5.0 - 0.1 * (k + 1)}) + "\n")


def test_a_finished_run_is_kept_and_an_unfinished_one_trained_again(tmp_path, monkeypatch, capsys):
  out = str(tmp_path / "out")
  argv = ["--out", out, "--cells", "1f1b-muon,2bw-muon", "--seeds", "1", "--steps", "10",
          "--eval-every", "5", "--overrun", "2", "--microbatches", "2"]
  args = tool.parse_args(argv)
  _write_finished(args, "1f1b-muon-s0", os.path.join(out, "1f1b-muon-s0"), 20)
  _write_finished(args, "2bw-muon-s0", os.path.join(out, "2bw-muon-s0"), 20, final=False)
  trained = []

  def fake_train(args, name, run_dir, overrides):
    trained.append(name)
    assert not os.path.exists(run_dir)  # the unfinished folder was removed to start over
    return {**_run(name.rpartition("-s")[0], 0, 0.1, [5, 4, 3, 2, 1], (0, 5, 10, 15, 20)),
            "overrides": overrides, "wall_s": 1.0}

  monkeypatch.setattr(tool, "train", fake_train)
  assert tool.main(argv) == 0
  assert trained == ["2bw-muon-s0"]
  assert "2 runs of 20 steps: 1 done already, 1 to train" in capsys.readouterr().out
  with open(os.path.join(out, "time_to_loss.json")) as f:
    kept = json.load(f)["runs"]["1f1b-muon-s0"]
  assert kept["val"][-1] == [20, pytest.approx(3.0)] and len(kept["step_time_s"]) == 20
  # Again: everything is in the JSON, even with the folder gone; nothing trains.
  os.rename(os.path.join(out, "1f1b-muon-s0"), os.path.join(out, "moved"))
  trained.clear()
  assert tool.main(argv) == 0 and trained == []
  assert "2 done already, 0 to train" in capsys.readouterr().out
  # Other settings in the same --out are refused, not mixed in.
  assert tool.main(argv[:-1] + ["4"]) == 2


@pytest.mark.parametrize("args,named", [
    (("--seeds", "0"), "--seeds"),
    (("--cells", "3bw-muon"), "3bw"),
    (("--cells", "1f1b-muon,2bw-foo"), "optimizer.name"),
    (("--cells", "2bw-muon"), "--reference"),
    (("--cells", "1f1b-muon,1f1b-muon"), "--cells"),
    (("--overrun", "0.5"), "--overrun"),
    (("--steps", "15"), "--steps"),
    (("--cores", "0,0"), "--cores"),
    (("--lr", "mon=0.1"), "--lr"),
    (("run.steps=5",), "run.steps"),
    (("--report",), "--report"),
    (("--target", "x"), "--target"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, named):
  _one_line_error(_cli("--out", str(tmp_path / "out"), *args), named)
  assert not os.path.exists(tmp_path / "out" / "time_to_loss.json")


def test_planner_prints_the_projection_from_a_measurement(tmp_path):
  out = str(tmp_path / "out")
  path = _result_json(out, RUNS)
  assert tool.main(["--out", out, "--report"]) == 0
  p = _cli("--config", "configs/smollm-360m.yaml", "--time-to-loss", "--ttl-json", path,
           "--json", script=PLANNER)
  assert p.returncode == 0, p.stderr
  got = json.loads(p.stdout)["time_to_loss"]
  assert got["target"] == pytest.approx(2.9) and got["reference"] == "1f1b-muon"
  row = {(r["stages"], r["microbatches"], r["cell"]): r for r in got["rows"]}
  assert {s for s, _, _ in row} == {2, 4, 8, 16}
  # The config's own S=4, M=32: 2bw's 32 units against 1F1B's 35.
  assert row[4, 32, "2bw-muon"]["vs_reference"] == pytest.approx(1.3 * 32 / 35)
  assert row[16, 16, "2bw-muon"]["vs_reference"] is None  # M < 2(S-1)
  text = _cli("--config", "configs/smollm-360m.yaml", "--ttl-json", path, script=PLANNER)
  assert text.returncode == 0 and "| 2bw-muon | 1.300 |" in text.stdout, text.stdout
  missing = _cli("--config", "configs/smollm-360m.yaml", "--time-to-loss", "--ttl-json",
                 str(tmp_path / "none.json"), script=PLANNER)
  _one_line_error(missing, "tools/time_to_loss.py")


# --- a tiny study, end to end -----------------------------------------------------------


# The benchmark tools end to end (train.py in pinned processes): not in the
# default run; `.venv/bin/python -m pytest -m slow` runs it.
@pytest.mark.slow
def test_tiny_study_end_to_end(tmp_path):
  """Two cells of the tiny model, one seed, 10 steps: JSON, report, resume, planner."""
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < 2:
    pytest.skip("the two-core measurement needs two cores")
  out, cache = str(tmp_path / "out"), str(tmp_path / "cache")
  argv = ("--config", _runs.TINY, "--out", out, "--cells", "1f1b-muon,2bw-muon", "--seeds", "1",
          "--steps", "6", "--eval-every", "2", "--overrun", "1.5", "--microbatches", "2",
          "--cores", f"{cores[0]},{cores[1]}")
  p = _cli(*argv, cache=cache, timeout=300)
  assert p.returncode == 0, p.stdout + p.stderr
  path = os.path.join(out, "time_to_loss.json")
  with open(path) as f:
    result = json.load(f)
  assert sorted(result["runs"]) == ["1f1b-muon-s0", "2bw-muon-s0"]
  for name, run in result["runs"].items():
    assert len(run["step_time_s"]) == 10 and all(t > 0 for t in run["step_time_s"])
    assert [s for s, _ in run["val"]] == [0, 2, 4, 6, 8, 10]
    assert run["val"] == [[s, v] for s, v in sorted(
        runs_lib.losses(os.path.join(out, name), "val_loss").items())]
  ref = dict(result["runs"]["1f1b-muon-s0"]["val"])
  assert result["summary"]["target"] == ref[6]
  # The reference's loss falls at every evaluation, so it first reaches its own step-6 loss there.
  if all(a > b for a, b in zip(list(ref.values()), list(ref.values())[1:])):
    assert result["summary"]["cells"]["1f1b-muon"]["mean_curve"]["steps"] == 6.0
  assert all(math.isfinite(r["step_s"]) for r in result["summary"]["cells"].values())
  # Rerun: both runs are kept, nothing trains again.
  metrics = os.path.join(out, "1f1b-muon-s0", runs_lib.METRICS)
  before = os.stat(metrics).st_mtime_ns
  again = _cli(*argv, cache=cache, timeout=120)
  assert again.returncode == 0 and "2 done already, 0 to train" in again.stdout, again.stdout
  assert os.stat(metrics).st_mtime_ns == before
  with open(path) as f:
    assert json.load(f)["summary"] == result["summary"]
  assert _cli("--out", out, "--report").returncode == 0
  with open(path) as f:
    assert json.load(f)["summary"] == result["summary"]
