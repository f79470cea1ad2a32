"""NVIDIA GPUs to compile for without one: their XLA target descriptions and published figures.

Each kind has a data file `targets/<kind>.txtpb`: XLA's
`GpuTargetConfigProto` in text form (SM count, clock, memory size and
bandwidth, caches, compute capability, the name the device reports),
written from NVIDIA's published figures. `GpuKind` adds what XLA's target
does not hold and the projection needs: the link between two GPUs of a
node, per direction, and the dense bfloat16 peak (`jaxpipe.accel`, by the
name the device reports).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.resources
import re
from typing import Optional

from jaxpipe import accel

__all__ = ["GpuKind", "KINDS", "kind", "target_text", "cuda_plugin_missing"]


@dataclasses.dataclass(frozen=True)
class GpuKind:
  """One kind of GPU: its target file and the figures the projection reads.

  Attributes:
    name: the key (`h100`, ...).
    file: the target description in `jaxpipe/gpu/targets`.
    link_gbps: GB/s one GPU sends to another of its node, per direction
      (NVLink's total bandwidth halved; PCIe Gen5 x16 for the PCIe card).
    summary: one line naming the part.
  """
  name: str
  file: str
  link_gbps: float
  summary: str

  @functools.cached_property
  def text(self) -> str:
    """The target file's text, as shipped (read once)."""
    return importlib.resources.files("jaxpipe.gpu").joinpath("targets", self.file).read_text()

  def _field(self, key: str) -> str:
    m = re.search(rf"^\s*{key}:\s*(\S+)", self.text, re.M)
    if not m:
      raise ValueError(f"{self.file} has no {key}")
    return m.group(1).strip('"')

  @property
  def device_kind(self) -> str:
    """The name the device reports (`device_description_str`), e.g. 'NVIDIA H100 80GB HBM3'."""
    m = re.search(r'^device_description_str:\s*"([^"]*)"', self.text, re.M)
    if not m:
      raise ValueError(f"{self.file} has no device_description_str")
    return m.group(1)

  @property
  def memory_bytes(self) -> int:
    """The GPU's memory in bytes (`device_memory_size`)."""
    return int(self._field("device_memory_size"))

  @property
  def memory_bandwidth(self) -> float:
    """Bytes per second to and from the GPU's memory (`memory_bandwidth`)."""
    return float(self._field("memory_bandwidth"))

  @property
  def peak_tflops(self) -> float:
    """Dense bfloat16 tensor-core peak in TFLOP/s (`jaxpipe.accel.PEAK_TFLOPS`)."""
    peak = accel.device_peak_tflops(self.device_kind)
    if peak is None:
      raise ValueError(f"no peak known for {self.device_kind}")
    return peak


# NVLink: H100 and H200 SXM 900 GB/s, A100 SXM 600 GB/s, B200 1.8 TB/s, in
# both directions together (NVIDIA's datasheets); the H100 PCIe card without
# its optional bridge talks over PCIe Gen5 x16, 64 GB/s each way.
KINDS: dict[str, GpuKind] = {k.name: k for k in (
    GpuKind("h100", "h100.txtpb", 450.0, "H100 SXM5 80 GB (HBM3, NVLink 4)"),
    GpuKind("h100-pcie", "h100-pcie.txtpb", 64.0, "H100 PCIe 80 GB (HBM2e, PCIe Gen5)"),
    GpuKind("h200", "h200.txtpb", 450.0, "H200 SXM 141 GB (HBM3e, NVLink 4)"),
    GpuKind("a100", "a100.txtpb", 300.0, "A100 SXM4 80 GB (HBM2e, NVLink 3)"),
    GpuKind("b200", "b200.txtpb", 900.0, "B200 180 GB (HBM3e, NVLink 5)"),
)}


def kind(name: str) -> GpuKind:
  """The GPU kind called `name`; ValueError naming the known ones otherwise."""
  try:
    return KINDS[name]
  except KeyError:
    raise ValueError(f"unknown GPU kind '{name}'; known: {', '.join(KINDS)}") from None


def _version(*distributions: str) -> Optional[tuple[int, int, int]]:
  for name in distributions:
    try:
      text = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      continue
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]
  return None


# What the target says where the CUDA packages do not (a build whose CUDA
# comes from the system): cuDNN 9.8 and CUDA 12.8, the oldest that
# jaxlib 0.10's CUDA 12 build accepts at start-up.
_DEFAULT_CUDNN = (9, 8, 0)
_DEFAULT_CUDA = (12, 8, 0)


def target_text(gpu: GpuKind) -> str:
  """The target description XLA compiles for: the kind's file, with this install's cuDNN and CUDA.

  XLA decides some rewrites by the cuDNN version (which fused attention
  it may emit); the versions are those of the `nvidia-cudnn-cu*` and
  `nvidia-cuda-runtime-cu*` packages installed beside the CUDA plugin, as
  on a GPU machine with this install.
  """
  cudnn = _version("nvidia-cudnn-cu12", "nvidia-cudnn-cu13") or _DEFAULT_CUDNN
  cuda = _version("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13") or _DEFAULT_CUDA
  return (gpu.text.rstrip() + "\n"
          f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} patch: {cudnn[2]} }}\n"
          f"runtime_version {{ major: {cuda[0]} minor: {cuda[1]} patch: {cuda[2]} }}\n")


def cuda_plugin_missing() -> Optional[str]:
  """None where jaxlib's CUDA plugin is installed; else one line saying what to install."""
  if accel.cuda_plugin_installed():
    return None
  return ("compiling for a GPU needs jaxlib's CUDA plugin, which is not installed; install "
          "jaxpipe's cuda extra (pip install -e '.[cuda]' in a clone) and run again")
