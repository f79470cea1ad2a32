"""Process start-up: emulated CPU devices, XLA's GPU flags and `jax.distributed`.

`prepare_devices` must run before JAX initialises its backend (it sets
XLA_FLAGS: the emulated CPU devices and `jaxpipe.accel`'s CPU flags, or on
NVIDIA GPUs its GPU flags); `start` then turns on the compilation cache (`run.compile_cache`),
joins a multi-process run when the config or the environment asks for one
(with this process's GPUs, `local_device_ids`, and the `dist.*` timeouts),
starts watching the other processes (`jaxpipe._watchdog.Peers`: a lost one
ends this one with one line and EXIT_LOST), starts JAX's backend and checks
that the mesh's devices exist.

`run.launch_hooks` names a module whose functions the launch calls on the
way (`Hooks`); the clone's `tools/cpu/tuning.py` is the one it was made
for: the CPU tuning of the two-core benchmark, which jaxpipe itself does
without.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
import sys
from types import ModuleType
from typing import Any, ContextManager, Mapping, Optional, Protocol

from jaxpipe import _watchdog
from jaxpipe import accel
from jaxpipe import config as config_lib
from jaxpipe.config import Config
from jaxpipe.errors import ConfigError

__all__ = ["prepare_devices", "start", "check_devices", "local_devices_needed",
           "distributed_settings", "local_device_ids", "watch_peers", "Hooks", "hooks",
           "schedule_options"]

_COUNT_FLAG = "--xla_force_host_platform_device_count"


class Hooks(Protocol):
  """What a `run.launch_hooks` module may define; the launch calls those it has, in this order.

  `prepare(cfg, local_devices)` before JAX starts (XLA_FLAGS are set, the
  backend is not); `backend_starting()` just before and `backend_started(cfg,
  devices, num_processes, process_id)` just after JAX starts its backend
  (`jax.distributed` joined, if it is a run of several processes);
  `schedule_options(name, options)` the `ScheduleOptions` a schedule of that
  name is built with, from the config's (`jaxpipe.launch.schedule_options`);
  `compile_scope()` a context the training step compiles in.
  """

  def prepare(self, cfg: Config, local_devices: int) -> None: ...
  def backend_starting(self) -> None: ...
  def backend_started(self, cfg: Config, devices: list, num_processes: int,
                      process_id: int) -> None: ...
  def schedule_options(self, name: str, options: Any) -> Any: ...
  def compile_scope(self) -> ContextManager: ...


def hooks(cfg: Config) -> Optional[ModuleType]:
  """The module `run.launch_hooks` names, imported; None where it names none.

  Raises ConfigError, in one line, where it cannot be imported.
  """
  name = cfg.run.launch_hooks
  if not name:
    return None
  try:
    return importlib.import_module(name)
  except (ImportError, TypeError, ValueError) as e:  # TypeError, ValueError: a relative name
    hint = (" (tools.cpu.tuning is in a clone of the repository: run its train.py)"
            if name.startswith("tools.") else "")
    raise ConfigError(f"run.launch_hooks={name}: cannot import it: {e}{hint}") from None


def _call(cfg: Config, name: str, *args: Any) -> None:
  fn = getattr(hooks(cfg), name, None)
  if fn is not None:
    fn(*args)


def schedule_options(cfg: Config, name: str, options: Any) -> Any:
  """`options` (a `jaxpipe.pipeline.ScheduleOptions`) as `run.launch_hooks`' module has them.

  Its `schedule_options(name, options)` where it has one, and its
  `compile_scope` as the options' own; without hooks, `options` unchanged.
  """
  module = hooks(cfg)
  if module is None:
    return options
  if hasattr(module, "schedule_options"):
    options = module.schedule_options(name, options)
  if hasattr(module, "compile_scope"):
    options = dataclasses.replace(options, compile_scope=module.compile_scope)
  return options


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
  deterministic ops with run.deterministic); elsewhere, for a run of one
  process, `accel.cpu_xla_flags` (XLA's CPU compiler ordering each program
  for memory). A flag the user already put in XLA_FLAGS is kept, with its
  value. Then `run.launch_hooks`' `prepare`.
  """
  # jaxlib's CUDA plugin on a machine without NVIDIA's driver (installed to
  # compile for GPUs here, `jaxpipe.gpu`): JAX runs on the CPU, quietly.
  accel.cpu_without_driver()
  need = local_devices_needed(cfg)
  flags = os.environ.get("XLA_FLAGS", "")
  if need > 1 and _COUNT_FLAG not in flags:
    flags = f"{flags} {_COUNT_FLAG}={need}".strip()
  if accel.gpu_expected():
    flags = accel.merge_xla_flags(flags, accel.gpu_xla_flags(
        deterministic=cfg.run.deterministic,
        pipelined=cfg.pipeline.schedule != "none" and cfg.pipeline.stages > 1))
  elif distributed_settings(cfg)[1] == 1:
    # One process only: with the flag, two processes of a 2bw run (gloo
    # collectives) that load their step from JAX's persistent compilation
    # cache hang in their first step (compiled afresh they do not; without
    # the flag they do neither), as tests/test_distributed.py showed.
    flags = accel.merge_xla_flags(flags, accel.cpu_xla_flags())
  if flags:
    os.environ["XLA_FLAGS"] = flags
  _call(cfg, "prepare", cfg, need)


