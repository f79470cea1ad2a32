"""What running on an accelerator needs: peak rates, FLOP accounting, XLA's GPU flags, memory.

- `device_peak_tflops(kind)`: the dense bfloat16 peak of a `device_kind`,
  looked up by its exact name (an H100's PCIe, NVL and SXM parts differ by a
  third); `PEAK_TFLOPS` is the table and says where each number comes from.
- `step_flops(...)`: FLOPs per training token three ways: the model's useful
  work with causal attention (what MFU divides), the same with attention
  counted in full (PaLM's convention, which some peers report), and what the
  devices compute (recomputation included: the input stash's forward,
  `model.remat`, the chunked head, the attention kernels' own backward).
- `gpu_expected()` and `gpu_xla_flags(...)`: before JAX starts, whether this
  process will run on NVIDIA GPUs, and the XLA flags the launcher then adds
  (`merge_xla_flags`: a flag the user already set in XLA_FLAGS wins);
  `xla_options(...)`, the same flags as one compile's options (`jaxpipe.gpu`
  compiles for GPUs with them); `cuda_plugin_installed()`,
  `nvidia_driver_loaded()` and `cpu_without_driver()`: jaxlib's CUDA plugin
  on a machine without NVIDIA's driver runs JAX on the CPU, quietly.
- `cpu_xla_flags()`: the XLA flags the launcher adds elsewhere, for a run
  of one process (XLA's CPU compiler orders each program for memory, not
  for concurrency); `xla_default_order_flags()`, the planner's.
- `tune_cpu_malloc()`: glibc's malloc told to keep the memory it gets from
  the system, so that XLA's CPU buffers of one step do not page-fault again
  in the next (the launcher sets it for CPU runs; `CPU_MALLOC` says how).
- `start_backend()`, `epoll_threads(tids)` and `make_idle_class(tids)`: the
  threads JAX's backend starts, the one among them that waits in epoll
  (gloo's event loop in a multi-process CPU run), and Linux's idle
  scheduling class for it, so that it does not hold a core its device's
  thread needs (`jaxpipe.launch.idle_io_thread` decides where).
- `device_memory(devices)`: each device's peak memory, where the runtime
  reports it (`Device.memory_stats()`; the CPU reports nothing).
- `enable_compile_cache(dir)`: JAX's persistent compilation cache.

This module imports no JAX at load time: the launcher reads it before JAX
starts its backend, which is when XLA reads XLA_FLAGS.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import json
import os
import platform
import threading
import time
from typing import Any, Collection, Mapping, NamedTuple, Optional, Sequence

__all__ = ["PEAK_TFLOPS", "device_peak_tflops", "StepFlops", "step_flops", "gpu_expected",
           "gpu_xla_flags", "nvidia_driver_loaded", "cuda_plugin_installed",
           "cpu_without_driver", "xla_options", "merge_xla_flags", "cpu_xla_flags",
           "xla_default_order_flags",
           "CPU_MALLOC", "ONE_ARENA", "tune_cpu_malloc", "thread_ids", "start_backend",
           "epoll_threads", "make_idle_class", "device_memory", "write_device_memory",
           "enable_compile_cache"]

# Dense (no 2:4 sparsity) bfloat16 tensor-core peak in TFLOP/s per chip, keyed
# by the exact `device_kind` JAX reports. NVIDIA's datasheets print the
# sparse figure for Hopper and Blackwell; dense is half of it:
#   H100 SXM5 1,979 / PCIe 1,513 / NVL 1,671 (H100 datasheet); H200 SXM 1,979 /
#   H200 NVL 1,671 (H200 datasheet); GH200's GPU is an H100 SXM-class part;
#   B200 4.5 PFLOP/s FP16/BF16 per GPU (HGX B200 specifications);
#   A100 (every form factor and memory size) 312 dense (A100 datasheet).
# TPUs: Google's Cloud TPU pages (v4 275, v5e 197, v5p 459, v6e 918).
# Anything else: `run.peak_tflops` / `--peak-tflops`.
PEAK_TFLOPS: dict[str, float] = {
    "NVIDIA H100 80GB HBM3": 989.4,      # H100 SXM5
    "NVIDIA H100 PCIe": 756.5,
    "NVIDIA H100 NVL": 835.5,
    "NVIDIA H200": 989.4,                # H200 SXM
    "NVIDIA H200 NVL": 835.5,
    "NVIDIA GH200 480GB": 989.4,
    "NVIDIA B200": 2250.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,                # v5e
    "TPU v5": 459.0,                     # v5p
    "TPU v5p": 459.0,
    "TPU v6 lite": 918.0,                # v6e
}


def device_peak_tflops(kind: str) -> Optional[float]:
  """Dense bfloat16 peak TFLOP/s of the accelerator whose `device_kind` is `kind`, else None.

  The name must match a key of `PEAK_TFLOPS` (case and surrounding spaces
  aside): a substring would give every "H100" the SXM part's peak, a third
  above a PCIe card's.
  """
  wanted = " ".join(kind.split()).lower()
  return next((peak for name, peak in PEAK_TFLOPS.items() if name.lower() == wanted), None)


class StepFlops(NamedTuple):
  """FLOPs of one training token (forward and backward), counted three ways.

  Attributes:
    model: useful work with causal attention (`jaxpipe.model.flops_per_token`):
      what MFU divides by the peak.
    model_full: the same with attention's [T, T] products counted in full
      (12 x layers x width x T, PaLM's convention).
    hardware: what the devices compute: `model` plus the forward work done
      again in the backward (the input stash's recomputed stage, `model.remat`,
      the chunked head's logits, the attention kernels' recomputed scores),
      every capacity slot of the experts, and the head's vocabulary padding.
      Hardware FLOP utilisation (HFU) divides this by the peak.
  """
  model: float
  model_full: float
  hardware: float


def step_flops(model_cfg: Any, seq_len: int, *, schedule: str = "none", stash: str = "inputs",
               stages: int = 1, attention: str = "xla") -> StepFlops:
  """FLOPs of one training token of `model_cfg` run by `schedule` (see `StepFlops`).

  Args:
    model_cfg: a `ModelConfig` with vocab_size set.
    seq_len: tokens per sequence.
    schedule: none, gpipe, 1f1b, 2bw, pipedream or interleaved.
    stash: pipeline.stash of a pipelined schedule: with `inputs` each stage's
      backward runs its forward again.
    stages: pipeline stages (the vocabulary is padded to a multiple of them).
    attention: the implementation that runs (xla, blockwise or cudnn): the
      blockwise and cuDNN kernels keep no probabilities and recompute the
      scores q k^T in their backward, half an attention forward.

  Recomputation counted, as forward work per token:
    - stash `inputs` (pipelined schedules): the stage's blocks once more;
    - model.remat `full`: the blocks once more inside the backward; `dots`:
      what its policy does not save, the dots with batch dimensions
      (attention's, and the experts' matmuls);
    - model.loss_chunk: the head's logits once more.
  """
  from jaxpipe.model import token_flops  # pylint: disable=g-import-not-at-top
  f = token_flops(model_cfg, seq_len)
  model = 3.0 * (f.dense + f.experts + f.attention + f.head)
  model_full = 3.0 * (f.dense + f.experts + f.attention_full + f.head)
  pipelined = schedule != "none"
  vocab = model_cfg.vocab_size
  if pipelined:
    vocab = stages * -(-vocab // stages)  # the padded vocabulary every stage's head slice covers
  head = 2.0 * model_cfg.dim * vocab
  blocks = f.dense + f.expert_slots + f.attention  # one forward of the blocks, as computed
  attention_bwd = f.attention / 2 if attention in ("blockwise", "cudnn") else 0.0
  hardware = 3.0 * (blocks + head) + attention_bwd
  if pipelined and stash == "inputs":
    hardware += blocks
  # Rematerialisation acts once, in the backward of whichever forward was
  # differentiated (the input stash's recomputed one included).
  hardware += {"none": 0.0, "full": blocks, "dots": f.attention + f.expert_slots}[model_cfg.remat]
  if model_cfg.loss_chunk:
    hardware += head
  return StepFlops(model, model_full, hardware)


# --- XLA flags for NVIDIA GPUs, set before JAX starts -------------------------

# Distributions whose presence means JAX will find CUDA GPUs (the PJRT plugin
# and its Python half, CUDA 12 and 13 builds).
_CUDA_DISTRIBUTIONS = ("jax-cuda13-pjrt", "jax-cuda12-pjrt", "jax-cuda13-plugin",
                       "jax-cuda12-plugin")


def _installed(name: str) -> bool:
  try:
    importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return False
  return True


def nvidia_driver_loaded() -> bool:
  """Whether this machine runs NVIDIA's kernel driver, without which CUDA finds no GPU."""
  return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def cuda_plugin_installed() -> bool:
  """Whether jaxlib's CUDA plugin is installed (`pip install jax[cuda12]`, jaxpipe's cuda extra)."""
  return any(_installed(name) for name in _CUDA_DISTRIBUTIONS)


def gpu_expected(env: Optional[Mapping[str, str]] = None) -> bool:
  """Whether JAX, once started in this environment, will run on NVIDIA GPUs.

  Decided before JAX starts (XLA reads XLA_FLAGS then): a CUDA build of
  jaxlib's plugin is installed, NVIDIA's driver is loaded, JAX_PLATFORMS (if
  set) allows cuda or gpu, and CUDA_VISIBLE_DEVICES does not hide every GPU.
  A machine with the plugin but no driver (jaxpipe's cuda extra installed to
  compile for GPUs on a CPU machine, `jaxpipe.gpu`) runs on its CPU.
  """
  env = os.environ if env is None else env
  platforms = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms and not {"cuda", "gpu"} & set(platforms):
    return False
  if env.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
    return False
  return cuda_plugin_installed() and nvidia_driver_loaded()


def cpu_without_driver(env: Optional[dict[str, str]] = None) -> bool:
  """Sets JAX_PLATFORMS=cpu where the CUDA plugin is installed but NVIDIA's driver is not.

  JAX would otherwise try to start the plugin, which fails without the
  driver and prints a traceback before JAX falls back to the CPU. Called
  by the commands before JAX starts; a JAX_PLATFORMS already set is kept.
  Returns whether it set it.
  """
  env = os.environ if env is None else env
  if env.get("JAX_PLATFORMS") or not cuda_plugin_installed() or nvidia_driver_loaded():
    return False
  env["JAX_PLATFORMS"] = "cpu"
  return True


def gpu_xla_flags(*, deterministic: bool, pipelined: bool) -> list[str]:
  """The XLA flags the launcher adds on NVIDIA GPUs (the user's own win: `merge_xla_flags`).

  - the latency-hiding scheduler, which lets XLA run transfers and collectives
    (the data-parallel all-reduce, the stage-to-stage `ppermute`s) while
    compute runs; XLA leaves it off by default;
  - for a pipelined schedule, two of JAX's GPU performance guide's flags
    for pipeline parallelism (no command buffers, no collective-permute
    motion), and two transfers in flight at once instead of one
    (`xla_gpu_experimental_parallel_collective_overlap_limit`): a tick sends
    its activation forward and its cotangent back, each beside the block
    compute that hides it (`jaxpipe.pipeline.Engine(overlap=True)`). The
    guide's third flag, XLA's pipeline-parallelism optimisation, is left
    out: it lowers the cotangent's send, which the engine already places
    at the start of the next tick, to a send and a recv whose done XLA
    schedules before the tick's forward, so the forward waits for it
    (read from the compiled program, docs/accelerators.md);
  - with `deterministic` (run.deterministic), deterministic GPU ops: XLA
    then picks deterministic kernels (scatter-adds such as the embedding's
    gradient, reductions, autotuned algorithms), at some cost in speed, so a
    run on the same GPUs and mesh repeats bit for bit.
  """
  flags = ["--xla_gpu_enable_latency_hiding_scheduler=true"]
  if pipelined:
    flags += ["--xla_gpu_enable_command_buffer=''",
              "--xla_disable_hlo_passes=collective-permute-motion",
              "--xla_gpu_experimental_parallel_collective_overlap_limit=2"]
  if deterministic:
    flags.append("--xla_gpu_deterministic_ops=true")
  return flags


def xla_options(flags: Sequence[str], current: str = "") -> dict[str, Any]:
  """XLA flags as `compiler_options` of one compile, without those `current` (XLA_FLAGS) sets.

  `--name=value` becomes {name: value} with true/false as booleans and the
  shell quotes of an empty value dropped, as `jax.stages.Lowered.compile`
  takes them; a flag the user set in XLA_FLAGS is left out, so that the
  user's value (which XLA read at start-up) wins there too.
  """
  have = {_flag_name(f) for f in current.split()}
  out: dict[str, Any] = {}
  for flag in flags:
    name, _, value = flag.partition("=")
    if name in have:
      continue
    value = value.strip("'\"")
    out[name.lstrip("-")] = {"true": True, "false": False}.get(value, value)
  return out


def _flag_name(flag: str) -> str:
  return flag.split("=", 1)[0]


def merge_xla_flags(current: str, defaults: Sequence[str]) -> str:
  """XLA_FLAGS with each default added unless `current` already sets that flag (the user's wins)."""
  have = {_flag_name(f) for f in current.split()}
  return " ".join([current] + [f for f in defaults if _flag_name(f) not in have]).strip()


_CPU_ORDER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def cpu_xla_flags() -> list[str]:
  """The XLA flags the launcher adds where JAX will not find NVIDIA GPUs (the user's own win).

  XLA's CPU compiler orders each program's operations breadth-first by
  default, to expose concurrency to its runtime at the cost of memory
  (`xla_cpu_enable_concurrency_optimized_scheduler`); the flag set here
  makes it order them depth-first, for memory. A pipeline step with a stage
  per core runs faster so (docs/benchmark.md: 2bw at 1.79x of one core
  against 1.61x, in the same 20 alternated rounds; the one-device step's
  time is the same either way). XLA reads this flag from XLA_FLAGS
  only: passed to `jax.jit(compiler_options=...)` it is accepted and
  compiles the same order as without it. The flag is known to XLA on every
  backend, and only its CPU compiler reads it. The launcher adds it for runs
  of one process only (see `jaxpipe.launch.prepare_devices`).
  """
  return [f"{_CPU_ORDER_FLAG}=false"]


def xla_default_order_flags() -> list[str]:
  """XLA_FLAGS that keep XLA's default (breadth-first) CPU order: what the planner compiles with.

  That order keeps 11-23% more alive per device than `cpu_xla_flags`'
  depth-first one on the benchmark's shapes (docs/benchmark.md), so the
  planner's `--compile` figure is the larger of the two.
  """
  return [f"{_CPU_ORDER_FLAG}=true"]


# --- the CPU's allocator --------------------------------------------------------

# glibc's mallopt() parameters (malloc.h) and the values the launcher sets.
# XLA's CPU runtime allocates each step's buffers with malloc and frees them
# at its end. glibc serves a block of 32 MiB or more (its largest mmap
# threshold) with its own mmap and unmaps it on free, and deletes a thread
# arena's heap (64 MiB at most) once it is empty: either way the next step
# gets fresh pages and takes a page fault on each 4 KiB of them (15,000 per
# step for the benchmark's one-device step, 30,000 for its 1f1b step; 2bw,
# whose stash is state, took none, as gpipe and zb1 now do, `FlushedState`).
# So: no mmap of its own (M_MMAP_MAX 0),
# no trimming below 1 GiB free at the top of the heap (M_TRIM_THRESHOLD), a
# top pad of 64 MiB (M_TOP_PAD), and, where it pays, one arena for every
# thread (M_ARENA_MAX 1). The last is what keeps a block larger than a thread
# arena's heap (GPT-2's logits): a thread arena cannot
# grow a heap past 64 MiB and glibc maps such a block by itself, whatever
# M_MMAP_MAX says, and unmaps it on free; the main arena grows with brk and
# keeps it. The devices' threads then share the arena's lock: two devices of
# one process lost 5-11% of their step to it where no block was that large,
# so the launcher gives one arena (ONE_ARENA) to a process of one device
# unless run.cpu_malloc_arenas says otherwise. It holds for threads that
# allocate for the first time after it is set, which is why the launcher
# sets it before JAX starts its backend. docs/benchmark.md measures each.
CPU_MALLOC = {"M_MMAP_MAX": (-4, 0), "M_TRIM_THRESHOLD": (-1, 1 << 30),
              "M_TOP_PAD": (-2, 64 << 20)}
ONE_ARENA = {"M_ARENA_MAX": (-8, 1)}
# glibc reads these at start; a user who sets one has chosen the allocator.
_MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
               "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST")


