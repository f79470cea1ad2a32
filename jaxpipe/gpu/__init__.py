"""NVIDIA GPUs without one: a config's step compiled for GPU targets here, read and projected.

  step = jaxpipe.gpu.compile_step(cfg, "h100", nodes=1)
  rep = jaxpipe.gpu.report(step)          # memory, attention, collectives, projected step
  rep.as_json()

Kinds (`KINDS`): h100 (SXM 80 GB), h100-pcie, h200, a100 (SXM 80 GB), b200;
each a target description in `jaxpipe/gpu/targets` written from NVIDIA's
published figures. Needs jaxlib's CUDA plugin (jaxpipe's `cuda` extra) and a
process whose JAX runs on the CPU (JAX_PLATFORMS=cpu). `tools/planner.py
--gpu KIND` is the command line.
"""

from jaxpipe.gpu._compile import (DEFAULT_NETWORK_GBPS, GpuReport, GpuStep, compile_step, report,
                                  topology_devices, usable_fraction)
from jaxpipe.gpu._read import (KERNEL_OVERHEAD_S, LATENCY_S, NETWORK_LATENCY_S, Links,
                               ProgramCost, Transfer, attention_kernels, read_program)
from jaxpipe.gpu._targets import KINDS, GpuKind, cuda_plugin_missing, kind, target_text

__all__ = ["KINDS", "GpuKind", "kind", "target_text", "cuda_plugin_missing", "compile_step",
           "report", "GpuStep", "GpuReport", "topology_devices", "usable_fraction",
           "DEFAULT_NETWORK_GBPS", "read_program", "attention_kernels", "Links", "ProgramCost",
           "Transfer", "KERNEL_OVERHEAD_S", "LATENCY_S", "NETWORK_LATENCY_S"]
