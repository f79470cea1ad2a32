"""Process start-up: emulated CPU devices, XLA's GPU flags and `jax.distributed`.

`prepare_devices` must run before JAX initialises its backend (it sets
XLA_FLAGS: the emulated CPU devices, or on NVIDIA GPUs `jaxpipe.accel`'s
flags); `start` then turns on the compilation cache (`run.compile_cache`),
joins a multi-process run when the config or the environment asks for one,
and checks that the mesh's devices exist.
"""

from __future__ import annotations

import math
import os

from jaxpipe import accel
from jaxpipe.config import Config
from jaxpipe.errors import ConfigError

__all__ = ["prepare_devices", "start", "check_devices", "local_devices_needed",
           "distributed_settings"]

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def distributed_settings(cfg: Config) -> tuple[str, int, int]:
  """(coordinator, num_processes, process_id) from the config, else the environment.

  The environment variables are JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
  JAX_PROCESS_ID (or SLURM's SLURM_NTASKS and SLURM_PROCID, in which case an
  empty coordinator lets JAX find it); a config value other than its default wins.
  """
  d = cfg.dist
  env = os.environ
  coordinator = d.coordinator or env.get("JAX_COORDINATOR_ADDRESS", "")
  try:
    num = d.num_processes if d.num_processes != 1 else int(
        env.get("JAX_NUM_PROCESSES", env.get("SLURM_NTASKS", "1")))
    pid = d.process_id if d.process_id != 0 else int(
        env.get("JAX_PROCESS_ID", env.get("SLURM_PROCID", "0")))
  except ValueError:
    raise ConfigError("JAX_NUM_PROCESSES / SLURM_NTASKS and JAX_PROCESS_ID / SLURM_PROCID "
                      "must be integers") from None
  # Under SLURM, jax.distributed finds the coordinator from the job's node list.
  if num > 1 and not coordinator and "SLURM_JOB_ID" not in env:
    raise ConfigError(f"dist.num_processes={num} needs dist.coordinator=host:port "
                      "(or JAX_COORDINATOR_ADDRESS)")
  if not 0 <= pid < num:
    raise ConfigError(f"dist.process_id={pid} must be in [0, dist.num_processes={num})")
  return coordinator, num, pid


def local_devices_needed(cfg: Config) -> int:
  """Devices this process must provide: stages x data over the processes."""
  _, num, _ = distributed_settings(cfg)
  return math.ceil(cfg.pipeline.stages * cfg.mesh.data / num)


def prepare_devices(cfg: Config) -> None:
  """Sets XLA_FLAGS for this run: emulated CPU devices, or XLA's flags for NVIDIA GPUs.

  Without a GPU: enough host (CPU) devices to emulate the mesh (the flag only
  adds CPU devices; on a GPU or TPU machine JAX still uses the accelerators).
  Where JAX will find NVIDIA GPUs (`accel.gpu_expected`): `accel.gpu_xla_flags`
  (the latency-hiding scheduler, the pipeline flags for a pipelined schedule,
  deterministic ops with run.deterministic); the CPU path gets none of them.
  A flag the user already put in XLA_FLAGS is kept, with its value.
  """
  need = local_devices_needed(cfg)
  flags = os.environ.get("XLA_FLAGS", "")
  if need > 1 and _COUNT_FLAG not in flags:
    flags = f"{flags} {_COUNT_FLAG}={need}".strip()
  if accel.gpu_expected():
    flags = accel.merge_xla_flags(flags, accel.gpu_xla_flags(
        deterministic=cfg.run.deterministic,
        pipelined=cfg.pipeline.schedule != "none" and cfg.pipeline.stages > 1))
  if flags:
    os.environ["XLA_FLAGS"] = flags


def start(cfg: Config) -> None:
  """Initialises `jax.distributed` for multi-process runs; checks the device count."""
  coordinator, num, pid = distributed_settings(cfg)
  import jax  # pylint: disable=g-import-not-at-top
  if cfg.run.compile_cache:
    accel.enable_compile_cache(cfg.run.compile_cache)
  if num > 1:
    if jax.config.jax_platforms in (None, "", "cpu") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
      # Cross-process collectives on CPU devices go through gloo.
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator:
      jax.distributed.initialize(coordinator_address=coordinator, num_processes=num,
                                 process_id=pid)
    else:
      jax.distributed.initialize()  # SLURM: everything from the job's environment
  check_devices(cfg, jax.devices())


def check_devices(cfg: Config, devices) -> None:
  """Raises ConfigError when the mesh needs more devices than `devices` holds."""
  need = cfg.pipeline.stages * cfg.mesh.data
  if need > len(devices):
    raise ConfigError(
        f"the mesh needs pipeline.stages x mesh.data = {cfg.pipeline.stages} x {cfg.mesh.data} = "
        f"{need} devices but {len(devices)} {devices[0].platform.upper()} devices are "
        "available; lower pipeline.stages or mesh.data")
