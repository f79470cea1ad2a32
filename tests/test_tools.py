"""Tests of tools/: the schedule visualiser, the pipeline benchmark, the planner.

Small settings only (S=2 pictures, a two-microbatch benchmark of a tiny model,
plans without compilation). Expected bubbles and weight bytes are written out
here from the formulas and the model's shapes, not taken from the tools.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest

from tests._runs import ROOT

TOOLS = os.path.join(ROOT, "tools")
CONFIGS = os.path.join(ROOT, "configs")


def _load(name: str):
  """Imports tools/<name>.py as a module (tools/ is not a package)."""
  spec = importlib.util.spec_from_file_location(f"_tool_{name}", os.path.join(TOOLS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def _tool(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, os.path.join(TOOLS, f"{name}.py"), *args],
                        capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _expected_bubble(schedule: str, s: int, m: int) -> float:
  """The steady-state bubble of docs/schedules.md, written out."""
  if s == 1 or schedule in ("none", "2bw"):
    return 0.0
  if schedule == "gpipe":
    return (s - 1) / (m + s - 1)
  return 2 * (s - 1) / (m + 2 * (s - 1))  # 1f1b, pipedream: lockstep, flushed


def _idle_share(tt, step: int) -> float:
  """Idle share of one step, counted cell by cell (a gpipe tick offers one slot)."""
  rows = tt.cells[step * tt.ticks_per_step:(step + 1) * tt.ticks_per_step]
  slots = 1 if tt.schedule == "gpipe" else 2
  busy = sum((c.fwd is not None) + (c.bwd is not None) for row in rows for c in row)
  return 1.0 - busy / (slots * len(rows) * tt.num_stages)


def _one_line_error(p: subprocess.CompletedProcess) -> None:
  assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1, p.stderr
  assert "Traceback" not in p.stderr


# --- schedule_viz --------------------------------------------------------------


def _check_viz_output(stdout: str, m: int) -> None:
  """The printed tables are the engine's and the printed bubbles match the formulas and cells."""
  from jaxpipe.pipeline import bubble_fraction, timetable
  printed = {name: (float(a), float(b)) for name, a, b in re.findall(
      r"^bubble (\S+): steady ([0-9.]+) \(formula ([0-9.]+)\)$", stdout, re.M)}
  assert set(printed) == {"2bw", "1f1b", "gpipe", "pipedream"}
  for name, (counted, formula) in printed.items():
    tt = timetable(name, 2, m, 2)
    assert tt.ascii() in stdout  # the terminal table is the engine's own
    want = _expected_bubble(name, 2, m)
    assert counted == pytest.approx(want, abs=5e-5)
    assert formula == pytest.approx(bubble_fraction(name, 2, m), abs=5e-5)
    assert counted == pytest.approx(_idle_share(tt, 1), abs=5e-5)
  [fill] = re.findall(r"^fill 2bw: first step ([0-9.]+)$", stdout, re.M)
  # 2bw's first step: stage s idles s forward and 2(S-1)-s backward slots,
  # S * 2(S-1) of 2MS slots in all: (S-1)/M.
  assert float(fill) == pytest.approx(1 / m, abs=5e-5)
  assert float(fill) == pytest.approx(_idle_share(timetable("2bw", 2, m, 2), 0), abs=5e-5)


