"""Tests of tools/: the schedule visualiser, the pipeline benchmark, the planner.

Small settings only (S=2 pictures, a two-microbatch benchmark of a tiny model,
plans without compilation). Expected bubbles and weight bytes are written out
here from the formulas and the model's shapes, not taken from the tools.
"""

from __future__ import annotations

import importlib.util
import math
import json
import dataclasses
import os
import re
import subprocess
import sys

import pytest

from tests._runs import ROOT

TOOLS = os.path.join(ROOT, "tools")
CONFIGS = os.path.join(ROOT, "configs")


def _path(name: str) -> str:
  """tools/<name>.py, or tools/cpu/<name>.py for the CPU benchmarks."""
  cpu = os.path.join(TOOLS, "cpu", f"{name}.py")
  return cpu if os.path.exists(cpu) else os.path.join(TOOLS, f"{name}.py")


def _load(name: str):
  """Imports a tool (`_path`) as a module, by its file."""
  spec = importlib.util.spec_from_file_location(f"_tool_{name}", _path(name))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def _tool(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, _path(name), *args],
                        capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _expected_bubble(schedule: str, s: int, m: int) -> float:
  """The steady-state bubble of docs/schedules.md, written out.

  gpipe, 1f1b and pipedream all take 3(M+S-1) per step (forward 1, backward
  2, a tick as long as its slowest stage) of which each stage is busy 3M;
  2bw's steady step has no idle slot.
  """
  if s == 1 or schedule in ("none", "2bw"):
    return 0.0
  return (s - 1) / (m + s - 1)


def _tick_cost(schedule: str, s: int, m: int, t: int) -> int:
  """Duration of tick t of a step: 1 forward-only, 2 backward-only, 3 both.

  gpipe: M+S-1 forward-only ticks, then M+S-1 backward-only; 1f1b and
  pipedream: S-1 forward-only, M with both, S-1 backward-only; 2bw: every
  tick has both (its first step too: the engine masks the missing batch).
  """
  if schedule == "2bw":
    return 3
  if schedule == "gpipe":
    return 1 if t < m + s - 1 else 2
  return 1 if t < s - 1 else 2 if t >= m + s - 1 else 3


def _idle_share(tt, step: int) -> float:
  """Idle share of one step's stage time, counted cell by cell (forward 1, backward 2)."""
  n = tt.ticks_per_step
  rows = tt.cells[step * n:(step + 1) * n]
  busy = sum((c.fwd is not None) + 2 * (c.bwd is not None) for row in rows for c in row)
  duration = sum(_tick_cost(tt.schedule, tt.num_stages, tt.num_microbatches, t) for t in range(n))
  return 1.0 - busy / (duration * tt.num_stages)


def _fill_share(s: int, m: int) -> float:
  """2bw's first-step idle share: 7(S-1)/(6M).

  Each of the M ticks lasts 3; stage s idles s forwards (1 each) and
  2(S-1)-s backwards (2 each), 4(S-1)-s in all, so the stages idle
  7S(S-1)/2 of 3MS.
  """
  return 7 * (s - 1) / (6 * m)


def _one_line_error(p: subprocess.CompletedProcess) -> None:
  assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1, p.stderr
  assert "Traceback" not in p.stderr


# --- schedule_viz --------------------------------------------------------------


def _check_viz_output(stdout: str, m: int) -> None:
  """The printed tables are the engine's and the printed bubbles match the formulas and cells.

  Interleaved (v=2 by default) is drawn where M is a multiple of S=2, and
  left out with a note elsewhere; its bubble is (S-1)/(vM+S-1).
  """
  from jaxpipe.pipeline import facts, timetable
  printed = {name: (float(a), float(b)) for name, a, b in re.findall(
      r"^bubble (\S+): steady ([0-9.]+) \(formula ([0-9.]+)\)$", stdout, re.M)}
  interleaved = printed.pop("interleaved", None)
  zb1 = printed.pop("zb1")
  assert set(printed) == {"2bw", "1f1b", "gpipe", "pipedream"}
  # zb1 at S=2: ZB-H1's 3M+S-1 units (F, B, W one each), each stage busy 3M
  # of them, on 1F1B's M+2(S-1) ticks.
  tt = timetable("zb1", 2, m, 2)
  assert tt.ascii() in stdout and "W0" in tt.ascii()
  assert zb1[0] == pytest.approx(1 / (3 * m + 1), abs=5e-5)
  assert zb1[1] == pytest.approx(facts("zb1", 2, m).bubble, abs=5e-5)
  assert zb1[0] == pytest.approx(tt.idle_fraction(1), abs=5e-5)
  if m % 2:
    assert interleaved is None and "interleaved left out" in stdout
  else:
    tt = timetable("interleaved", 2, m, 2, virtual_stages=2)
    assert tt.ascii() in stdout
    assert interleaved[0] == pytest.approx(1 / (2 * m + 1), abs=5e-5)
    assert interleaved[1] == pytest.approx(facts("interleaved", 2, m, 2).bubble, abs=5e-5)
    assert interleaved[0] == pytest.approx(tt.idle_fraction(1), abs=5e-5)
  for name, (counted, formula) in printed.items():
    tt = timetable(name, 2, m, 2)
    assert tt.ascii() in stdout  # the terminal table is the engine's own
    want = _expected_bubble(name, 2, m)
    assert counted == pytest.approx(want, abs=5e-5)
    assert formula == pytest.approx(want, abs=5e-5)
    assert formula == pytest.approx(facts(name, 2, m).bubble, abs=5e-5)
    assert counted == pytest.approx(_idle_share(tt, 1), abs=5e-5)
  [fill] = re.findall(r"^fill 2bw: first step ([0-9.]+)$", stdout, re.M)
  # S=2: stage 0 idles 2 backwards (4), stage 1 one forward and one
  # backward (3), of 3M each: 7/(6M).
  assert float(fill) == pytest.approx(7 / (6 * m), abs=5e-5)
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
  from jaxpipe.pipeline import facts, timetable
  for s, m in [(2, 2), (2, 4), (4, 6), (4, 8), (4, 16)]:
    for name in ("gpipe", "1f1b", "2bw", "pipedream"):
      got = bench.bubble(name, s, m)
      assert got == pytest.approx(viz.steady_bubble(name, s, m), abs=1e-12)
      assert got == pytest.approx(_idle_share(timetable(name, s, m, 2), 1), abs=1e-12)
      assert got == facts(name, s, m).bubble
      assert got == pytest.approx(_expected_bubble(name, s, m), abs=1e-12)
      # Step length in forward+backward pairs: M for 2bw, M+S-1 for the rest.
      assert bench.ticks(name, s, m) == (m if name == "2bw" else m + s - 1)
    assert bench.bubble("none", s, m) == 0.0
    assert bench.ticks("none", s, m) == m * s  # the whole model on one device
    # 2bw's fill, as the visualiser prints it.
    assert viz.fill_fraction(s, m) == pytest.approx(_fill_share(s, m), abs=1e-12)
  assert bench.bubble("2bw", 4, 4) is None  # refused: M < 2(S-1)
  assert math.isnan(bench.ticks("2bw", 4, 4))


