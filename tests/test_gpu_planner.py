"""`tools/planner.py --gpu` and `tools/gpu_table.py` as a user runs them: the JSON, several nodes,
bad input in one line, the missing CUDA plugin named, the docs' table formatted from the JSON."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from jaxpipe import gpu

from tests import _runs

TOOLS = os.path.join(_runs.ROOT, "tools")
TINY_2BW = ("pipeline.schedule=2bw", "pipeline.stages=2", "pipeline.microbatches=4",
            "model.compute_dtype=bfloat16")
needs_plugin = pytest.mark.skipif(
    gpu.cuda_plugin_missing() is not None,
    reason="jaxlib's CUDA plugin is not installed (jaxpipe's cuda extra; the README's test "
           "command installs it)")


def _tool(name: str, *args: str, env=None, timeout: float = 600) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, os.path.join(TOOLS, f"{name}.py"), *args],
                        capture_output=True, text=True, timeout=timeout, cwd=_runs.ROOT, env=env)


def _one_line(p: subprocess.CompletedProcess, *words: str) -> None:
  assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
  assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
  for w in words:
    assert w in p.stderr, p.stderr


@needs_plugin
def test_the_json_of_a_gpu_compile(tmp_path):
  p = _tool("planner", "--config", _runs.TINY, "--gpu", "h100", "--json", *TINY_2BW)
  assert p.returncode == 0, p.stderr[-2000:]
  out = json.loads(p.stdout)
  g = out["gpu"]
  assert (g["kind"], g["devices"], g["nodes"]) == ("h100", 2, 1)
  assert g["device_kind"] == "NVIDIA H100 80GB HBM3"
  assert 0 < g["resident_gib"] < g["usable_gib"] < g["capacity_gib"] and g["fits"]
  assert g["attention"]["implementation"] == "cudnn"
  assert g["attention"]["kernels"]["__cudnn$fmhaSoftmax"] >= 1
  assert g["collectives"] and all(
      {"kind", "count", "bytes", "async", "across_nodes", "hidden_flops"} <= set(c)
      for c in g["collectives"])
  sends = [c for c in g["collectives"] if c["phase"] == "send"]
  assert sends and not any(c["across_nodes"] for c in sends)
  assert g["projected_step_s"] > 0 and 0 < g["projected_mfu"] < 1
  assert set(g["projection"]["matmul_flops"]) == {"bf16"}
  assert out["estimate_gib"] > 0  # the plan is there too


@needs_plugin
def test_two_nodes_send_between_stages_across_the_network():
  p = _tool("planner", "--config", _runs.TINY, "--gpu", "h200", "--nodes", "2",
            "--network-gbps", "100", "--json", *TINY_2BW)
  assert p.returncode == 0, p.stderr[-2000:]
  g = json.loads(p.stdout)["gpu"]
  assert (g["kind"], g["devices"], g["nodes"]) == ("h200", 2, 2)
  assert g["projection"]["links_gbps"] == {"nvlink": 450.0, "network": 12.5}
  sends = [c for c in g["collectives"] if c["phase"] == "send"]
  assert sends and all(c["across_nodes"] for c in sends)


@needs_plugin
def test_the_report_in_words():
  p = _tool("planner", "--config", _runs.TINY, "--gpu", "h100", *TINY_2BW)
  assert p.returncode == 0, p.stderr[-2000:]
  text = p.stdout[p.stdout.index("GPU compile:"):]
  assert "2 x NVIDIA H100 80GB HBM3 on 1 node" in text and ": fits" in text
  assert "attention: cudnn" in text and "collective-permute" in text
  assert "projected step:" in text and "A projection, not a measurement" in text


@pytest.mark.parametrize("args,words", [
    (("--gpu", "x100"), ("--gpu", "known: h100")),
    (("--gpu", "h100", "--nodes", "3"), ("do not split over 3 nodes",)),
    (("--gpu", "h100", "--nodes", "0"), ("--nodes must be >= 1",)),
    (("--gpu", "h100", "--network-gbps", "0"), ("--network-gbps must be > 0",)),
    (("--nodes", "2"), ("add --gpu KIND",)),
])
def test_bad_gpu_arguments_get_one_line(args, words):
  _one_line(_tool("planner", "--config", _runs.TINY, *args, *TINY_2BW), *words)


def test_without_the_cuda_plugin_it_names_the_extra(tmp_path):
  """A Python whose jaxlib has no CUDA plugin: one line saying which extra to install."""
  site = tmp_path / "site"
  site.mkdir()
  # The plugin's distributions look absent to importlib.metadata, as in a CPU-only install.
  (site / "sitecustomize.py").write_text(
      "import importlib.metadata as m\n"
      "_version = m.version\n"
      "def version(name):\n"
      "  if name.startswith(('jax-cuda12', 'jax-cuda13')):\n"
      "    raise m.PackageNotFoundError(name)\n"
      "  return _version(name)\n"
      "m.version = version\n")
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).strip(os.pathsep)
  _one_line(_tool("planner", "--config", _runs.TINY, "--gpu", "h100", *TINY_2BW, env=env),
            "cuda extra", "pip install -e '.[cuda]'")


@needs_plugin
def test_the_docs_table_from_a_rows_json(tmp_path):
  """gpu_table formats a row's planner JSON; an unknown row or a missing file is one line."""
  p = _tool("planner", "--config", _runs.TINY, "--compile", "--gpu", "h100", "--json",
            *TINY_2BW)
  assert p.returncode == 0, p.stderr[-2000:]
  (tmp_path / "smollm-135m_h100.json").write_text(p.stdout)
  t = _tool("gpu_table", "--json-dir", str(tmp_path), "--reuse", "--rows", "smollm-135m/h100")
  assert t.returncode == 0, t.stderr
  lines = t.stdout.strip().splitlines()
  assert len(lines) == 3 and lines[0].startswith("| config | GPUs |")
  g = json.loads(p.stdout)["gpu"]
  row = lines[2]
  assert row.startswith("| smollm-135m | 2 H100 (2x1, 1 node) | 2bw, vocab-parallel |")
  assert f"{g['resident_gib']:.1f} / " in row and "| yes (" in row and "| cuDNN |" in row
  assert f"{g['projected_step_s'] * 1e3:.0f} ms" in row
  _one_line(_tool("gpu_table", "--json-dir", str(tmp_path), "--rows", "nope"), "unknown row")
  shutil.rmtree(tmp_path)
  _one_line(_tool("gpu_table", "--json-dir", str(tmp_path), "--reuse", "--rows",
                  "smollm-135m/h100"), "--reuse but")
