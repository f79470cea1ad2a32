"""The accelerator path on a CPU: peaks by exact device kind, FLOP accounting, XLA's GPU flags,
device memory records and the compilation cache."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

from jaxpipe import accel, config as config_lib, launch
from jaxpipe.config import ModelConfig
from tests import _runs


def test_peaks_are_looked_up_by_exact_device_kind():
  assert accel.device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4   # SXM5
  assert accel.device_peak_tflops("NVIDIA H100 PCIe") == 756.5
  assert accel.device_peak_tflops("NVIDIA H100 NVL") == 835.5
  assert accel.device_peak_tflops("NVIDIA H200") == 989.4
  assert accel.device_peak_tflops("NVIDIA A100-SXM4-40GB") == 312.0
  assert accel.device_peak_tflops("NVIDIA A100 80GB PCIe") == 312.0
  assert accel.device_peak_tflops("NVIDIA B200") == 2250.0
  assert accel.device_peak_tflops("TPU v5 lite") == 197.0
  assert accel.device_peak_tflops("TPU v5") == 459.0
  # Case and spacing aside, nothing is guessed: an unknown part has no peak.
  assert accel.device_peak_tflops("  nvidia h100  pcie ") == 756.5
  assert accel.device_peak_tflops("NVIDIA H100") is None
  assert accel.device_peak_tflops("NVIDIA H100 PCIe MIG 1g.10gb") is None
  assert accel.device_peak_tflops("cpu") is None


# 2 blocks of width 32, 4 heads of 8, 2 kv heads, SwiGLU 96, T=128 (tests/test_model.py counts
# its forward by hand: weight matmuls 49,152 FLOPs a token, causal attention 16,384, the head
# 2 x 32 x vocab).
SMALL = ModelConfig(vocab_size=63, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)


def test_step_flops_hand_count_plain():
  cfg = dataclasses.replace(SMALL, remat="dots")
  f = accel.step_flops(cfg, 128, schedule="none", attention="xla")
  head = 2 * 32 * 63                                           # 4,032
  assert f.model == 3 * (49_152 + 16_384 + head) == 208_704
  assert f.model_full == 3 * (49_152 + 32_768 + head) == 257_856
  # dots saves the weight matmuls' outputs but not attention's batched dots: their forward
  # runs again in the backward. XLA's attention keeps its probabilities: nothing else.
  assert f.hardware == 208_704 + 16_384


def test_step_flops_hand_count_pipelined_recomputation():
  cfg = dataclasses.replace(SMALL, remat="full", loss_chunk=16)
  f = accel.step_flops(cfg, 128, schedule="2bw", stash="inputs", stages=2, attention="blockwise")
  assert f.model == 208_704                                     # useful work does not change
  blocks = 49_152 + 16_384                                      # one forward of the blocks
  head = 2 * 32 * 64                                            # vocabulary padded to 2 x 32
  expected = (3 * (blocks + head)        # forward and backward as computed
              + 16_384 // 2              # blockwise's backward recomputes the scores
              + blocks                   # the input stash: the stage's forward again
              + blocks                   # remat full: each block's forward inside the backward
              + head)                    # the chunked head: logits again in the backward
  assert f.hardware == expected == 352_256
  residuals = accel.step_flops(cfg, 128, schedule="2bw", stash="residuals", stages=2,
                               attention="blockwise")
  assert f.hardware - residuals.hardware == blocks


# --- XLA's flags for NVIDIA GPUs ------------------------------------------------


def test_gpu_expected_reads_the_environment(monkeypatch):
  monkeypatch.setattr(accel, "_installed", lambda name: True)
  monkeypatch.setattr(accel, "nvidia_driver_loaded", lambda: True)
  assert accel.gpu_expected({})
  assert accel.gpu_expected({"JAX_PLATFORMS": "cuda,cpu"})
  assert not accel.gpu_expected({"JAX_PLATFORMS": "cpu"})
  assert not accel.gpu_expected({"CUDA_VISIBLE_DEVICES": ""})
  assert not accel.gpu_expected({"CUDA_VISIBLE_DEVICES": "-1"})
  monkeypatch.setattr(accel, "nvidia_driver_loaded", lambda: False)
  assert not accel.gpu_expected({})   # the CUDA plugin without a driver: a CPU machine
  monkeypatch.setattr(accel, "nvidia_driver_loaded", lambda: True)
  monkeypatch.setattr(accel, "_installed", lambda name: False)
  assert not accel.gpu_expected({})   # no CUDA plugin: a CPU jaxlib


def test_a_cuda_plugin_without_a_driver_runs_jax_on_the_cpu(monkeypatch):
  """With the plugin but no driver, the commands tell JAX to use the CPU (its start-up
  would otherwise fail there and print a traceback); a JAX_PLATFORMS the user set stays."""
  monkeypatch.setattr(accel, "_installed", lambda name: True)
  monkeypatch.setattr(accel, "nvidia_driver_loaded", lambda: False)
  env = {}
  assert accel.cpu_without_driver(env) and env == {"JAX_PLATFORMS": "cpu"}
  env = {"JAX_PLATFORMS": "cuda"}
  assert not accel.cpu_without_driver(env) and env == {"JAX_PLATFORMS": "cuda"}
  monkeypatch.setattr(accel, "nvidia_driver_loaded", lambda: True)
  env = {}
  assert not accel.cpu_without_driver(env) and env == {}
  monkeypatch.setattr(accel, "nvidia_driver_loaded", lambda: False)
  monkeypatch.setattr(accel, "_installed", lambda name: False)
  assert not accel.cpu_without_driver(env) and env == {}


def test_xla_flags_become_compile_options():
  """The launcher's flags as one compile's options; a flag set in XLA_FLAGS is left to it."""
  flags = accel.gpu_xla_flags(deterministic=True, pipelined=True)
  assert accel.xla_options(flags) == {
      "xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_enable_command_buffer": "",
      "xla_disable_hlo_passes": "collective-permute-motion",
      "xla_gpu_experimental_parallel_collective_overlap_limit": "2",
      "xla_gpu_deterministic_ops": True}
  assert accel.xla_options(flags, "--xla_gpu_deterministic_ops=false") == {
      k: v for k, v in accel.xla_options(flags).items() if k != "xla_gpu_deterministic_ops"}


PIPELINE_FLAGS = [
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_command_buffer=''",
    "--xla_disable_hlo_passes=collective-permute-motion",
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
    "--xla_gpu_deterministic_ops=true",
]


def _launch_flags(monkeypatch, gpu: bool, user: str, *overrides: str) -> list[str]:
  monkeypatch.setattr(accel, "gpu_expected", lambda env=None: gpu)
  monkeypatch.setenv("XLA_FLAGS", user)
  cfg = config_lib.load(_runs.TINY, list(overrides))
  launch.prepare_devices(cfg)
  return os.environ["XLA_FLAGS"].split()


def test_launcher_sets_gpu_flags_on_gpus_only(monkeypatch):
  pipelined = ("pipeline.schedule=2bw", "pipeline.stages=2")
  # On GPUs: the latency-hiding scheduler, the pipeline flags, deterministic ops.
  assert _launch_flags(monkeypatch, True, "", *pipelined) == [
      "--xla_force_host_platform_device_count=2", *PIPELINE_FLAGS]
  # schedule none has no collective-permutes to pipeline; run.deterministic=false drops the flag.
  assert _launch_flags(monkeypatch, True, "", "run.deterministic=false") == [
      "--xla_gpu_enable_latency_hiding_scheduler=true"]
  # The user's XLA_FLAGS win, flag by flag.
  user = "--xla_gpu_deterministic_ops=false --xla_disable_hlo_passes=rematerialization"
  assert _launch_flags(monkeypatch, True, user, *pipelined) == [
      "--xla_gpu_deterministic_ops=false", "--xla_disable_hlo_passes=rematerialization",
      "--xla_force_host_platform_device_count=2", *PIPELINE_FLAGS[:2], PIPELINE_FLAGS[3]]
  # Without a GPU: the emulated devices and the CPU flag; the user's value wins.
  assert _launch_flags(monkeypatch, False, "", *pipelined) == [
      "--xla_force_host_platform_device_count=2", *accel.cpu_xla_flags()]
  assert _launch_flags(monkeypatch, False, "--xla_cpu_multi_thread_eigen=false") == [
      "--xla_cpu_multi_thread_eigen=false", *accel.cpu_xla_flags()]
  mine = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
  assert _launch_flags(monkeypatch, False, mine) == [mine]
  # ...and none of it for a run of several processes.
  assert not set(accel.cpu_xla_flags()) & set(_launch_flags(
      monkeypatch, False, "", *pipelined, "dist.num_processes=2",
      "dist.coordinator=127.0.0.1:1234"))
  # ...and on GPUs none of it.
  assert not set(accel.cpu_xla_flags()) & set(_launch_flags(monkeypatch, True, "", *pipelined))


def test_gpu_flags_are_known_to_xla_and_inert_on_the_cpu():
  # XLA aborts on a flag it does not know ("Unknown flag in XLA_FLAGS"): every flag the
  # launcher may set must parse, and a CPU run with them computes as without.
  flags = " ".join(accel.gpu_xla_flags(deterministic=True, pipelined=True))
  env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
  code = "import jax.numpy as jnp; print(float(jnp.arange(4.0).sum()))"
  p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.strip() == "6.0"


_ORDER_PROBE = """
import hashlib, jax, jax.numpy as jnp
def f(x, w):
  outs = [jnp.tanh(x @ w[i]) * i for i in range(6)]
  y = outs[0]
  for o in outs[1:]:
    y = y @ o.T @ o
  return y