# The benchmark tools end to end (compiling and timing in pinned processes):
# not in the default run, which must stay under 15 minutes on 2 cores;
# `.venv/bin/python -m pytest -m slow` runs them.
@pytest.mark.slow
def test_bench_tiny_run_times_every_schedule():
  """S=2, M=2, a tiny model, one timed step: three schedules, finite times, memory, targets.

  (gpipe and pipedream run through the same Runner; leaving them out halves
  the compiles.)
  """
  bench = _load("bench_pipeline")
  shape = bench.ModelShape(dim=32, layers=2, heads=2, kv_heads=1, seq_len=16, micro_rows=2)
  rows = bench.measure(shape, 2, 2, warmup=1, repeats=1, schedules=("none", "1f1b", "2bw"),
                       account=2, log=lambda _: None)
  assert [r["schedule"] for r in rows] == ["none", "1f1b", "2bw"]
  # 2bw's ticks are all full: M(S-1) activations forward, as many cotangents back.
  sent = rows[2]["account"]["transfers"]
  activation = 2 * 16 * 32 * 4
  assert sum(sent[d]["collective-permute"]["bytes"] for d in (0, 1)) == 2 * 2 * activation
  # Device 0 sends two activations of 4 KiB: the transfers table's cell, not the time table's.
  assert re.search(r"^\| 2bw \| 0 \| .*\| 2 / 8\.0 \|$",
                   bench.account_tables({"2bw": rows[2]["account"]}), re.M)
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
  # gpipe is not in the rows: its target is left out, the others stay.
  assert [t["target"] for t in result] == ["2bw step / 1f1b step", "2bw step / one-device step",
                                           "2bw compile M=8 / M=2"]
  assert [t["status"] in ("PASS", "MISS") for t in result] == [True] * 3
  assert result[-1]["wall"] == pytest.approx(1.5) and result[-1]["status"] == "MISS"
  assert result[-1]["cpu"] == pytest.approx(1.1) and result[-1]["cpu_status"] == "PASS"
  two_over_1f1b = by["2bw"]["step_s"] / by["1f1b"]["step_s"]
  assert result[0]["wall"] == pytest.approx(two_over_1f1b)
  assert "PASS" in bench.target_table(result)


# The benchmark tools end to end (compiling and timing in pinned processes):
# not in the default run, which must stay under 15 minutes on 2 cores;
# `.venv/bin/python -m pytest -m slow` runs them.
@pytest.mark.slow
def test_bench_two_core_times_pinned_processes():
  """Tiny model, 3 rounds of 2 steps in a row: the reference, the ceiling and 2bw each pinned."""
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < 2:
    pytest.skip("the two-core measurement needs two cores")
  bench, two_core = _load("bench_pipeline"), _load("bench_two_core")
  shape = bench.ModelShape(dim=32, layers=2, heads=2, kv_heads=1, seq_len=16, micro_rows=2)
  rows, accounts = two_core.two_core(shape, [257], 2, pairs=3, warmup=1,
                                     cores=(str(cores[0]), str(cores[1])), schedules=("2bw",),
                                     processes=("2bw",), account_steps=2, settle_s=0,
                                     xla_flags="--xla_cpu_experimental_ynn_fusion_type=",
                                     compare_flags="--xla_cpu_enable_concurrency_optimized_scheduler=true",
                                     compare_env={"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"},
                                     back_to_back=2, log=lambda _: None)
  assert [r["schedule"] for r in rows] == ["none", "ceiling", "2bw", "none [B]", "ceiling [B]",
                                           "2bw [B]", "2bw x2", "2bw x2 [B]", "hardware"]
  x2_b = rows.pop(7)
  assert x2_b["target"] is None and x2_b["ref"] == rows[3]["times"] and x2_b["bound"] == 2.0
  reference = rows.pop(0)
  assert reference["speedup"] == 1.0 and reference["target"] is None
  assert reference["bound"] == 1.0 and reference["faults"] >= 0
  none_b, ceiling_b, compared = rows.pop(2), rows.pop(2), rows.pop(2)
  for r in (none_b, ceiling_b, compared):
    assert r["target"] is None and len(r["times"]) == 3
  assert (none_b["bound"], ceiling_b["bound"], compared["bound"]) == (1.0, 2.0, 2.0)
  # [B] rows are against the reference run with B, whose own row is against the plain one.
  assert compared["ref"] == none_b["times"] and none_b["ref"] == rows[0]["ref"]
  assert compared["ceiling"] == ceiling_b["speedup"]
  assert all(r["faults"] >= 0 for r in rows[:3]) and rows[3]["faults"] is None
  for r in rows:
    assert len(r["times"]) == len(r["ref"]) == 3 and min(r["times"]) > 0
    assert r["low"] <= r["q1"] <= r["speedup"] <= r["q3"] <= r["high"]
    assert r["bound"] == 2.0  # 2bw has no bubble; the ceiling and the hardware, the ideal
  two = rows[1]
  ratios = sorted(a / b for a, b in zip(two["ref"], two["times"]))
  assert two["speedup"] == pytest.approx(ratios[1])
  ceiling = rows[0]["speedup"]
  # 1.85x, or 0.95 of a ceiling below 1.9x.
  assert two["target"] == pytest.approx(1.85 if ceiling >= 1.9 else min(1.85, 0.95 * ceiling))
  table = two_core.two_core_table(rows)
  assert re.search(rf"^\| 257 \| 2bw \| .*\| >= {two['target']:.2f}x (PASS|MISS) \|",
                   table, re.M), table
  assert "ceiling (2 devices of one process, no collective)" in table
  assert "hardware (2 one-device processes at once)" in table
  # The hardware row: twice the reference alone over the slower of two at once.
  hw = rows[3]
  assert hw["speedup"] == pytest.approx(
      2 * sorted(a / b for a, b in zip(hw["ref"], hw["times"]))[1])


