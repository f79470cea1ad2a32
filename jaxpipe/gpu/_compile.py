"""A config's training step compiled for NVIDIA GPUs on a machine without one, and read.

`compile_step(cfg, 'h100', nodes=N)` asks jaxlib's CUDA plugin for a
topology of N nodes of GPUs of that kind (`jax.experimental.topologies`:
compile-only devices, nothing is allocated), builds the config's mesh and
schedule on them exactly as `train.py` does (`jaxpipe.trainer.schedule_from_config`,
`mesh.layout` deciding which axis crosses nodes), traces the step for CUDA
(`jaxpipe._target.compiling_for`: attention picks cuDNN where it runs) and
compiles it with the XLA options the launcher sets on GPUs
(`jaxpipe.accel.gpu_xla_flags`). `report(step)` reads what the GPU compiler
made: XLA's memory per device, the attention kernels, every collective, and
a projected step (`jaxpipe.gpu._read`).

The process must not start a GPU backend of its own: run with
JAX_PLATFORMS=cpu (the planner sets it), as on a machine without GPUs.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional

from jaxpipe import _target
from jaxpipe import accel
from jaxpipe import config as config_lib
from jaxpipe import hlo
from jaxpipe.errors import ConfigError
from jaxpipe.gpu import _read
from jaxpipe.gpu._targets import GpuKind, cuda_plugin_missing, kind, target_text

__all__ = ["GpuStep", "GpuReport", "topology_devices", "compile_step", "report",
           "DEFAULT_NETWORK_GBPS", "usable_fraction"]

# What a GPU of one node sends to one of another, per direction: one
# 400 Gb/s InfiniBand or RoCE port per GPU, as in NVIDIA's DGX H100 and most
# H100 and H200 clusters. `--network-gbps` states another.
DEFAULT_NETWORK_GBPS = 400.0
# JAX's GPU allocator takes this share of the memory at start-up unless
# XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise; a step must fit in it.
_JAX_MEM_FRACTION = 0.75


def usable_fraction(env: Optional[dict[str, str]] = None) -> float:
  """The share of a GPU's memory JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION or 0.75)."""
  env = os.environ if env is None else env
  try:
    return float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", _JAX_MEM_FRACTION))
  except ValueError:
    return _JAX_MEM_FRACTION


