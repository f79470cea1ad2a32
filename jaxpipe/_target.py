"""The platform a program is traced for: the running backend's, or an ahead-of-time target's.

Some choices are made while a step is traced and depend on the hardware
that will run it: the attention kernel (cuDNN's fused attention on NVIDIA
GPUs), and how SOAP calls its LAPACK decompositions (one matrix per call
on the CPU). They ask `platform()`. A program compiled here for other
devices (`jaxpipe.gpu` compiles for NVIDIA GPUs on a machine without one)
is traced inside `compiling_for(name)`, so that those choices follow the
devices the program is compiled for rather than this process's backend.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import jax

__all__ = ["platform", "compiling_for"]

_TARGET: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "jaxpipe_target_platform", default=None)


def platform() -> str:
  """The platform programs are traced for now: cuda, rocm, cpu, tpu, ... (NVIDIA GPUs are cuda).

  Inside `compiling_for(name)`, that name; else the running backend's, with
  NVIDIA and AMD GPUs told apart by their platform version.
  """
  target = _TARGET.get()
  if target is not None:
    return target
  name = jax.default_backend()
  if name in ("gpu", "cuda"):
    # jax's own cuDNN checks look for "cuda" in the platform version the same way.
    version = jax.devices()[0].client.platform_version.lower()
    return "cuda" if "cuda" in version else "rocm" if "rocm" in version else "gpu"
  return name


@contextlib.contextmanager
def compiling_for(name: str) -> Iterator[None]:
  """Within: `platform()` answers `name` (trace a program for devices of that platform here)."""
  token = _TARGET.set(name)
  try:
    yield
  finally:
    _TARGET.reset(token)