def test_two_core_rows_give_each_set_of_processes_its_median():
  """Rounds split among sets of processes: each row pools them and gives each set's median."""
  two_core = _load("bench_two_core")
  names = ["none", "ceiling", "2bw", "hardware"]
  times = {"none": [1.0] * 6, "ceiling": [1.0] * 6, "hardware": [1.0] * 6,
           "2bw": [0.5, 0.5, 0.5, 0.6, 0.6, 0.6]}
  faults = {n: [0] * 6 for n in names[:3]}
  rows = {r["schedule"]: r for r in two_core._rows(257, names, times, faults, 8, "1/1/1", [3, 3])}
  assert rows["2bw"]["per_instance"] == pytest.approx([2.0, 1 / 0.6])
  # The pooled median is over all six rounds.
  assert rows["2bw"]["speedup"] == pytest.approx((2.0 + 1 / 0.6) / 2)
  assert rows["ceiling"]["per_instance"] == pytest.approx([2.0, 2.0])
  table = two_core.two_core_table(list(rows.values()))
  assert "median of each set of processes" in table
  assert re.search(r"^\| 257 \| 2bw \| .*\| 2\.00x / 1\.67x \|", table, re.M), table
  one = two_core._rows(257, names, times, faults, 8, "1/1/1", [6])
  assert all(r["per_instance"] == [] for r in one)
  assert "each set" not in two_core.two_core_table(one)


def test_two_core_workers_take_the_extra_xla_flags():
  """`--xla-flags` reaches every pinned worker's XLA_FLAGS and wins over the defaults."""
  two_core = _load("bench_two_core")
  from jaxpipe import accel  # pylint: disable=g-import-not-at-top
  flags = two_core.worker_xla_flags(2, "--xla_cpu_experimental_ynn_fusion_type=")
  assert flags.split() == ["--xla_cpu_experimental_ynn_fusion_type=",
                           "--xla_cpu_multi_thread_eigen=false",
                           "--xla_force_host_platform_device_count=2", *accel.cpu_xla_flags()]
  assert two_core.worker_xla_flags(1).split() == [
      "--xla_cpu_multi_thread_eigen=false", "--xla_force_host_platform_device_count=1",
      *accel.cpu_xla_flags()]
  # A flag given with --xla-flags replaces the default one.
  mine = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
  assert two_core.worker_xla_flags(2, mine).split().count(mine) == 1
  assert not set(accel.cpu_xla_flags()) & set(two_core.worker_xla_flags(2, mine).split())
  # A jax.distributed worker gets what train.py gives a run of several processes: none.
  assert not set(accel.cpu_xla_flags()) & set(
      two_core.worker_xla_flags(1, distributed=True).split())
  args = _load("bench_pipeline")._parser().parse_args(
      ["--two-core", "--xla-flags=--xla_cpu_experimental_ynn_fusion_type="])
  assert args.xla_flags == "--xla_cpu_experimental_ynn_fusion_type="


@pytest.mark.parametrize("args", [
    ("--two-core", "--cores", "0"),
    ("--two-core", "--cores", "0,0"),
    ("--two-core", "--pairs", "2"),
    ("--two-core", "--sweep"),
    ("--two-core", "--vocab", "100"),
    ("--two-core", "--layers", "3"),
    ("--two-core", "--xla-flags=-O3"),
    ("--two-core", "--compare-xla-flags", "O3"),
    ("--two-core", "--compare-env", "1BAD=x"),
    ("--two-core", "--compare-env", "NOVALUE"),
    ("--two-core", "--back-to-back", "0"),
    ("--two-core", "--instances", "0"),
    ("--two-core", "--pairs", "8", "--instances", "3"),   # fewer than 3 rounds a set
    ("--instances", "2",),                                # without --two-core
])
def test_bench_two_core_bad_input_is_one_line_and_status_2(args):
  _one_line_error(_tool("bench_pipeline", *args))


@pytest.mark.parametrize("args", [("--sizes", "x"), ("--sizes", "0"), ("--calls", "1"),
                                  ("--warmup", "-1")])
def test_bench_malloc_bad_input_is_one_line_and_status_2(args):
  _one_line_error(_tool("bench_malloc", *args))


@pytest.mark.parametrize("args", [
    ("--stages", "4", "--microbatches", "4"),      # 2bw needs M >= 6
    ("--stages", "3", "--layers", "8"),            # layers not divisible by stages
    ("--repeats", "0",),
    ("--compile-m", "8,x"),
    ("--account", "1"),                            # the first traced step has no gap
    ("--sweep", "--account", "2"),
])
def test_bench_bad_input_is_one_line_and_status_2(args):
  _one_line_error(_tool("bench_pipeline", *args))


# --- planner -------------------------------------------------------------------


def _block_params(dim: int, heads: int, kv_heads: int, ffn: int) -> int:
  """Parameters of one Llama block: attention, SwiGLU MLP, two RMSNorm scales."""
  head_dim = dim // heads
  attn = 2 * dim * dim + 2 * dim * kv_heads * head_dim  # q, o; k, v
  return attn + 3 * dim * ffn + 2 * dim