def start(cfg: Config, guard: Optional[_watchdog.Guard] = None) -> _watchdog.Guard:
  """Initialises `jax.distributed` for multi-process runs, starts the backend, checks the devices.

  With several processes, `guard` (the command's `jaxpipe._watchdog.Guard`;
  a new one if None) learns which process this is and watches its peers
  (`watch_peers`); returns it. `run.launch_hooks`' `backend_starting` and
  `backend_started` come around the backend's start.
  """
  guard = guard or _watchdog.Guard()
  coordinator, num, pid = distributed_settings(cfg)
  import jax  # pylint: disable=g-import-not-at-top
  if cfg.run.compile_cache:
    accel.enable_compile_cache(cfg.run.compile_cache)
  if num > 1:
    if jax.config.jax_platforms in (None, "", "cpu") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
      # Cross-process collectives on CPU devices go through gloo.
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    ids = local_device_ids(cfg)
    if ids is not None:
      print(f"process {pid} of {num}: local_device_ids {','.join(map(str, ids))}",
            file=sys.stderr, flush=True)
    d = cfg.dist
    # JAX's own heartbeats abort the process with a stack dump on a loss:
    # they are the backstop, set late enough that ours (Peers) act first.
    timeouts = dict(initialization_timeout=d.init_timeout_s,
                    heartbeat_timeout_seconds=_watchdog.jax_heartbeat_timeout(
                        d.heartbeat_timeout_s),
                    shutdown_timeout_seconds=d.shutdown_timeout_s)
    if coordinator:
      jax.distributed.initialize(coordinator_address=coordinator, num_processes=num,
                                 process_id=pid, local_device_ids=ids, **timeouts)
    else:
      # SLURM: everything else from the job's environment.
      jax.distributed.initialize(local_device_ids=ids, **timeouts)
    watch_peers(cfg, guard)
  _call(cfg, "backend_starting")
  devices = jax.devices()  # gloo's I/O thread starts here
  _call(cfg, "backend_started", cfg, devices, num, pid)
  check_devices(cfg, devices)
  return guard


def watch_peers(cfg: Config, guard: _watchdog.Guard) -> None:
  """Ends this process with one line and EXIT_LOST when another one of the run is lost.

  Tells `guard` which process this is, then starts its `jaxpipe._watchdog.Peers`
  over the coordination service's key-value store (the client is
  `jax.distributed`'s own; without one, only the step watchdog guards the run).
  """
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  pid, num = jax_distributed.global_state.process_id, jax_distributed.global_state.num_processes
  guard.configure(cfg.run.dir, pid, num, cfg.dist.heartbeat_timeout_s)
  client = jax_distributed.global_state.client
  if client is not None:
    guard.watch_peers(client)


