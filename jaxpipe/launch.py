"""Process start-up: emulated CPU devices and `jax.distributed`.

`prepare_devices` must run before JAX initialises its backend (it sets
XLA_FLAGS); `start` then joins a multi-process run when the config or the
environment asks for one, and checks that the mesh's devices exist.
"""

from __future__ import annotations

import math
import os

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
  """Asks XLA for enough host (CPU) devices to emulate the mesh if no accelerator exists.

  The flag only adds CPU devices; on a GPU or TPU machine JAX still uses the
  accelerators. A device count the user already put in XLA_FLAGS is kept.
  """
  need = local_devices_needed(cfg)
  flags = os.environ.get("XLA_FLAGS", "")
  if need > 1 and _COUNT_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={need}".strip()


def start(cfg: Config) -> None:
  """Initialises `jax.distributed` for multi-process runs; checks the device count."""
  coordinator, num, pid = distributed_settings(cfg)
  import jax  # pylint: disable=g-import-not-at-top
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