def tune_cpu_malloc(env: Optional[Mapping[str, str]] = None, *,
                    one_arena: bool = True) -> Optional[dict[str, int]]:
  """Sets glibc's malloc options `CPU_MALLOC` in this process; returns what it set, or None.

  With `one_arena`, also `ONE_ARENA`: every thread allocates from the main arena.

  Nothing is set (None) where the C library is not glibc, or where the
  environment already chooses malloc's behaviour (a `MALLOC_*` variable
  glibc reads, or a `glibc.malloc.` tunable in GLIBC_TUNABLES): the user's
  choice wins, as their XLA_FLAGS do. The options hold for the process from
  then on; memory freed stays with it for the next step instead of going
  back to the system.
  """
  env = os.environ if env is None else env
  if any(k in env for k in _MALLOC_ENV) or "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
    return None
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return None
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    return None
  # By hand, through ctypes: neither the standard library nor a package binds mallopt.
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  done = {}
  for name, (param, value) in {**CPU_MALLOC, **(ONE_ARENA if one_arena else {})}.items():
    if mallopt(param, value) == 1:  # 1: accepted
      done[name] = value
  return done


# --- the CPU collectives' I/O thread ------------------------------------------

# Several processes on the CPU exchange their collectives through gloo, whose
# TCP transport runs an event loop on a thread of its own (epoll), started
# with JAX's CPU backend. While a collective is in flight that thread polls;
# sharing its core with the device's thread at the same scheduling class, it
# kept the core until the scheduler's next tick, and every all-reduce took
# that tick (4 ms at 250 Hz) whatever its size. At Linux's idle class it
# runs only when nothing else wants the core (docs/benchmark.md, "One
# collective alone"; the launcher's policy: `jaxpipe.launch.idle_io_thread`).
# A blocked thread's kernel function (wchan: do_epoll_wait or ep_poll) or
# system call number while it waits in epoll.
_EPOLL_WCHAN = ("epoll", "ep_poll")
_EPOLL_SYSCALLS = {"x86_64": {"232", "281", "441"}, "aarch64": {"22", "441"}}