def topology_devices(gpu: GpuKind, nodes: int, per_node: int) -> list[Any]:
  """Compile-only devices: `nodes` nodes of `per_node` GPUs of kind `gpu` (process index = node)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topo = topologies.get_topology_desc("jaxpipe", "cuda", target_config=target_text(gpu),
                                      topology=f"1x{nodes}x{per_node}")
  return list(topo.devices)


@dataclasses.dataclass
class GpuStep:
  """A config's training step compiled for GPUs.

  Attributes:
    cfg: the resolved config.
    gpu: the kind of GPU.
    nodes: nodes of the topology.
    mesh: the step's ('stage', 'data') mesh of compile-only devices.
    compiled: the compiled step (`jax.stages.Compiled`).
    attention: the attention implementation traced (cudnn, blockwise or xla).
    options: the XLA options it was compiled with.
    compile_s: seconds the lowering and compilation took here.
  """
  cfg: config_lib.Config
  gpu: GpuKind
  nodes: int
  mesh: Any
  compiled: Any
  attention: str
  options: dict[str, Any]
  compile_s: float

  @property
  def devices(self) -> int:
    """GPUs of the mesh."""
    return self.mesh.devices.size


def _check_mesh(cfg: config_lib.Config, nodes: int) -> int:
  n = cfg.pipeline.stages * cfg.mesh.data
  if nodes < 1:
    raise ConfigError(f"--nodes must be >= 1, got {nodes}")
  if n % nodes:
    raise ConfigError(f"pipeline.stages x mesh.data = {cfg.pipeline.stages} x {cfg.mesh.data} "
                      f"= {n} GPUs do not split over {nodes} nodes; choose --nodes dividing {n}")
  return n // nodes


def compile_step(cfg: config_lib.Config, gpu_name: str, *, nodes: int = 1) -> GpuStep:
  """Compiles the config's training step for `nodes` nodes of `gpu_name` GPUs (see module doc).

  `cfg.model.vocab_size` must be set. Raises ConfigError for an unknown
  kind, a mesh the nodes cannot split, or a missing CUDA plugin.
  """
  from jaxpipe import model as model_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import make_mesh  # pylint: disable=g-import-not-at-top
  try:
    gpu = kind(gpu_name)
  except ValueError as e:
    raise ConfigError(f"--gpu: {e}") from None
  missing = cuda_plugin_missing()
  if missing:
    raise ConfigError(missing)
  per_node = _check_mesh(cfg, nodes)
  t0 = time.perf_counter()
  devices = topology_devices(gpu, nodes, per_node)
  try:
    mesh = make_mesh(cfg.pipeline.stages, cfg.mesh.data, devices, layout=cfg.mesh.layout)
  except ValueError as e:
    raise ConfigError(f"mesh.layout={cfg.mesh.layout}: {e}") from None
  m = cfg.model
  attention = model_lib.select_attention(
      m.attention, backend="cuda", dtype=m.compute_dtype, seq_len=cfg.data.seq_len,
      head_dim=m.dim // m.n_heads)
  with _target.compiling_for("cuda"):
    model, fns, optimizer = trainer.components(cfg)
    schedule = trainer.schedule_from_config(cfg, fns, optimizer, mesh)
    state, batch = trainer.abstract_step_inputs(cfg, model, schedule)
    lowered = schedule.lower_step(state, batch, batch)
  pipelined = cfg.pipeline.schedule != "none" and cfg.pipeline.stages > 1
  options = accel.xla_options(
      accel.gpu_xla_flags(deterministic=cfg.run.deterministic, pipelined=pipelined),
      os.environ.get("XLA_FLAGS", ""))
  compiled = lowered.compile(compiler_options=options)
  return GpuStep(cfg, gpu, nodes, mesh, compiled, attention, options,
                 time.perf_counter() - t0)


@dataclasses.dataclass
class GpuReport:
  """What the GPU compile of a step says, per device, and the step it projects.

  Attributes:
    kind, device_kind: the GPU kind and the name its devices report.
    devices, nodes: GPUs and nodes of the topology.
    memory: XLA's bytes per device: argument, output, alias, temp, resident
      (= argument + output - alias + temp).
    capacity_bytes, usable_bytes: the GPU's memory, and the share JAX's
      allocator takes (`usable_fraction`).
    attention: the implementation traced and the fused kernels compiled
      ({'implementation': ..., 'kernels': {custom-call target: count}}).
    transfers: every collective site (`_read.Transfer`).
    cost: the projected cost of one step (`_read.ProgramCost`).
    model_flops: the model's FLOPs per device and step (causal attention,
      `jaxpipe.accel.step_flops`), what MFU divides.
    peak_tflops: the GPU's dense bfloat16 peak.
    links: the bandwidths the projection assumed (GB/s per direction):
      {'nvlink': ..., 'network': ...}.
    compile_s: seconds the compile took here.
    options: the XLA options compiled with.
  """
  kind: str
  device_kind: str
  devices: int
  nodes: int
  memory: dict[str, int]
  capacity_bytes: int
  usable_bytes: int
  attention: dict[str, Any]
  transfers: list[_read.Transfer]
  cost: _read.ProgramCost
  model_flops: float
  peak_tflops: float
  links: dict[str, float]
  compile_s: float
  options: dict[str, Any]

  @property
  def resident_gib(self) -> float:
    """XLA's resident bytes per device, in GiB."""
    return self.memory["resident"] / 2 ** 30

  @property
  def fits(self) -> bool:
    """Whether the resident bytes fit in what JAX's allocator takes of the GPU."""
    return self.memory["resident"] <= self.usable_bytes

  @property
  def projected_step_s(self) -> float:
    """The projected step time in seconds (see `jaxpipe.gpu._read`)."""
    return self.cost.seconds

  @property
  def projected_mfu(self) -> float:
    """Model FLOPs per device and step over the projected step at the dense bfloat16 peak."""
    return self.model_flops / (self.cost.seconds * self.peak_tflops * 1e12)

  def as_json(self) -> dict[str, Any]:
    """The report as the planner prints it under `gpu` (`tools/planner.py --gpu --json`)."""
    c = self.cost
    return {
        "kind": self.kind, "device_kind": self.device_kind, "devices": self.devices,
        "nodes": self.nodes, "memory": self.memory,
        "resident_gib": self.resident_gib, "capacity_gib": self.capacity_bytes / 2 ** 30,
        "usable_gib": self.usable_bytes / 2 ** 30, "fits": self.fits,
        "attention": self.attention,
        "collectives": [t.as_json() for t in self.transfers],
        "projected_step_s": c.seconds, "projected_mfu": self.projected_mfu,
        "projection": {
            "model": "kernels at max(matmul FLOPs / peak, bytes / memory bandwidth) + "
                     f"{_read.KERNEL_OVERHEAD_S * 1e6:g} us; loops x trips; a conditional "
                     "its slowest branch; collectives at the link's bandwidth + latency, "
                     "asynchronous ones hidden behind the kernels between start and done",
            "matmul_flops": c.matmul_flops, "model_flops": self.model_flops,
            "memory_bytes": c.memory_bytes, "kernels": c.kernels,
            "exposed_transfer_s": c.exposed_s, "peak_tflops": self.peak_tflops,
            "links_gbps": self.links},
        "compile_s": self.compile_s, "xla_options": self.options,
    }


