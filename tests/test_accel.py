"""The accelerator path on a CPU: peaks by exact device kind, FLOP accounting, XLA's GPU flags,
device memory records and the compilation cache."""

import dataclasses
import json
import os
import shutil
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


def _launch_flags(monkeypatch, gpu: bool, user: str, *overrides: str,
                  tuned: list | None = None) -> list[str]:
  monkeypatch.setattr(accel, "gpu_expected", lambda env=None: gpu)
  # Recorded, not applied: this test process keeps glibc's malloc as it is.
  monkeypatch.setattr(accel, "tune_cpu_malloc",
                      lambda env=None, one_arena=True: (tuned if tuned is not None
                                                        else []).append(one_arena))
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


def test_launcher_tunes_malloc_without_a_gpu_only(monkeypatch):
  """Tuned on CPUs only; one arena where the process has one device, or as the key says."""
  pipelined = ("pipeline.schedule=2bw", "pipeline.stages=2")
  two = ("dist.num_processes=2", "dist.coordinator=127.0.0.1:1234")
  for gpu, overrides, want in ((False, pipelined, [False]), (True, pipelined, []),
                               (False, pipelined + two, [True]), (False, (), [True]),
                               (False, pipelined + ("run.cpu_malloc_arenas=one",), [True]),
                               (False, ("run.cpu_malloc_arenas=per_thread",), [False])):
    tuned = []
    _launch_flags(monkeypatch, gpu, "", *overrides, tuned=tuned)
    assert tuned == want, (gpu, overrides)


def test_one_malloc_arena_by_choice_and_devices():
  assert [launch.one_malloc_arena(c, n) for c in ("auto", "one", "per_thread") for n in (1, 2)] \
      == [True, False, True, True, False, False]
  with pytest.raises(ValueError, match="malloc arenas must be one of auto, one, per_thread"):
    launch.one_malloc_arena("threads", 1)


def test_malloc_arena_key_is_validated():
  from jaxpipe.errors import ConfigError  # pylint: disable=g-import-not-at-top
  assert config_lib.load(_runs.TINY).run.cpu_malloc_arenas == "auto"
  with pytest.raises(ConfigError, match="run.cpu_malloc_arenas must be auto, one or "
                                        "per_thread, got 'two'"):
    config_lib.load(_runs.TINY, ["run.cpu_malloc_arenas=two"])


def test_malloc_tuning_yields_to_the_environment():
  for env in ({"MALLOC_ARENA_MAX": "2"}, {"MALLOC_TOP_PAD_": "131072"},
              {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}):
    assert accel.tune_cpu_malloc(env) is None, env


def _faults_per_call(mode: str, t_mib: int) -> dict:
  """tools/bench_malloc.py's worker in a fresh process: t of t_mib MiB (a block of twice that), 5 calls.

  After the worker's default warm-up (12 calls).

  The process compiles its function: one that loads it from JAX's persistent
  cache was seen to take the faults again in one run out of three to six.
  """
  out = subprocess.run([sys.executable, os.path.join(_runs.ROOT, "tools", "bench_malloc.py"),
                        "--worker", json.dumps([t_mib, 5, mode])],
                       capture_output=True, text=True, check=True,
                       env={k: v for k, v in os.environ.items()
                            if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "JAX_COMPILATION",
                                                 "JAX_PERSISTENT"))})
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("t_mib", [16, 48], ids=["32 MiB block", "96 MiB block"])
def test_tuned_malloc_keeps_a_steps_buffers_for_the_next(t_mib):
  """A block over glibc's mmap threshold (32 MiB), and one over a thread arena's
  heap (64 MiB), which only one arena for every thread keeps."""
  import platform  # pylint: disable=g-import-not-at-top
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    pytest.skip("malloc is tuned on glibc only")
  plain = _faults_per_call("glibc defaults", t_mib)
  assert plain["tuned"] is None
  # glibc's defaults map the temporary block afresh each call (4 KiB a fault).
  assert plain["faults"] > t_mib * 2**20 * 2 / 4096 * 0.9, plain
  # Tuned as for a process of one device, it keeps it once the worker's 12
  # warm-up calls are past: until glibc's thread cache has filled, a block
  # can land on fresh heap (bench_malloc's memalign_walk). Under two busy
  # loops, 7 processes of 18 with 3 warm-up calls still took the faults a
  # call (median of 5); 0 of 32 with 12.
  tuned = _faults_per_call("tuned, one arena", t_mib)
  assert tuned["tuned"] == {k: v for k, (_, v) in {**accel.CPU_MALLOC, **accel.ONE_ARENA}.items()}
  assert tuned["faults"] < plain["faults"] / 20, (plain, tuned)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc and SCHED_IDLE")