def thread_ids() -> set[int]:
  """The ids of this process's threads now (Linux's /proc; an empty set elsewhere)."""
  try:
    return {int(t) for t in os.listdir("/proc/self/task")}
  except OSError:
    return set()


def start_backend(*, split_ops: bool = True) -> tuple[list[Any], set[int]]:
  """Starts JAX's backend: (`jax.devices()`, the ids of the threads that appeared meanwhile).

  Where the backend had started before, no thread appears. With
  `split_ops=False` and CPU devices, the programs compiled from then on
  inside `compiling()` have no loop operation partitioned over the threads;
  `split_ops=True`, or devices of another platform, leave XLA's choice.
  """
  import jax  # pylint: disable=g-import-not-at-top
  global _COMPILE_CORES
  before = thread_ids()
  devices = jax.devices()
  cpu = bool(devices) and devices[0].platform == "cpu"
  _COMPILE_CORES = (frozenset(os.sched_getaffinity(0))
                    if not split_ops and cpu and hasattr(os, "sched_getaffinity") else None)
  return devices, thread_ids() - before


# The cores of the process while XLA compiles without partitioning loop
# operations (`start_backend(split_ops=False)`); None: XLA compiles as it will.
_COMPILE_CORES: Optional[frozenset] = None
_PINNED = {"depth": 0, "saved": {}}
_PIN_LOCK = threading.Lock()


