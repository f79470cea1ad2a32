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
- `device_memory(devices)`: each device's peak memory, where the runtime
  reports it (`Device.memory_stats()`; the CPU reports nothing).
- `enable_compile_cache(dir)`: JAX's persistent compilation cache.

This module imports no JAX at load time: the launcher reads it before JAX
starts its backend, which is when XLA reads XLA_FLAGS.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from typing import Any, Mapping, NamedTuple, Optional, Sequence

__all__ = ["PEAK_TFLOPS", "device_peak_tflops", "StepFlops", "step_flops", "gpu_expected",
           "gpu_xla_flags", "nvidia_driver_loaded", "cuda_plugin_installed",
           "cpu_without_driver", "xla_options", "merge_xla_flags", "cpu_xla_flags",
           "xla_default_order_flags", "device_memory", "write_device_memory",
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