def test_viz_draws_s2_and_prints_the_engine_bubbles(tmp_path):
  """The command line, from a fresh process: PNG plus tables for S=2, M=3."""
  out = tmp_path / "s2.png"
  p = _tool("schedule_viz", "--schedule", "all", "--stages", "2", "--microbatches", "3",
            "--out", str(out))
  assert p.returncode == 0, p.stderr
  with open(out, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert out.stat().st_size > 10_000
  _check_viz_output(p.stdout, 3)


@pytest.mark.parametrize("m", [2, 4, 5])
def test_viz_bubbles_for_other_m(capsys, m):
  viz = _load("schedule_viz")
  assert viz.main(["--schedule", "all", "--stages", "2", "--microbatches", str(m)]) == 0
  _check_viz_output(capsys.readouterr().out, m)


def test_viz_bad_input_from_the_command_line():
  _one_line_error(_tool("schedule_viz", "--schedule", "2bw", "--stages", "4",
                        "--microbatches", "2"))  # M < 2(S-1)


@pytest.mark.parametrize("args", [
    ("--schedule", "zb-h1", "--stages", "2", "--microbatches", "4"),
    ("--schedule", "gpipe", "--stages", "0", "--microbatches", "4"),
    ("--schedule", "gpipe", "--stages", "two", "--microbatches", "4"),
    ("--schedule", "gpipe", "--stages", "2", "--microbatches", "4", "--steps", "0"),
])
def test_viz_bad_input_is_one_line_and_status_2(capsys, args):
  viz = _load("schedule_viz")
  try:
    code = viz.main(list(args))
  except SystemExit as e:  # argparse's own errors
    code = e.code
  assert code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "Traceback" not in err[0]


# --- bench_pipeline --------------------------------------------------------------


def test_bench_bubbles_come_from_the_same_timetable():
  bench, viz = _load("bench_pipeline"), _load("schedule_viz")
  from jaxpipe.pipeline import bubble_fraction, timetable
  for s, m in [(2, 2), (2, 4), (4, 6), (4, 8), (4, 16)]:
    for name in ("gpipe", "1f1b", "2bw", "pipedream"):
      got = bench.bubble(name, s, m)
      assert got == viz.steady_bubble(name, s, m)
      assert got == _idle_share(timetable(name, s, m, 2), 1)
      assert got == pytest.approx(bubble_fraction(name, s, m), abs=1e-12)
      assert got == pytest.approx(_expected_bubble(name, s, m), abs=1e-12)
  assert bench.bubble("2bw", 4, 4) is None  # refused: M < 2(S-1)


def test_bench_tiny_run_times_every_schedule():
  """S=2, M=2, a tiny model, one timed step: every schedule, finite times, memory, targets."""
  bench = _load("bench_pipeline")
  shape = bench.ModelShape(dim=32, layers=2, heads=2, kv_heads=1, seq_len=16, micro_rows=2)
  rows = bench.measure(shape, 2, 2, warmup=1, repeats=1, log=lambda _: None)
  assert [r["schedule"] for r in rows] == ["none", "gpipe", "1f1b", "2bw", "pipedream"]
  for r in rows:
    assert math.isfinite(r["step_s"]) and r["step_s"] > 0, r
    assert math.isfinite(r["cpu_s"]) and r["cpu_s"] > 0, r
    assert r["compile_s"] > 0
    mem = r["memory"]
    assert mem["argument"] > 0 and mem["temp"] >= 0 and mem["resident"] > 0
  # 2bw keeps two weight versions and the pipeline's in-flight state.
  by = {r["schedule"]: r for r in rows}
  assert by["2bw"]["memory"]["argument"] > by["1f1b"]["memory"]["argument"]
  table = bench.step_table(rows)
  for name in by:
    assert re.search(rf"^\| {name} \| .*\| [0-9.]+ \|", table, re.M), table
  assert "| none |" in bench.memory_table(rows)
  fake_compile = [{"microbatches": 2, "compile_s": 1.0, "compile_cpu_s": 2.0},
                  {"microbatches": 8, "compile_s": 1.5, "compile_cpu_s": 2.2}]
  result = bench.targets(rows, fake_compile)
  assert [t["status"] in ("PASS", "MISS") for t in result] == [True] * 4
  assert result[-1]["wall"] == pytest.approx(1.5) and result[-1]["status"] == "MISS"
  assert result[-1]["cpu"] == pytest.approx(1.1) and result[-1]["cpu_status"] == "PASS"
  two_over_gpipe = by["2bw"]["step_s"] / by["gpipe"]["step_s"]
  assert result[0]["wall"] == pytest.approx(two_over_gpipe)
  assert "PASS" in bench.target_table(result)


@pytest.mark.parametrize("args", [
    ("--stages", "4", "--microbatches", "4"),      # 2bw needs M >= 6
    ("--stages", "3", "--layers", "8"),            # layers not divisible by stages
    ("--repeats", "0",),
    ("--compile-m", "8,x"),
])
def test_bench_bad_input_is_one_line_and_status_2(args):
  _one_line_error(_tool("bench_pipeline", *args))


# --- planner -------------------------------------------------------------------


def _block_params(dim: int, heads: int, kv_heads: int, ffn: int) -> int:
  """Parameters of one Llama block: attention, SwiGLU MLP, two RMSNorm scales."""
  head_dim = dim // heads
  attn = 2 * dim * dim + 2 * dim * kv_heads * head_dim  # q, o; k, v
  return attn + 3 * dim * ffn + 2 * dim


def test_planner_tiny_matches_hand_computation():
  planner = _load("planner")
  from jaxpipe import config as config_lib
  cfg = config_lib.load(os.path.join(CONFIGS, "tiny.yaml"),
                        ["pipeline.schedule=gpipe", "pipeline.stages=4", "pipeline.microbatches=2"])
  p = planner.plan(cfg)
  # tiny: width 32, 4 blocks, 4 heads / 2 kv, SwiGLU 96 (8/3 * 32 rounded up
  # to 32), byte vocabulary 257, untied head; float32.
  block = _block_params(32, 4, 2, 96)
  shared = 257 * 32 + 32 * 257 + 32  # embedding, output kernel, final norm
  stage = 4 // 4 * block + shared     # one block per stage; shared replicated
  assert p.stage_params == stage
  for name, versions in (("gpipe", 1), ("1f1b", 1), ("pipedream", 4)):
    assert p.bytes[name]["weights"] == stage * versions * 4, name
    assert p.bytes[name]["grads"] == stage * 4
  assert p.bytes["none"]["weights"] == (4 * block + shared) * 4
  assert p.bytes["2bw"] is None and p.bubble["2bw"] is None  # M=2 < 2(S-1)=6
  assert any("2bw needs pipeline.microbatches >= 2(S-1) = 6" in w for w in p.warnings)
  # Stage input of one microbatch: 4 rows x 32 tokens x 32 float32.
  x = 4 * 32 * 32 * 4
  assert p.bytes["gpipe"]["stash"] == (2 + 4 - 1 + 1) * x
  assert p.bytes["1f1b"]["stash"] == (2 * 3 + 1 + 2) * x
  assert p.bubble["gpipe"] == pytest.approx(3 / 5)
  assert p.bubble["1f1b"] == pytest.approx(6 / 8)


def test_planner_smollm_360m_matches_hand_computation():
  planner = _load("planner")
  from jaxpipe import config as config_lib
  cfg = config_lib.load(os.path.join(CONFIGS, "smollm-360m.yaml"))
  p = planner.plan(cfg, device_gib=80)
  # 32 blocks of width 960, 15 / 5 heads, SwiGLU 2560, tied GPT-2 embedding
  # (50257 x 960), final norm; 4 stages of 8 blocks; float32 master weights.
  block = _block_params(960, 15, 5, 2560)
  shared = 50257 * 960 + 960
  assert p.num_params == 32 * block + shared
  stage = 8 * block + shared
  assert p.stage_params == stage
  assert p.bytes["2bw"]["weights"] == stage * 2 * 4
  assert p.bytes["pipedream"]["weights"] == stage * 4 * 4
  assert p.bytes["gpipe"]["weights"] == stage * 4
  assert p.bytes["2bw"]["grads"] == stage * 2 * 4
  assert p.bytes["2bw"]["ef"] == stage * 4  # error feedback: one parameter-sized buffer
  # 2bw's ring: 2(S-1)+1 = 7 stage inputs plus 2 in transit, [16, 2048, 960] bf16.
  assert p.bytes["2bw"]["stash"] == 9 * 16 * 2048 * 960 * 2
  assert p.bubble["2bw"] == 0.0 and p.bubble["gpipe"] == pytest.approx(3 / 19)
  # A warning for exactly the schedules whose total exceeds the device.
  for name in ("none", "gpipe", "1f1b", "2bw", "pipedream"):
    over = p.total(name) > 80 * 2 ** 30
    assert over == any(w.startswith(name + " ") and "GiB per device" in w
                       for w in p.warnings), name
  tight = planner.plan(cfg, device_gib=1)
  assert any(w.startswith("2bw (the config's schedule) needs") for w in tight.warnings)


def test_planner_cli_prints_the_table_and_warns(tmp_path):
  p = _tool("planner", "--config", os.path.join(CONFIGS, "tiny.yaml"), "pipeline.schedule=1f1b",
            "pipeline.stages=4", "pipeline.microbatches=4")
  assert p.returncode == 0, p.stderr
  stage = _block_params(32, 4, 2, 96) + 257 * 32 * 2 + 32
  weights = re.search(r"^weights \(x versions\)\s+(.*)$", p.stdout, re.M).group(1).split("  ")
  weights = [w.strip() for w in weights if w.strip()]
  assert weights[1] == f"{stage * 4 / 1024:.3g} KiB"  # gpipe column, one version
  assert re.search(r"^steady-state bubble\s+0\.0%\s+42\.9%\s+60\.0%\s+n/a\s+60\.0%$",
                   p.stdout, re.M), p.stdout
  assert "warning: 2bw needs pipeline.microbatches >= 2(S-1) = 6" in p.stdout
  assert "warning: gpipe idles 43%" in p.stdout


@pytest.mark.parametrize("args", [
    ("--config", os.path.join(CONFIGS, "missing.yaml")),
    ("--config", os.path.join(CONFIGS, "tiny.yaml"), "pipeline.stagez=2"),
    ("--config", os.path.join(CONFIGS, "tiny.yaml"), "pipeline.schedule=2bw",
     "pipeline.stages=4", "pipeline.microbatches=2"),
    ("--config", os.path.join(CONFIGS, "tiny.yaml"), "--device-gib", "-1"),
    ("--config", os.path.join(CONFIGS, "tiny.yaml"), "model.vocab_size=100"),  # < 257 bytes
])
def test_planner_bad_input_is_one_line_and_status_2(args):
  _one_line_error(_tool("planner", *args))