def _tiny_stage(blocks: int, stages: int) -> int:
  """Parameters one device holds of configs/tiny.yaml: its blocks, 1/S of the padded vocabulary."""
  vocab = -(-257 // stages) * stages             # 257 bytes, padded to a multiple of S
  return blocks * _block_params(32, 4, 2, 96) + vocab // stages * 32 * 2 + 32


def test_planner_tiny_matches_hand_computation():
  from jaxpipe.cli import planner  # pylint: disable=g-import-not-at-top
  from jaxpipe import config as config_lib
  from jaxpipe.pipeline import facts
  cfg = config_lib.load(os.path.join(CONFIGS, "tiny.yaml"),
                        ["pipeline.schedule=gpipe", "pipeline.stages=4", "pipeline.microbatches=2"])
  p = planner.plan(cfg)
  # tiny: width 32, 4 blocks, 4 heads / 2 kv, SwiGLU 96, byte vocabulary 257
  # padded to 260 and split over the stages (65 embedding rows and output
  # columns per device), untied head, final norm; float32.
  stage = _tiny_stage(1, 4)
  assert p.stage_params == stage == 12352 + 65 * 64 + 32
  assert p.num_params == 4 * _block_params(32, 4, 2, 96) + 257 * 64 + 32
  for name, versions in (("gpipe", 1), ("1f1b", 1), ("pipedream", 4)):
    for stash in ("inputs", "residuals"):
      row = p.bytes[name][stash]
      assert row["weights"] == stage * versions * 4, (name, stash)
      assert row["grads"] == stage * 4 and row["update"] == stage * 4
  # `none`: the whole model on one device, its vocabulary unpadded.
  assert p.bytes["none"]["inputs"]["weights"] == p.num_params * 4
  assert p.bytes["2bw"] == {"inputs": None, "residuals": None}  # M=2 < 2(S-1)=6
  assert p.bubble["2bw"] is None
  assert any("2bw needs pipeline.microbatches >= 2(S-1) = 6" in w for w in p.warnings)
  # The flushed ring: the engine's slots (plus a scratch slot for empty
  # forwards), each a stage input of 4 rows x 32 tokens x 32 float32 and a
  # 4-byte loss term; gpipe also keeps the head's cotangent per microbatch.
  x = 4 * 32 * 32 * 4
  assert p.bytes["gpipe"]["inputs"]["stash"] == (facts("gpipe", 4, 2).stash_slots + 1) * (2 * x + 4)
  assert p.bytes["1f1b"]["inputs"]["stash"] == (facts("1f1b", 4, 2).stash_slots + 1) * (x + 4)
  assert p.bytes["1f1b"]["residuals"]["stash"] > p.bytes["1f1b"]["inputs"]["stash"]
  for name in ("gpipe", "1f1b", "pipedream"):
    assert p.bubble[name] == pytest.approx(3 / 5)  # (S-1)/(M+S-1)
  # Work per tick: the vocabulary-parallel head and even blocks make every
  # stage's tick the same; residuals skip the recomputed forward (3 units of
  # a block's work instead of 4, the head unchanged).
  for stash in ("inputs", "residuals"):
    assert len(p.work[stash]) == 4 and p.balance(stash) == pytest.approx(1.0, abs=1e-9)
  assert 0.70 < p.work["residuals"][0] / p.work["inputs"][0] < 0.80


def test_planner_head_counts_the_loss_chunk():
  """model.loss_chunk=N: the head's working set holds N tokens' logits, not a microbatch's."""
  from jaxpipe.cli import planner  # pylint: disable=g-import-not-at-top
  from jaxpipe import config as config_lib
  base = ["pipeline.schedule=gpipe", "pipeline.stages=4", "pipeline.microbatches=2"]
  load = lambda *extra: planner.plan(config_lib.load(os.path.join(CONFIGS, "tiny.yaml"),
                                                     [*base, *extra]))
  whole, chunked, big = load(), load("model.loss_chunk=16"), load("model.loss_chunk=100000")
  # 4 rows x 32 tokens per microbatch per device, 65 vocabulary columns per
  # stage; the logits (their exponentials written over them) and their
  # gradient in float32, as XLA's buffer assignment keeps them.
  saved = 2 * (4 * 32 - 16) * 65 * 4
  for stash in ("inputs", "residuals"):
    assert whole.bytes["none"]["inputs"]["ticks"] - chunked.bytes["none"]["inputs"]["ticks"] \
        == 2 * (4 * 32 - 16) * 257 * 4
    assert whole.bytes["gpipe"][stash]["ticks"] - chunked.bytes["gpipe"][stash]["ticks"] >= saved
    assert big.bytes["gpipe"][stash] == whole.bytes["gpipe"][stash]  # a chunk past the tokens


def test_planner_residuals_of_full_remat_are_the_block_inputs():
  """remat=full keeps each block's input and nothing else: L/S stage inputs per slot."""
  from jaxpipe.cli import planner  # pylint: disable=g-import-not-at-top
  from jaxpipe import config as config_lib
  from jaxpipe.pipeline import facts
  cfg = config_lib.load(os.path.join(CONFIGS, "tiny.yaml"),
                        ["pipeline.schedule=1f1b", "pipeline.stages=2", "pipeline.microbatches=4",
                         "model.remat=full"])
  p = planner.plan(cfg, work=False)
  x = 2 * 32 * 32 * 4                         # 2 rows x 32 tokens x 32 float32
  slots = facts("1f1b", 2, 4).stash_slots + 1
  assert p.bytes["1f1b"]["inputs"]["stash"] == slots * (x + 4)
  assert p.bytes["1f1b"]["residuals"]["stash"] == slots * (2 * x + 4)  # 2 blocks per stage
  assert p.stage_params == _tiny_stage(2, 2)


def test_planner_smollm_360m_matches_hand_computation():
  from jaxpipe.cli import planner  # pylint: disable=g-import-not-at-top
  from jaxpipe import config as config_lib
  # At 16 microbatches (the config ships 32), which the numbers below assume.
  cfg = config_lib.load(os.path.join(CONFIGS, "smollm-360m.yaml"),
                        ["pipeline.stash=inputs", "pipeline.microbatches=16"])
  p = planner.plan(cfg, device_gib=80, work=False)
  # 32 blocks of width 960, 15 / 5 heads, SwiGLU 2560, tied GPT-2 embedding
  # (50257 rows, padded to 50260 and split in 4), final norm; 4 stages of 8
  # blocks; float32 master weights.
  block = _block_params(960, 15, 5, 2560)
  assert p.num_params == 32 * block + 50257 * 960 + 960
  stage = 8 * block + 50260 // 4 * 960 + 960
  assert p.stage_params == stage
  for stash in ("inputs", "residuals"):
    assert p.bytes["2bw"][stash]["weights"] == stage * 2 * 4
    assert p.bytes["pipedream"][stash]["weights"] == stage * 4 * 4
    assert p.bytes["gpipe"][stash]["weights"] == stage * 4
    # 2bw's tick loop carries two float32 accumulators: batch k-1's (copied
    # in from its state) and batch k's.
    assert p.bytes["2bw"][stash]["grads"] == 2 * stage * 4
    assert p.bytes["2bw"][stash]["ef"] == stage * 4  # error feedback: one parameter-sized buffer
  # 2bw carries batch k-1's partial gradient (float32) and its stash ring:
  # 2(S-1)+1 = 7 slots of [16, 2048, 960] bf16 stage inputs and a loss term.
  x = 16 * 2048 * 960 * 2
  inflight = p.bytes["2bw"]["inputs"]["inflight"]
  assert inflight >= stage * 4 + 7 * (x + 4)
  assert inflight < stage * 4 + 7 * (x + 4) + 4 * x  # + the buffers in transit, the batch
  assert p.bubble["2bw"] == 0.0 and p.bubble["gpipe"] == pytest.approx(3 / 19)
  # A warning for exactly the schedules whose total exceeds the device.
  for name in ("none", "gpipe", "1f1b", "2bw", "pipedream"):
    over = p.total(name) > 80 * 2 ** 30
    assert over == any(w.startswith(name + " ") and "GiB per device" in w
                       for w in p.warnings), name
  tight = planner.plan(cfg, device_gib=1, work=False)
  assert any(w.startswith("2bw (the config's schedule) needs") for w in tight.warnings)


def test_planner_cli_prints_the_table_and_warns(tmp_path):
  p = _tool("planner", "--config", os.path.join(CONFIGS, "tiny.yaml"), "pipeline.schedule=1f1b",
            "pipeline.stages=4", "pipeline.microbatches=4")
  assert p.returncode == 0, p.stderr
  header = re.search(r"^per device\s+(.*)$", p.stdout, re.M).group(1).split()
  assert header == ["none", "gpipe/inp", "gpipe/res", "1f1b/inp*", "1f1b/res", "2bw/inp",
                    "2bw/res", "pipedream/inp", "pipedream/res", "interleaved/inp",
                    "interleaved/res", "zb1/inp", "zb1/res"]
  weights = re.search(r"^weights \(x versions\)\s+(.*)$", p.stdout, re.M).group(1).split("  ")
  weights = [w.strip() for w in weights if w.strip()]
  assert weights[1] == weights[2] == f"{_tiny_stage(1, 4) * 4 / 1024:.3g} KiB"  # gpipe, one version
  assert weights[5] == weights[6] == "-"  # 2bw refuses M=4 at S=4
  # Interleaved (v=2) refuses the tiny model's 4 blocks on S=4 stages (8 chunks); zb1's
  # step on 1F1B's ticks takes 17 units (ZB-H1's would take 3M+S-1 = 15) of which a
  # stage is busy 3M = 12: it idles 5/17.
  assert re.search(r"^steady-state bubble\s+0\.0%(\s+42\.9%){4}\s+n/a\s+n/a(\s+42\.9%){2}"
                   r"\s+n/a\s+n/a\s+29\.4%\s+29\.4%$", p.stdout, re.M), p.stdout
  assert re.search(r"^  stash residuals s0=.*slowest / mean = 1\.000$", p.stdout, re.M), p.stdout
  assert "warning: 2bw needs pipeline.microbatches >= 2(S-1) = 6" in p.stdout
  assert "warning: gpipe idles 43%" in p.stdout


def test_planner_reports_interleaved_facts():
  """Interleaved's column and facts: ticks, bubble (S-1)/(vM+S-1), stash slots, memory.

  tiny.yaml's 4 blocks on S=2 stages of v=2 chunks, M=4: a slot holds one
  stage input with `inputs` (as 1f1b's), and a chunk's residuals with
  `residuals` (half the stage's, so fewer bytes than 1f1b's ring although
  it has more slots).
  """
  from jaxpipe.cli import planner  # pylint: disable=g-import-not-at-top
  from jaxpipe import config as config_lib
  from jaxpipe.pipeline import facts
  cfg = config_lib.load(os.path.join(CONFIGS, "tiny.yaml"),
                        ["pipeline.schedule=interleaved", "pipeline.stages=2",
                         "pipeline.virtual_stages=2", "pipeline.microbatches=4"])
  p = planner.plan(cfg, work=False)
  f = p.facts
  assert (f["ticks"], f["stash_slots"], f["virtual_stages"]) == (12, 5, 2)
  assert f["bubble"] == pytest.approx(1 / 9) == p.bubble["interleaved"]
  assert p.bubble["1f1b"] == pytest.approx(1 / 5)
  assert f["transfers"] == 4 * 3 == 3 * facts("1f1b", 2, 4).transfers
  x = 2 * 32 * 32 * 4
  assert p.bytes["interleaved"]["inputs"]["stash"] == (5 + 1) * (x + 4)
  assert p.bytes["interleaved"]["inputs"]["weights"] == p.bytes["1f1b"]["inputs"]["weights"]
  text = planner.format_plan(p, 80)
  assert "interleaved (v=2 chunks per device): 12 ticks per step" in text
  assert "bubble 11.1%, 5 stash slots per device" in text


def test_planner_reports_zb1_facts_and_w_stash():
  """zb1's column and facts: 1F1B's M+2(S-1) ticks, bubble (S-1)/(3M+S-1) at S=2, both rings.

  tiny.yaml on S=2, M=4: the forward's ring (1F1B's 2(S-1)+1 slots and a
  scratch one, each a stage input with `inputs`) and W's ring (3 slots and
  a scratch one), each slot what B keeps for W of every weight use.
  """
  from jaxpipe.cli import planner  # pylint: disable=g-import-not-at-top
  from jaxpipe import config as config_lib
  cfg = config_lib.load(os.path.join(CONFIGS, "tiny.yaml"),
                        ["pipeline.schedule=zb1", "pipeline.stages=2", "pipeline.microbatches=4"])
  p = planner.plan(cfg, work=True)
  f = p.facts
  assert (f["ticks"], f["stash_slots"], f["virtual_stages"]) == (6, 3, 1)
  # One microbatch's F, B and W (and the head) cost what 1f1b's F and B do: the
  # split recomputes nothing (a forward is a quarter of the `inputs` tick); only
  # the elementwise bookkeeping differs (masks, accumulator adds: 0.2%).
  one_f_one_b = planner.plan(dataclasses.replace(
      cfg, pipeline=dataclasses.replace(cfg.pipeline, schedule="1f1b")), work=True)
  for stash in ("inputs", "residuals"):
    assert p.work[stash] == pytest.approx(one_f_one_b.work[stash], rel=1e-2)
  assert f["bubble"] == pytest.approx(1 / 13) == p.bubble["zb1"]
  x = 2 * 32 * 32 * 4
  w_ring = p.bytes["zb1"]["inputs"]["stash"] - 4 * (x + 4)
  # Per slot at least a weight use's input and its output cotangent, of every block.
  assert w_ring > 0 and w_ring % 4 == 0 and w_ring // 4 >= 2 * x
  # With `residuals` the forward's ring is 1f1b's (4 slots at S=2: 2(S-1)+1 and
  # a scratch one): the last stage's B takes the head's cotangent in its tick.
  assert p.bytes["zb1"]["residuals"]["stash"] - w_ring == p.bytes["1f1b"]["residuals"]["stash"]
  assert "zb1: 6 ticks per step" in planner.format_plan(p, 80)


def test_planner_json_puts_xla_beside_the_estimate():
  p = _tool("planner", "--config", os.path.join(CONFIGS, "tiny.yaml"), "--compile", "--json",
            "pipeline.schedule=2bw", "pipeline.stages=2", "pipeline.stash=residuals")
  assert p.returncode == 0, p.stderr
  out = json.loads(p.stdout)
  assert out["config"]["schedule"] == "2bw" and out["config"]["stash"] == "residuals"
  assert out["estimate_gib"] == out["estimates"]["2bw"]["residuals"] > 0
  xla = out["xla"]
  assert xla["resident"] == xla["argument"] + xla["output"] - xla["alias"] + xla["temp"]
  assert out["xla_resident_gib"] == xla["resident"] / 2 ** 30
  # The tiny model's step is small: a few MiB, estimated within a factor of two.
  assert 0.5 < out["estimate_gib"] / out["xla_resident_gib"] < 2
  assert out["estimates"]["2bw"]["inputs"] < out["estimates"]["2bw"]["residuals"]


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


# --- bench_train_steps and bench_collectives --------------------------------------


@pytest.mark.parametrize("tool,args", [
    ("bench_train_steps", ("--schedules", "2bw,zb9")),
    ("bench_train_steps", ("--schedules", "")),
    ("bench_train_steps", ("--rounds", "0")),
    ("bench_train_steps", ("--steps", "4")),
    ("bench_train_steps", ("--cores", "0")),
    ("bench_train_steps", ("--tokenizer", "sentencepiece")),
    ("bench_train_steps", ("run.launch_hooks",)),
    ("bench_collectives", ("--reps", "2")),
    ("bench_collectives", ("--cores", "0,0")),
    ("bench_collectives", ("--cores", "a,b")),
])
def test_new_bench_tools_refuse_bad_input_in_one_line(tool, args):
  _one_line_error(_tool(tool, *args))


def test_bench_train_steps_rotates_rounds_and_divides_the_reference(monkeypatch):
  """Each round runs every configuration once, rotated; a round's speed-up is none's time over the schedule's."""
  mod = _load("bench_train_steps")
  calls = []
  fake = {"none": [0.8, 0.6], "2bw": [0.5, 0.4], "1f1b": [0.4, 0.5]}

  fake["hardware"] = [0.9, 0.75]

  def run_once(schedule, cores, tokenizer, steps, work, extra=()):
    assert extra == ("model.remat=none",)   # the overrides reach every run
    calls.append((schedule, cores))
    return fake[schedule][sum(1 for c, _ in calls if c == schedule) - 1]

  def run_hardware(cores, tokenizer, steps, work, extra=()):
    return run_once("hardware", ",".join(cores), tokenizer, steps, work, extra)

  # The ceiling: (its worker's one-device step, its two devices' step) per round.
  ceiling = [(0.7, 0.8), (0.65, 0.7)]

  def run_ceiling(cores, tokenizer, steps):
    calls.append(("ceiling", ",".join(cores)))
    return ceiling[sum(1 for c, _ in calls if c == "ceiling") - 1]

  monkeypatch.setattr(mod, "run_once", run_once)
  monkeypatch.setattr(mod, "run_hardware", run_hardware)
  monkeypatch.setattr(mod, "run_ceiling", run_ceiling)
  rows = mod.measure(("2bw", "1f1b"), "byte", 2, 8, ("0", "1"), log=lambda _: None,
                     extra=("model.remat=none",))
  assert calls == [("none", "0"), ("2bw", "0,1"), ("1f1b", "0,1"), ("hardware", "0,1"),
                   ("ceiling", "0,1"),
                   ("2bw", "0,1"), ("1f1b", "0,1"), ("hardware", "0,1"), ("ceiling", "0,1"),
                   ("none", "0")]
  by = {r["schedule"]: r for r in rows}
  assert by["2bw"]["speedups"] == pytest.approx([0.8 / 0.5, 0.6 / 0.4])
  assert by["1f1b"]["median"] == pytest.approx((0.8 / 0.4 + 0.6 / 0.5) / 2)
  # The hardware row does twice the reference's work; a schedule's share is per round.
  assert by["hardware"]["speedups"] == pytest.approx([2 * 0.8 / 0.9, 2 * 0.6 / 0.75])
  assert by["2bw"]["of_hardware"] == pytest.approx(
      ((0.8 / 0.5) / (1.6 / 0.9) + (0.6 / 0.4) / (1.2 / 0.75)) / 2)
  # The ceiling's speed-up is over its own worker's one-device step.
  assert by["ceiling"]["speedups"] == pytest.approx([2 * 0.7 / 0.8, 2 * 0.65 / 0.7])
  assert by["ceiling"]["ref_s"] == [0.7, 0.65]
  assert by["2bw"]["of_ceiling"] == pytest.approx(
      ((0.8 / 0.5) / (1.4 / 0.8) + (0.6 / 0.4) / (1.3 / 0.7)) / 2)
  table = mod.table(rows, "byte")
  assert "| byte | 2bw | 0.800 / 0.600 | 0.500 / 0.400 | 1.60x / 1.50x | 1.55x |" in table
  assert "| byte | ceiling (two devices of one process, no collective; " in table
  assert "| byte | hardware (two one-device runs at once) | 0.800 / 0.600 | 0.900 / 0.750 |" in table


def test_bench_train_steps_hardware_row_runs_two_references_at_once(tmp_path, monkeypatch):
  """run_hardware starts a one-device run on each core before waiting; the slower counts."""
  mod = _load("bench_train_steps")
  started = []

  class FakePopen:
    def __init__(self, cmd, **kwargs):
      started.append(cmd)
      self.returncode = None
      run_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("run.dir="))
      t = 0.5 if cmd[2] == "0" else 0.7
      with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps({"step": k, "step_time_s": t}) + "\n" for k in range(8)))

    def poll(self):
      assert len(started) == 2   # both running before either is waited for
      self.returncode = 0
      return 0

  monkeypatch.setattr(mod.subprocess, "Popen", FakePopen)
  assert mod.run_hardware(("0", "1"), "byte", 8, str(tmp_path)) == pytest.approx(0.7)
  assert [c[:3] for c in started] == [["taskset", "-c", "0"], ["taskset", "-c", "1"]]
  assert all("pipeline.schedule=none" in c and "pipeline.stages=1" in c for c in started)
  assert all(any(a.startswith("run.compile_cache=") for a in c) for c in started)