def test_a_thread_waiting_in_epoll_is_found_and_made_idle_class():
  """gloo's event loop waits in epoll, XLA's threads on futexes: only the first is found."""
  import select  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  stop, ids = threading.Event(), {}
  poller = select.epoll()

  def in_epoll():
    ids["epoll"] = threading.get_native_id()
    while not stop.is_set():
      poller.poll(0.05)

  def on_futex():
    ids["futex"] = threading.get_native_id()
    stop.wait()

  threads = [threading.Thread(target=in_epoll), threading.Thread(target=on_futex)]
  for t in threads:
    t.start()
  try:
    while len(ids) < 2:
      stop.wait(0.01)
    assert ids["epoll"] in accel.thread_ids() and ids["futex"] in accel.thread_ids()
    assert accel.epoll_threads({ids["epoll"], ids["futex"]}) == [ids["epoll"]]
    assert accel.make_idle_class([ids["epoll"]]) == [ids["epoll"]]
    assert os.sched_getscheduler(ids["epoll"]) == os.SCHED_IDLE
    assert os.sched_getscheduler(ids["futex"]) == os.SCHED_OTHER
  finally:
    stop.set()
    for t in threads:
      t.join()
    poller.close()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux's CPU affinity")
def test_launcher_idles_the_io_thread_only_where_every_core_serves_a_device(monkeypatch, capsys):
  found, made = {}, []
  monkeypatch.setattr(accel, "epoll_threads", lambda tids: sorted(found.get(frozenset(tids), [])))
  monkeypatch.setattr(accel, "make_idle_class", lambda tids: made.extend(tids) or list(tids))
  found[frozenset({7, 8})] = [7]
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
  assert launch.idle_io_thread({7, 8}, 1, 0) == [] and not made  # a spare core: left alone
  assert capsys.readouterr().err == ""
  assert launch.idle_io_thread({7, 8}, 2, 0) == [7] and made == [7]
  assert "process 0: gloo's I/O thread 7 runs idle-class (2 cores for 2 devices" in (
      capsys.readouterr().err)
  # None or several in epoll: none is touched, and it says so.
  found[frozenset({8, 9})] = [8, 9]
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
  assert launch.idle_io_thread({8, 9}, 1, 1) == [] and made == [7]
  assert launch.idle_io_thread({5}, 1, 1) == [] and made == [7]
  err = capsys.readouterr().err
  assert "process 1: gloo's I/O thread left at the normal class (2 of" in err
  assert "(0 of the backend's new threads" in err


def test_split_cpu_ops_by_choice_devices_and_cores():
  # auto: split only where a core is left over beyond the process's devices.
  cases = ((1, 2), (2, 2), (4, 2), (1, 1), (2, 16))   # (devices, cores)
  assert [launch.split_cpu_ops("auto", d, c) for d, c in cases] == [True, False, False, False, True]
  assert launch.split_cpu_ops("auto", 2, None)  # cores unknown: XLA's own choice
  assert launch.split_cpu_ops("always", 2, 2) and not launch.split_cpu_ops("never", 1, 16)
  with pytest.raises(ValueError, match="run.cpu_split_ops must be one of auto, always, never"):
    launch.split_cpu_ops("no", 2, 2)


def test_split_ops_key_is_validated():
  from jaxpipe.errors import ConfigError  # pylint: disable=g-import-not-at-top
  assert config_lib.load(_runs.TINY).run.cpu_split_ops == "auto"
  with pytest.raises(ConfigError, match="run.cpu_split_ops must be auto, always or never, "
                                        "got 'sometimes'"):
    config_lib.load(_runs.TINY, ["run.cpu_split_ops=sometimes"])


def test_launcher_starts_the_backend_splitting_ops_only_where_a_core_is_spare(monkeypatch):
  """`launch.start` passes `split_cpu_ops`'s answer for the run's devices and the process's
  cores to the backend (which ignores it for devices of another platform)."""
  seen = []
  monkeypatch.setattr(accel, "start_backend",
                      lambda split_ops: seen.append(split_ops) or (jax.devices(), set()))
  monkeypatch.setattr(launch, "check_devices", lambda cfg, devices: None)
  monkeypatch.setattr(launch, "usable_cores", lambda: 2)
  two_stages = ["pipeline.schedule=2bw", "pipeline.stages=2"]
  for overrides, want in ((two_stages, False), ([], True),
                          (two_stages + ["run.cpu_split_ops=always"], True),
                          (["run.cpu_split_ops=never"], False)):
    launch.start(config_lib.load(_runs.TINY, overrides))
    assert seen[-1] is want, overrides