def report(step: GpuStep, *, network_gbps: float = DEFAULT_NETWORK_GBPS) -> GpuReport:
  """Reads the compiled step: memory, attention, collectives, projected step (see GpuReport)."""
  from jaxpipe.pipeline import node_of  # pylint: disable=g-import-not-at-top
  cfg, gpu = step.cfg, step.gpu
  stats = step.compiled.memory_analysis()
  memory = {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
            "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes}
  memory["resident"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
  module = hlo.Module.parse(step.compiled.as_text())
  # The program's device ids are its devices' places in the mesh, flattened.
  nodes = tuple(node_of(d) for d in step.mesh.devices.flat)
  links = _read.Links(peak_flops=gpu.peak_tflops * 1e12,
                      memory_bandwidth=gpu.memory_bandwidth,
                      link_bandwidth=gpu.link_gbps * 1e9,
                      network_bandwidth=network_gbps / 8 * 1e9, node_of=nodes)
  cost = _read.read_program(module, links)
  p = cfg.pipeline
  per_token = accel.step_flops(cfg.model, cfg.data.seq_len, schedule=p.schedule, stash=p.stash,
                               stages=p.stages, attention=step.attention).model
  model_flops = per_token * cfg.data.batch_size * cfg.data.seq_len / step.devices
  usable = int(gpu.memory_bytes * usable_fraction())
  transfers = sorted(cost.transfers.values(), key=lambda t: (-t.count * t.bytes, t.name))
  return GpuReport(
      kind=gpu.name, device_kind=gpu.device_kind, devices=step.devices, nodes=step.nodes,
      memory=memory, capacity_bytes=gpu.memory_bytes, usable_bytes=usable,
      attention={"implementation": step.attention,
                 "kernels": _read.attention_kernels(module)},
      transfers=transfers, cost=cost, model_flops=model_flops, peak_tflops=gpu.peak_tflops,
      links={"nvlink": gpu.link_gbps, "network": network_gbps / 8},
      compile_s=step.compile_s, options=step.options)