def test_bench_train_steps_ceiling_runs_the_benchmark_workers_in_a_row(monkeypatch):
  """run_ceiling steps the one-device worker on the first core, then the two-device ceiling
  on both, each `steps` times, and takes each one's median from step 3 on."""
  mod = _load("bench_train_steps")
  made = []

  class FakeWorker:
    def __init__(self, label, spec, cores):
      made.append(self)
      self.label, self.spec, self.cores, self.events = label, spec, cores, []
      base = 0.6 if label == "none" else 0.7
      # Steps 0-2 slow (as compilation and warm-up are), then base, base+0.1, base.
      self.times = iter([5.0, 4.0, 3.0, base, base + 0.1, base])

    def ready(self):
      self.events.append("ready")

    def step(self):
      self.events.append("step")
      return next(self.times)

    def close(self):
      self.events.append("close")

  monkeypatch.setattr(mod, "start_worker", FakeWorker)
  assert mod.run_ceiling(("0", "1"), "gpt2", 6) == pytest.approx((0.6, 0.7))
  assert [(w.label, w.cores) for w in made] == [("none", "0"), ("ceiling", "0,1")]
  assert [(w.spec["schedule"], w.spec["stages"], w.spec["data"]) for w in made] == [
      ("none", 1, 1), ("ceiling", 1, 2)]
  assert all(w.spec["shape"]["vocab"] == 50257 and w.spec["microbatches"] == 8 for w in made)
  # The workers' shape is train.py's (SHAPE): batch 16 = 8 microbatches of 2 rows.
  shape = dict(a.split("=", 1) for a in mod.SHAPE)
  worker = made[0].spec["shape"]
  assert (worker["dim"], worker["layers"], worker["heads"], worker["kv_heads"],
          worker["seq_len"], worker["remat"], worker["stash"]) == (
              int(shape["model.dim"]), int(shape["model.n_layers"]),
              int(shape["model.n_heads"]), int(shape["model.n_kv_heads"]),
              int(shape["data.seq_len"]), shape["model.remat"], shape["pipeline.stash"])
  assert worker["micro_rows"] * made[0].spec["microbatches"] == int(shape["data.batch_size"])
  assert made[0].spec["microbatches"] == int(shape["pipeline.microbatches"])
  assert all(w.events == ["ready"] + ["step"] * 6 + ["close"] for w in made)