@contextlib.contextmanager
def compiling():
  """Where the backend was started with split_ops=False: XLA compiles in here
  without partitioning any loop operation over the threads.

  XLA's CPU compiler partitions a loop operation over as many threads as
  the cores its compiling thread may use (`outer_dimension_partitions` in
  the compiled HLO; the build option that would say so is not reachable
  from JAX), and the runtime hands the other part to its thread pool. Where
  every core already runs a device of the process, that part waits for a
  thread busy with another device's work, and the devices of a pipeline
  wait for each other (docs/benchmark.md, "Operations split over the
  threads"). The compilation runs on one of XLA's own threads, so while
  inside, every thread of the process may use one core only, and after,
  each gets back the cores it had (a program already running is moved back
  at once); nested or concurrent uses pin once and restore once. Dots are
  not loop operations: the runtime still splits them over its pool. The
  compilation itself then runs on one core. Elsewhere this does nothing.
  JAX's persistent compilation cache does not key on this: a program it
  holds is loaded as it was compiled.
  """
  cores = _COMPILE_CORES
  if cores is None:
    yield
    return
  with _PIN_LOCK:
    if _PINNED["depth"] == 0:
      _PINNED["saved"] = _pin_threads({min(cores)})
    _PINNED["depth"] += 1
  try:
    yield
  finally:
    with _PIN_LOCK:
      _PINNED["depth"] -= 1
      if _PINNED["depth"] == 0:
        saved = _PINNED["saved"]
        # A thread that started while pinned gets the process's cores.
        for tid in thread_ids():
          _set_affinity(tid, saved.get(tid, cores))


