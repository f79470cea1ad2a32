"""Process start-up: emulated CPU devices, XLA's GPU flags and `jax.distributed`.

`prepare_devices` must run before JAX initialises its backend (it sets
XLA_FLAGS: the emulated CPU devices and `jaxpipe.accel`'s CPU flags, or on
NVIDIA GPUs its GPU flags); `start` then turns on the compilation cache (`run.compile_cache`),
joins a multi-process run when the config or the environment asks for one
(with this process's GPUs, `local_device_ids`, and the `dist.*` timeouts),
starts watching the other processes (`jaxpipe._watchdog.Peers`: a lost one
ends this one with one line and EXIT_LOST), starts JAX's backend (on CPUs
with several processes, gloo's I/O thread idle-class: `idle_io_thread`),
and checks that the mesh's devices exist.
"""

from __future__ import annotations

import math
import os
import re
import sys
from typing import Mapping, Optional

from jaxpipe import _watchdog
from jaxpipe import accel
from jaxpipe import config as config_lib
from jaxpipe.config import Config
from jaxpipe.errors import ConfigError

__all__ = ["prepare_devices", "start", "check_devices", "local_devices_needed",
           "distributed_settings", "local_device_ids", "watch_peers", "idle_io_thread",
           "one_malloc_arena"]

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
  deterministic ops with run.deterministic); elsewhere, for a run of one
  process, `accel.cpu_xla_flags` (XLA's CPU compiler ordering each program
  for memory). Without a GPU it also sets glibc's malloc options
  (`accel.tune_cpu_malloc`), so that the devices' buffers of one step do
  not page-fault again in the next; one malloc arena for every thread where
  the process has one device, or as `run.cpu_malloc_arenas` says.
  A flag the user already put in XLA_FLAGS is kept, with its value, and so
  is malloc's behaviour where the environment sets it.
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
  else:
    # The devices' buffers are the host's memory, from malloc. One arena keeps
    # blocks of any size but makes the devices' threads of one process take
    # turns at its lock (docs/benchmark.md, "Page faults"): by default for one
    # device only.
    accel.tune_cpu_malloc(one_arena=one_malloc_arena(cfg.run.cpu_malloc_arenas, need))
    if distributed_settings(cfg)[1] == 1:
      # One process only: with the flag, two processes of a 2bw run (gloo
      # collectives) that load their step from JAX's persistent compilation
      # cache hang in their first step (compiled afresh they do not; without
      # the flag they do neither), as tests/test_distributed.py showed.
      flags = accel.merge_xla_flags(flags, accel.cpu_xla_flags())
  if flags:
    os.environ["XLA_FLAGS"] = flags


def one_malloc_arena(choice: str, local_devices: int) -> bool:
  """Whether a CPU process of `local_devices` devices gets one malloc arena.

  `choice` is a value of `run.cpu_malloc_arenas`. `auto`: where it has one
  device (no other device's thread to share the arena's lock with); `one`
  and `per_thread` say it outright.
  """
  if choice not in config_lib.CPU_ARENAS:
    raise ValueError(f"malloc arenas must be one of {', '.join(config_lib.CPU_ARENAS)}, "
                     f"got {choice!r}")
  return choice == "one" or (choice == "auto" and local_devices == 1)


def usable_cores() -> Optional[int]:
  """The cores this process may run on (its CPU affinity), or None where that is unknown."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def split_cpu_ops(choice: str, local_devices: int, cores: Optional[int]) -> bool:
  """Whether XLA's CPU compiler may partition a loop operation over the process's threads.

  `choice` is a value of `run.cpu_split_ops`. `auto`: only where the process
  may use more cores than it has devices (one device on a many-core host
  gains from it), or where its cores are unknown (None); where every core
  runs a device, a partitioned operation waits for a thread busy with
  another device (`jaxpipe.accel.compiling`). The cores are the process's
  CPU affinity, not a cgroup's CPU quota.
  """
  if choice not in config_lib.CPU_SPLIT_OPS:
    raise ValueError(f"run.cpu_split_ops must be one of {', '.join(config_lib.CPU_SPLIT_OPS)}, "
                     f"got {choice!r}")
  if choice != "auto":
    return choice == "always"
  return cores is None or cores > local_devices


def start(cfg: Config, guard: Optional[_watchdog.Guard] = None) -> _watchdog.Guard:
  """Initialises `jax.distributed` for multi-process runs, starts the backend, checks the devices.

  With several processes, `guard` (the command's `jaxpipe._watchdog.Guard`;
  a new one if None) learns which process this is and watches its peers
  (`watch_peers`); returns it. On CPUs with several processes, gloo's I/O
  thread may be made idle-class (`idle_io_thread`).
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
  # On CPUs, each device of the process is one of its threads: whether a
  # loop operation may also be partitioned over them (`split_cpu_ops`; the
  # backend ignores it for devices of another platform).
  split = split_cpu_ops(cfg.run.cpu_split_ops, local_devices_needed(cfg), usable_cores())
  devices, new_threads = accel.start_backend(split_ops=split)  # gloo's I/O thread starts here
  if num > 1 and cfg.dist.idle_io_thread and devices[0].platform == "cpu":
    idle_io_thread(new_threads, len(jax.local_devices()), pid)
  check_devices(cfg, devices)
  return guard


def idle_io_thread(new_threads: set[int], local_devices: int, pid: int) -> list[int]:
  """Runs gloo's I/O thread idle-class where every core this process may use serves a device.

  `new_threads`: the threads that appeared while JAX's CPU backend started
  (`accel.start_backend`). Where the process may use more cores than it
  has devices, the I/O thread has a core to itself and is left alone. The
  thread is the one of them found waiting in epoll; where there are none or
  several, none is changed. Says on stderr what it did; returns the ids
  set idle-class. On a core that another process keeps busy an idle-class
  thread waits for it; `dist.idle_io_thread=false` turns this off.
  """
  cores = usable_cores()
  if cores is None or cores > local_devices:
    return []
  found = accel.epoll_threads(new_threads)
  done = accel.make_idle_class(found) if len(found) == 1 else []
  if done:
    print(f"process {pid}: gloo's I/O thread {done[0]} runs idle-class ({cores} "
          f"core{'s' if cores > 1 else ''} for {local_devices} device"
          f"{'s' if local_devices > 1 else ''}; dist.idle_io_thread)", file=sys.stderr, flush=True)
  else:
    print(f"process {pid}: gloo's I/O thread left at the normal class ({len(found)} of the "
          "backend's new threads wait in epoll, where one was expected)",
          file=sys.stderr, flush=True)
  return done


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