def test_bench_train_steps_reads_train_py_step_times(tmp_path, monkeypatch):
  """run_once takes the median step_time_s from step 3 on, from the run's metrics.jsonl."""
  import subprocess as sp  # pylint: disable=g-import-not-at-top
  mod = _load("bench_train_steps")
  seen = {}

  def fake_run(cmd, **kwargs):
    seen["cmd"], seen["env"] = cmd, kwargs["env"]
    run_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("run.dir="))
    recs = [{"step": k, "loss": 1.0, "step_time_s": t}
            for k, t in enumerate([9.0, 5.0, 4.0, 0.5, 0.7, 0.6])]
    recs.append({"step": 6, "val_loss": 1.0})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
      f.write("".join(json.dumps(r) + "\n" for r in recs))
    return sp.CompletedProcess(cmd, 0, "", "")

  monkeypatch.setattr(mod.subprocess, "run", fake_run)
  assert mod.run_once("2bw", "0,1", "byte", 6, str(tmp_path),
                      ("model.remat=none",)) == pytest.approx(0.6)
  cmd = seen["cmd"]
  assert cmd[-2:] == ["run.launch_hooks=tools.cpu.tuning", "model.remat=none"]
  assert cmd[:3] == ["taskset", "-c", "0,1"] and "pipeline.stages=2" in cmd
  assert "pipeline.schedule=2bw" in cmd and "model.dim=256" in cmd
  assert seen["env"]["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=false"


def test_bench_train_steps_hardware_row_stops_the_other_run_when_one_fails(tmp_path, monkeypatch):
  """One of the two runs fails: the other is killed, and the error names the failed run's line."""
  mod = _load("bench_train_steps")
  procs = []

  class FakePopen:
    def __init__(self, cmd, **kwargs):
      self.failing = cmd[2] == "1"
      self.returncode, self.killed = None, False
      if self.failing:
        kwargs["stderr"].write("error: out of memory\n")
        kwargs["stderr"].flush()
      procs.append(self)

    def poll(self):
      if self.failing:
        self.returncode = 2
      return self.returncode

    def kill(self):
      self.killed, self.returncode = True, -9

    def wait(self):
      return self.returncode

  monkeypatch.setattr(mod.subprocess, "Popen", FakePopen)
  with pytest.raises(RuntimeError, match=r"^train.py none exited 2: error: out of memory$"):
    mod.run_hardware(("0", "1"), "byte", 8, str(tmp_path))
  assert procs[0].killed and not procs[1].killed


@pytest.mark.slow
def test_bench_collectives_times_every_collective_both_ways(tmp_path):
  """Each collective and payload is timed in one process and over two gloo processes, twice."""
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs two cores")
  cores = sorted(os.sched_getaffinity(0))[:2]
  out = tmp_path / "c.md"
  p = _tool("bench_collectives", "--reps", "4", "--cores", f"{cores[0]},{cores[1]}",
            "--out-md", str(out), timeout=600)
  assert p.returncode == 0, p.stderr
  # Against one process: gloo with its I/O thread as it comes, and idle-class.
  rows = re.findall(r"^\| (ppermute|psum|all_gather) \| [^|]+\| [^|]+\| [^|]+\| ([0-9.]+)x "
                    r"\| [^|]+\| ([0-9.]+)x \|$", out.read_text(), re.M)
  assert len(rows) == 9 and all(float(a) > 0 and float(b) > 0 for _, a, b in rows), out.read_text()
  # Pinned a core each, gloo's all-reduce waited for a scheduler tick with its
  # I/O thread at the normal class; idle-class it does not.
  assert all(float(b) < float(a) for op, a, b in rows if op == "psum"), out.read_text()


def test_benchmark_labels_name_interleaved_chunks_and_its_target():
  """'interleaved v4' is interleaved with 4 chunks per device; bad labels and shapes are refused
  in one line; its two-core target is 0.93 of its bubble bound times the ceiling."""
  common, two_core = _load("bench_common"), _load("bench_two_core")
  assert common.parse_label("interleaved v4") == ("interleaved", 4)
  assert common.parse_label("2bw") == ("2bw", 1)
  for bad in ("interleaved", "2bw v2", "zigzag", "interleaved vx"):
    with pytest.raises(ValueError):
      common.parse_label(bad)
  assert common.refusal("interleaved v2", 2, 8, layers=8) is None
  assert "chunks" in common.refusal("interleaved v4", 2, 8, layers=4)
  assert "multiple" in common.refusal("interleaved v2", 2, 3)
  assert "M >= 2" in common.refusal("2bw", 2, 1)
  cfg = common.make_config(common.ModelShape(), "interleaved v2", 2, 8)
  assert (cfg.pipeline.schedule, cfg.pipeline.virtual_stages) == ("interleaved", 2)
  bubble = 1 / 17   # (S-1)/(vM+S-1) at S=2, v=2, M=8
  assert two_core.target("interleaved v2", 257, 1.8, bubble) == pytest.approx(0.93 * 16 / 17 * 1.8)
  assert two_core.target("interleaved v2", 257, None, bubble) is None
  assert common.parse_label("zb1") == ("zb1", 1)
  assert two_core.target("zb1", 257, 1.8, 1 / 25) == pytest.approx(0.93 * 24 / 25 * 1.8)


# --- bench_platform ----------------------------------------------------------------


def test_bench_platform_runs_each_core_alone_then_both_and_divides():
  bp = _load("bench_platform")
  # Per call: (cores asked for) -> seconds per copy, planned so every ratio is known.
  planned = iter([[1.0], [1.5], [1.25, 2.5],     # round 1: mean alone 1.25, slower copy 2.5
                  [2.0], [2.0], [1.0, 2.0]])     # round 2: mean alone 2.0, slower copy 2.0
  calls = []

  def fake_run(cores, work):
    calls.append((tuple(cores), work))
    return next(planned)

  rows = bp.measure(2, ("0", "1"), 77, run=fake_run, log=lambda _: None)
  assert calls == [(("0",), 77), (("1",), 77), (("0", "1"), 77)] * 2
  assert [r["alone"] for r in rows] == [[1.0, 1.5], [2.0, 2.0]]
  assert [r["pair"] for r in rows] == [[1.25, 2.5], [1.0, 2.0]]
  # Twice the round's mean one-core time over the slower copy.
  assert rows[0]["speedup"] == pytest.approx(2 * 1.25 / 2.5)
  assert rows[1]["speedup"] == pytest.approx(2 * 2.0 / 2.0)
  s = bp.summary(rows)
  assert s["alone"]["min"] == 1.0 and s["alone"]["max"] == 2.0
  assert s["alone"]["median"] == pytest.approx(1.75)
  assert s["alone_max_over_min"] == pytest.approx(2.0)
  assert s["speedup"]["min"] == pytest.approx(1.0) and s["speedup"]["max"] == pytest.approx(2.0)
  md = bp.table(s, 2, 77)
  assert "| one core alone, s | 1.000 |" in md
  assert "| two cores at once, speed-up | 1.00x |" in md
  assert "up to 2.00 times its fastest run" in md


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not any(os.access(os.path.join(d, "taskset"), os.X_OK)
                               for d in os.environ.get("PATH", "").split(os.pathsep)),
                    reason="needs two cores and taskset")