def _pin_threads(cores: set[int]) -> dict[int, frozenset]:
  """Pins every thread of the process to `cores`; returns each one's cores before."""
  saved = {}
  for tid in thread_ids():
    try:
      saved[tid] = frozenset(os.sched_getaffinity(tid))
    except OSError:  # a thread that ended meanwhile
      continue
    _set_affinity(tid, cores)
  return saved


def _set_affinity(tid: int, cores) -> None:
  try:
    os.sched_setaffinity(tid, cores)
  except OSError:  # a thread that ended meanwhile
    pass


def _in_epoll(tid: int) -> bool:
  try:
    with open(f"/proc/self/task/{tid}/wchan") as f:
      if any(name in f.read() for name in _EPOLL_WCHAN):
        return True
    with open(f"/proc/self/task/{tid}/syscall") as f:
      call = f.read().split()[:1]
  except OSError:
    return False
  return bool(call) and call[0] in _EPOLL_SYSCALLS.get(platform.machine(), set())


def epoll_threads(tids: Collection[int], *, samples: int = 20,
                  interval_s: float = 0.005) -> list[int]:
  """The threads of `tids` seen waiting in epoll, in id order.

  Each is looked at `samples` times, `interval_s` apart, since an event
  loop is not always blocked. Among the threads JAX's CPU backend starts in
  a run with gloo collectives it was gloo's event loop alone (XLA's own
  threads wait on futexes). Nothing is found off Linux.
  """
  found: set[int] = set()
  for i in range(samples):
    found |= {t for t in tids if t not in found and _in_epoll(t)}
    if i + 1 < samples:
      time.sleep(interval_s)
  return sorted(found)