kw = {OPTIONS}
text = jax.jit(f, **kw).lower(jnp.ones((64, 64)), jnp.ones((6, 64, 64))).compile().as_text()
print(hashlib.sha256(text.encode()).hexdigest())
"""


def _compiled_order(flags: str, options: str = "{}") -> str:
  env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
  p = subprocess.run([sys.executable, "-c", _ORDER_PROBE.replace("{OPTIONS}", options)],
                     env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  return p.stdout.strip()


def test_cpu_flags_reorder_the_compiled_program_from_xla_flags_only():
  """The launcher's CPU flag parses and changes the order XLA compiles (six independent
  matmuls); the same option given to `jax.jit(compiler_options=...)` does not."""
  (flag,) = accel.cpu_xla_flags()
  name = flag.split("=")[0].lstrip("-")
  default = _compiled_order("")
  assert _compiled_order(flag) != default
  assert _compiled_order("", options=f"{{'compiler_options': {{'{name}': False}}}}") == default


# --- device memory ---------------------------------------------------------------


class _Device:
  """A device as the memory record reads it."""

  def __init__(self, i, stats):
    self.id, self.process_index, self.device_kind, self._stats = i, 0, "NVIDIA H200", stats

  def memory_stats(self):
    return self._stats


def test_device_memory_where_reported(tmp_path):
  assert accel.device_memory(jax.devices()) is None            # the CPU reports nothing
  assert accel.write_device_memory(str(tmp_path), jax.devices(), 0, 1) is None
  assert not os.listdir(tmp_path)
  devices = [_Device(0, {"peak_bytes_in_use": 3 * 2 ** 30, "bytes_in_use": 2 ** 30,
                         "bytes_limit": 100 * 2 ** 30}),
             _Device(1, {"peak_bytes_in_use": 5 * 2 ** 30, "bytes_limit": 100 * 2 ** 30})]
  rows = accel.device_memory(devices)
  assert rows[1] == {"id": 1, "process": 0, "kind": "NVIDIA H200",
                     "peak_bytes_in_use": 5 * 2 ** 30, "bytes_in_use": None,
                     "bytes_limit": 100 * 2 ** 30}
  assert accel.write_device_memory(str(tmp_path), devices, 0, 1) == 5.0
  assert json.load(open(tmp_path / "device_memory.json"))["devices"] == rows
  assert accel.write_device_memory(str(tmp_path), devices, 3, 4) == 5.0
  assert os.path.exists(tmp_path / "device_memory.3.json")


def test_compile_cache_is_written_where_the_config_says(tmp_path):
  cache = tmp_path / "xla-cache"
  env = _runs.env(str(tmp_path / "corpus"))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)   # the tests' own cache must not stand in
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  p = subprocess.run(_runs.command(str(tmp_path / "run"), "run.steps=2",
                                   f"run.compile_cache={cache}"),
                     env=env, capture_output=True, text=True, timeout=600, cwd=_runs.ROOT)
  assert p.returncode == 0, p.stderr[-2000:]
  assert os.listdir(cache)                      # the step's program, among others
  # The CPU reports no device memory: no record, no summary part.
  assert not os.path.exists(tmp_path / "run" / "device_memory.json")
  assert "peak device memory" not in p.stdout