def test_bench_platform_measures_a_real_round(tmp_path):
  out = tmp_path / "p.md"
  cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2])
  p = _tool("bench_platform", "--rounds", "1", "--work", "20", "--cores", cores,
            "--out-md", str(out))
  assert p.returncode == 0, p.stderr
  assert re.search(r"round 1/1 .*alone \d+\.\d+ / \d+\.\d+ s, both at once", p.stdout)
  row = re.search(r"\| one core alone, s \| ([\d.]+) \|", out.read_text())
  assert row and float(row.group(1)) > 0


@pytest.mark.parametrize("args", [("--rounds", "0"), ("--work", "0"), ("--cores", "0,0"),
                                  ("--cores", "1,01"), ("--cores", "0"), ("--cores", "0,x"),
                                  ("--bogus",)])
def test_bench_platform_bad_input_is_one_line_and_status_2(args):
  _one_line_error(_tool("bench_platform", *args))


def test_transfers_table_gives_each_kind_per_device():
  report = _load("bench_report")
  accounts = {
      "2bw": {"transfers": {0: {"collective-permute": {"count": 8, "bytes": 8 * 1024},
                                "all-reduce": {"count": 4, "bytes": 2048}},
                            1: {"all-reduce": {"count": 4, "bytes": 2048}}}},
      # As a child process's JSON gives it back: device keys as strings.
      "1f1b": {"transfers": {"10": {"collective-permute": {"count": 2.5, "bytes": 3 * 1024}},
                             "2": {}}},
      # A process per stage: devices named by process.
      "2bw x2": {"transfers": {"p1": {"all-reduce": {"count": 1, "bytes": 1024}},
                               "p0": {"all-reduce": {"count": 1, "bytes": 1024}}}}}
  md = report.transfers_table(accounts)
  assert "| configuration | device | all-reduce | collective-permute |" in md
  assert "| 2bw | 0 | 4 / 2.0 | 8 / 8.0 |" in md
  assert "| 2bw | 1 | 4 / 2.0 | 0 |" in md
  # Devices in their numbers' order, not as text.
  assert md.index("| 1f1b | 2 | 0 | 0 |") < md.index("| 1f1b | 10 | 0 | 2.5 / 3.0 |")
  assert md.index("| 2bw x2 | p0 | 1 / 1.0 | 0 |") < md.index("| 2bw x2 | p1 |")