def check_devices(cfg: Config, devices) -> None:
  """Raises ConfigError when the mesh needs more devices than `devices` holds."""
  need = cfg.pipeline.stages * cfg.mesh.data
  if need > len(devices):
    raise ConfigError(
        f"the mesh needs pipeline.stages x mesh.data = {cfg.pipeline.stages} x {cfg.mesh.data} = "
        f"{need} devices but {len(devices)} {devices[0].platform.upper()} devices are "
        "available; lower pipeline.stages or mesh.data")


def _tasks_per_node(spec: str, node: int) -> Optional[int]:
  """Node `node`'s entry of SLURM's tasks-per-node list ('8(x2),4' is 8, 8, 4), or None."""
  counts = []
  for part in spec.split(","):
    m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
    if not m:
      return None
    counts += [int(m.group(1))] * int(m.group(2) or 1)
  return counts[node] if 0 <= node < len(counts) else None


def _local_rank(env: Mapping[str, str]) -> tuple[Optional[int], Optional[int]]:
  """(this process's rank among the processes of its node, how many there are) from the launcher."""
  try:
    if "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env:  # torchrun and its imitators
      return int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    if "SLURM_LOCALID" in env:
      node = int(env.get("SLURM_NODEID", "0"))
      for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if key in env:
          return int(env["SLURM_LOCALID"]), _tasks_per_node(env[key], node)
      if "SLURM_NTASKS_PER_NODE" in env:
        return int(env["SLURM_LOCALID"]), int(env["SLURM_NTASKS_PER_NODE"])
  except ValueError:
    raise ConfigError("LOCAL_RANK, LOCAL_WORLD_SIZE, SLURM_LOCALID, SLURM_NODEID and "
                      "SLURM_NTASKS_PER_NODE must be integers; or set dist.local_device_ids")
  return None, None


def _visible_gpus(env: Mapping[str, str]) -> Optional[int]:
  """GPUs this process can see, as the launcher set them (CUDA_VISIBLE_DEVICES, SLURM), or None."""
  if env.get("CUDA_VISIBLE_DEVICES", "").strip():
    return len(env["CUDA_VISIBLE_DEVICES"].split(","))
  if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
    return int(env["SLURM_GPUS_ON_NODE"])
  return None


def local_device_ids(cfg: Config, env: Optional[Mapping[str, str]] = None) -> Optional[list[int]]:
  """The GPUs (numbers among those this process sees) that `jax.distributed` gives this process.

  `dist.local_device_ids` when set. Otherwise from the launcher: with n
  processes on this node (torchrun's LOCAL_RANK of LOCAL_WORLD_SIZE, SLURM's
  SLURM_LOCALID of its tasks per node) and g GPUs visible (CUDA_VISIBLE_DEVICES,
  else SLURM_GPUS_ON_NODE), local rank r takes GPUs r*g/n .. (r+1)*g/n - 1;
  with fewer visible GPUs than processes the launcher has bound each process
  to its own, which it takes whole; with g unknown, GPU r. One process per
  node takes every visible GPU, listed: left unset, JAX's own SLURM detection
  would give each process GPU 0 only. None (JAX's default, which reads
  JAX_LOCAL_DEVICE_IDS) where JAX_LOCAL_DEVICE_IDS is set or nothing says.
  """
  explicit = config_lib.device_ids(cfg.dist.local_device_ids)
  if explicit is not None:
    return explicit
  env = os.environ if env is None else env
  if env.get("JAX_LOCAL_DEVICE_IDS"):
    return None
  rank, per_node = _local_rank(env)
  gpus = _visible_gpus(env)
  if rank is None or per_node is None or per_node <= 1:
    return list(range(gpus)) if gpus else None
  if gpus is None:
    return [rank]
  if gpus < per_node:
    return list(range(gpus))
  if gpus % per_node:
    raise ConfigError(f"{gpus} GPUs do not split evenly over the {per_node} processes of this "
                      "node; set dist.local_device_ids for each process")
  share = gpus // per_node
  return list(range(rank * share, (rank + 1) * share))
