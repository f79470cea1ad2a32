"""The accelerator benchmark: its mesh plan on 1 to 8 devices, its refusals, its CPU mode."""

import os
import re
import subprocess
import sys

import pytest

from jaxpipe import bench
from jaxpipe.errors import ConfigError
from jaxpipe.pipeline import SCHEDULE_NAMES
from tests import _runs

TOOL = os.path.join(_runs.ROOT, "tools", "bench_accel.py")
ALL = ("none", "gpipe", "1f1b", "2bw")


@pytest.mark.parametrize("devices,stages,meshes,batch", [
    (1, 1, {"none": (1, 1), "2bw": (1, 1)}, 32),
    (2, 2, {"none": (1, 2), "2bw": (2, 1)}, 32),
    (4, 2, {"none": (1, 4), "2bw": (2, 2)}, 32),     # 4 does not divide 30 layers: 2 stages
    (8, 2, {"none": (1, 8), "2bw": (2, 4)}, 64),     # 32 rounded up: 8 microbatches x 8 replicas
])
def test_smollm_shapes_plan_on_any_device_count(devices, stages, meshes, batch):
  plan = bench.mesh_plan(devices, 30, ["none", "2bw"], microbatches=8, batch=32)
  assert (plan.stages, plan.meshes, plan.batch) == (stages, meshes, batch)


def test_the_automatic_stage_count():
  # 12 layers on 8 devices: 4 stages (the ceiling), 3 does not divide the devices.
  assert bench.mesh_plan(8, 12, ALL, microbatches=8, batch=64).stages == 4
  # 2bw on 4 stages needs 6 microbatches: with 4 it stops at 2 stages.
  assert bench.mesh_plan(8, 12, ALL, microbatches=4, batch=64).stages == 2
  assert bench.mesh_plan(8, 4, ALL, microbatches=4, batch=16, max_stages=2).meshes["1f1b"] == (2, 4)
  assert bench.mesh_plan(3, 30, ALL, microbatches=8, batch=24).stages == 3


@pytest.mark.parametrize("kwargs,message", [
    (dict(stages=4), "30 layers do not split into --stages 4; choose a divisor of 30"),
    (dict(stages=3), "--stages 3 does not divide the 8 devices; choose a divisor of 8"),
    (dict(stages=2, batch=24, batch_fixed=True),
     "--batch 24 does not split into 8 microbatches over the data replicas (none 8, 2bw 4); "
     "give a multiple of 64"),
    (dict(stages=6, devices=6), "2bw with 6 stages needs --microbatches >= 10"),
    (dict(schedules=["none", "zigzag"]), "unknown schedule 'zigzag'"),
    (dict(schedules=[]), "--schedules is empty"),
])
def test_bad_combinations_are_refused(kwargs, message):
  args = dict(schedules=["none", "2bw"], microbatches=8, batch=32)
  args.update(kwargs)
  devices = args.pop("devices", 8)
  with pytest.raises(ConfigError, match="^" + re.escape(message)):
    bench.mesh_plan(devices, 30, **args)


def _bench(*args, devices=4, timeout=600):
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
  return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                        timeout=timeout, cwd=_runs.ROOT, env=env)


@pytest.mark.parametrize("args,line", [
    (("--schedules", "zigzag"),
     "bench_accel: unknown schedule 'zigzag'; choose from " + ", ".join(SCHEDULE_NAMES)),
    (("--config", "configs/smollm-135m.yaml", "--stages", "4"),
     "bench_accel: 30 layers do not split into --stages 4; choose a divisor of 30"),
    (("--batch", "12"),
     "bench_accel: --batch 12 does not split into 4 microbatches over the data replicas "
     "(none 4, 2bw 2); give a multiple of 16"),
    (("--steps", "0"), "bench_accel: --steps must be >= 1, got 0"),
    (("--stages", "x"), "bench_accel: argument --stages: invalid int value: 'x' (see --help)"),
])
def test_bad_input_exits_2_with_one_line(args, line):
  p = _bench("--preset", "cpu", "--schedules", "none,2bw", *args)
  assert p.returncode == 2, p.stderr
  assert p.stderr.strip().splitlines() == [line]


# The benchmark tools end to end (compiling and timing in pinned processes):
# not in the default run, which must stay under 15 minutes on 2 cores;
# `.venv/bin/python -m pytest -m slow` runs them.
@pytest.mark.slow
@pytest.mark.parametrize("devices,mesh", [(1, "1x1"), (2, "2x1"), (4, "2x2"), (8, "2x4")])
def test_cpu_preset_runs_as_written_on_any_device_count(tmp_path, devices, mesh):
  out = tmp_path / "bench.md"
  p = _bench("--preset", "cpu", "--schedules", "none,2bw", "--steps", "1", "--seq", "32",
             "--out-md", str(out), devices=devices)
  assert p.returncode == 0, p.stderr
  rows = [l for l in out.read_text().splitlines() if l.startswith(("| none", "| 2bw"))]
  assert len(rows) == 2
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[5].replace(",", "")) > 0                   # tokens/s
    assert cells[7:10] == ["n/a"] * 3                             # no peak on a CPU: no MFU, HFU
  assert f"| 2bw | {mesh} |" in out.read_text()
  assert f"| none | 1x{devices} |" in out.read_text()