def make_idle_class(tids: Collection[int]) -> list[int]:
  """Puts each thread of `tids` under Linux's SCHED_IDLE; returns those it could set.

  An idle-class thread runs only when nothing else wants its core, and a
  normal thread it wakes takes the core at once.
  """
  done = []
  for t in sorted(tids):
    try:
      os.sched_setscheduler(t, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
      continue
    done.append(t)
  return done


# --- memory and compilation cache -------------------------------------------


def device_memory(devices: Sequence[Any]) -> Optional[list[dict[str, Any]]]:
  """Each device's memory as its runtime reports it: bytes in use, the peak, the limit.

  One dict per device that reports statistics (`Device.memory_stats()`:
  GPUs and TPUs), with `id`, `process`, `kind`, `peak_bytes_in_use`,
  `bytes_in_use` and `bytes_limit` (None where a statistic is missing); None
  when no device reports any (the CPU returns None).
  """
  rows = []
  for d in devices:
    stats = d.memory_stats()
    if not stats:
      continue
    rows.append({"id": d.id, "process": d.process_index, "kind": d.device_kind,
                 **{k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use",
                                              "bytes_limit")}})
  return rows or None


def write_device_memory(run_dir: str, devices: Sequence[Any], process: int,
                        num_processes: int) -> Optional[float]:
  """Writes this process's `device_memory` into run_dir; returns its largest peak in GiB.

  The file is device_memory.json for a one-process run and
  device_memory.P.json for process P of several (each process sees only its
  own devices). Nothing is written, and None returned, where the devices
  report no statistics.
  """
  rows = device_memory(devices)
  if rows is None:
    return None
  name = "device_memory.json" if num_processes == 1 else f"device_memory.{process}.json"
  with open(os.path.join(run_dir, name), "w") as f:
    json.dump({"process": process, "devices": rows}, f, indent=1)
  peaks = [r["peak_bytes_in_use"] for r in rows if r["peak_bytes_in_use"] is not None]
  return max(peaks) / 2 ** 30 if peaks else None


def enable_compile_cache(path: str) -> None:
  """Turns on JAX's persistent compilation cache in `path` (created if missing).

  Call before the first compilation: JAX opens its cache then. Programs that
  took at least `jax_persistent_cache_min_compile_time_secs` (1 s by
  default) to compile are written, and a restarted run on the same devices,
  jaxlib and XLA flags reads them back instead of compiling.
  """
  import jax  # pylint: disable=g-import-not-at-top
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))