_SPLIT_PROBE = """
import os, json, jax, jax.numpy as jnp
from jaxpipe import accel
accel.start_backend(split_ops=os.environ["PROBE_SPLIT"] == "1")
f = jax.jit(lambda x: jnp.tanh(x).T * 2.0 + x)
x = jnp.ones((1024, 1024))
outside = f.lower(x).compile().as_text()
import threading
cores = sorted(os.sched_getaffinity(0))
ready, stop, own = threading.Event(), threading.Event(), []
def narrow():  # a thread of its own narrower affinity keeps it
  os.sched_setaffinity(0, {cores[-1]})
  own.append(threading.get_native_id())
  ready.set()
  stop.wait()
t = threading.Thread(target=narrow)
t.start()
ready.wait()
with accel.compiling():
  with accel.compiling():  # nested: pinned once, restored once
    pass
  pinned = sorted(os.sched_getaffinity(0))
  inside = jax.jit(lambda x: jnp.tanh(x).T * 3.0 + x).lower(x).compile().as_text()
try:
  with accel.compiling():
    raise KeyError("while compiling")
except KeyError:
  pass
mine = sorted(os.sched_getaffinity(own[0]))
stop.set()
t.join()
import time
for _ in range(500):  # a joined thread can stay listed a moment while the kernel reaps it
  if str(own[0]) not in os.listdir("/proc/self/task"):
    break
  time.sleep(0.01)
after = set()
for tid in os.listdir("/proc/self/task"):
  try:
    after.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
  except OSError:  # a thread that ended meanwhile
    pass
key = 'outer_dimension_partitions":["2"]'
print(json.dumps({"outside": outside.count(key), "inside": inside.count(key),
                  "after": sorted(after), "cores": cores, "pinned": pinned, "narrow": mine}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or shutil.which("taskset") is None,
                    reason="needs Linux's CPU affinity, taskset and two cores")
def test_compiling_without_split_ops_gives_xla_one_core_and_the_threads_theirs_back():
  """On two cores XLA splits a large elementwise operation in two; after
  `start_backend(split_ops=False)`, what is compiled inside `compiling()` is
  not split, what is compiled outside still is, and every thread ends with the
  cores it had (a nested use and an exception inside included)."""
  cores = sorted(os.sched_getaffinity(0))[:2]
  out = {}
  for split in ("1", "0"):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PROBE_SPLIT": split,
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    # JAX's persistent cache does not key on the threads: one run's program
    # would be the other's.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    p = subprocess.run(["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-c",
                        _SPLIT_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out[split] = json.loads(p.stdout.strip().splitlines()[-1])
  assert out["1"]["outside"] >= 1 and out["1"]["inside"] >= 1  # XLA splits by default
  assert out["0"]["outside"] >= 1 and out["0"]["inside"] == 0
  assert out["0"]["pinned"] == [cores[0]] and out["1"]["pinned"] == cores
  for r in out.values():
    assert r["after"] == [r["cores"]] and r["cores"] == cores
    assert r["narrow"] == [cores[-1]]  # its own cores back, not the process's


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


def test_a_schedule_compiles_its_step_inside_compiling_once_per_kind(monkeypatch):
  """`Schedule.step`'s first call of each kind (plain, guarded) compiles, inside
  `accel.compiling()`; later calls run the compiled step outside it; a lowered
  step's `compile()` is inside it too."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from tests import _pipeline_util as util  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import make_mesh, make_schedule  # pylint: disable=g-import-not-at-top
  entered = []

  @contextlib.contextmanager
  def counting():
    entered.append(1)
    yield

  monkeypatch.setattr(accel, "compiling", counting)
  m = 4
  sch = make_schedule("2bw", util.stage_fns(), util.optimizer("adamw"), make_mesh(2, 1), m,
                      stash="residuals")
  state = sch.init(jax.tree.map(jnp.asarray, util.initial_params()), (m, util.ROWS, util.SEQ))
  tok, tgt = (jax.device_put(x, sch.batch_sharding()) for x in util.batches(m)[0])
  for _ in range(3):
    state, _ = sch.step(state, tok, tgt)
  assert len(entered) == 1
  state, _ = sch.step(state, tok, tgt, go=jnp.asarray(True))
  state, _ = sch.step(state, tok, tgt, go=jnp.asarray(True))
  assert len(entered) == 2
  sch.lower_step(state, tok, tgt).compile()
  assert len(entered) == 3
  jax.block_until_ready(state)
