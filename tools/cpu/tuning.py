"""The CPU tuning behind the two-core figures: glibc's malloc, compilation on one core, gloo's I/O thread.

Not part of jaxpipe: a module of launch hooks (`jaxpipe.launch.Hooks`) that
`train.py` applies when told to, from a clone of the repository:

  python train.py --config configs/tiny.yaml run.launch_hooks=tools.cpu.tuning

(`tools/cpu/bench_train_steps.py` runs every configuration so). On a CPU it

- sets glibc's malloc options before JAX starts (`tune_cpu_malloc`), so that
  XLA's buffers of one step do not page-fault again in the next;
- compiles the training step with every thread of the process on one core
  where every core runs a device (`compiling`), so that XLA's CPU compiler
  partitions no loop operation over threads that another device keeps busy;
- carries gpipe's and zb1's stash rings in the state (`schedule_options`),
  so that a step does not map and fault in a large block afresh;
- puts gloo's I/O thread in Linux's idle class in a run of several
  processes with a core per device (`idle_io_thread`).

Environment variables choose what the config keys of earlier releases chose:
JAXPIPE_CPU_ARENAS (`auto`, `one`, `per_thread`: `one_malloc_arena`),
JAXPIPE_CPU_SPLIT_OPS (`auto`, `always`, `never`: `split_cpu_ops`) and
JAXPIPE_CPU_IO_THREAD (`normal` leaves gloo's thread alone). On NVIDIA GPUs
the hooks do nothing. docs/benchmark.md measures what each gives.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
import threading
import time
from typing import Any, Collection, Mapping, Optional

ARENA_ENV = "JAXPIPE_CPU_ARENAS"
SPLIT_ENV = "JAXPIPE_CPU_SPLIT_OPS"
IO_THREAD_ENV = "JAXPIPE_CPU_IO_THREAD"
ARENA_CHOICES = ("auto", "one", "per_thread")
SPLIT_CHOICES = ("auto", "always", "never")

# What the hooks learnt between prepare and backend_started: the threads
# before JAX's backend started, and the cores compilation is pinned to
# (None: XLA compiles as it will). One process, one launch.
_STATE: dict[str, Any] = {"threads_before": set(), "compile_cores": None, "cpu": False}


# --- the hooks (jaxpipe.launch.Hooks) -------------------------------------------


def prepare(cfg: Any, local_devices: int) -> None:
  """Before JAX starts: glibc's malloc tuned for this process's devices, where JAX will not find NVIDIA GPUs."""
  from jaxpipe import accel  # pylint: disable=g-import-not-at-top
  if not accel.gpu_expected():
    tune_cpu_malloc(one_arena=one_malloc_arena(_choice(ARENA_ENV, ARENA_CHOICES), local_devices))


def backend_starting() -> None:
  """Just before JAX starts its backend: the threads there are, to tell the backend's own."""
  _STATE["threads_before"] = thread_ids()


def backend_started(cfg: Any, devices: list, num_processes: int, process_id: int) -> None:
  """After: compilation pinned where every core runs a device; gloo's thread idle-class."""
  del cfg
  new_threads = thread_ids() - _STATE["threads_before"]
  import jax  # pylint: disable=g-import-not-at-top
  local = len(jax.local_devices())
  cpu = bool(devices) and devices[0].platform == "cpu"
  _note_backend(devices, split_ops=not cpu or split_cpu_ops(_choice(SPLIT_ENV, SPLIT_CHOICES),
                                                            local, usable_cores()))
  if not cpu:
    return
  if num_processes > 1 and os.environ.get(IO_THREAD_ENV) != "normal":
    idle_io_thread(new_threads, local, process_id)


def compile_scope():
  """The context the training step compiles in (`compiling`)."""
  return compiling()


# gpipe's ring of M+1 slots made its step's temporaries a block a thread's
# malloc arena cannot hold (76 MiB on the benchmark's shape, S=2, M=8), and
# zb1's two rings 85 MiB: mapped and faulted in afresh every step. Kept in
# the state, 32 and 35 MiB. (1f1b's and interleaved's stay in their steps:
# kept, XLA copied 1f1b's at the tick loops' ends, its step growing from 154
# to 236 MB under XLA's default CPU order; interleaved's step, under 64 MiB
# of temporaries either way, was no faster.)
RINGS_IN_STATE = ("gpipe", "zb1")


def schedule_options(name: str, options: Any) -> Any:
  """On CPUs, gpipe's and zb1's stash rings carried in the state (`RINGS_IN_STATE`)."""
  if _STATE.get("cpu") and name in RINGS_IN_STATE:
    import dataclasses  # pylint: disable=g-import-not-at-top
    return dataclasses.replace(options, rings_in_state=True)
  return options


def _choice(env: str, choices: tuple[str, ...]) -> str:
  """The environment's choice for `env` ("auto" where unset); ConfigError, in one line, if bad."""
  from jaxpipe.errors import ConfigError  # pylint: disable=g-import-not-at-top
  value = os.environ.get(env, "auto")
  if value not in choices:
    raise ConfigError(f"{env} must be one of {', '.join(choices)}, got {value!r}")
  return value


def one_malloc_arena(choice: str, local_devices: int) -> bool:
  """Whether a CPU process of `local_devices` devices gets one malloc arena.

  `choice`: `auto` gives one where the process has one device (no other
  device's thread to share the arena's lock with); `one` and `per_thread`
  say it outright.
  """
  if choice not in ARENA_CHOICES:
    raise ValueError(f"malloc arenas must be one of {', '.join(ARENA_CHOICES)}, got {choice!r}")
  return choice == "one" or (choice == "auto" and local_devices == 1)


def usable_cores() -> Optional[int]:
  """The cores this process may run on (its CPU affinity), or None where that is unknown."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def split_cpu_ops(choice: str, local_devices: int, cores: Optional[int]) -> bool:
  """Whether XLA's CPU compiler may partition a loop operation over the process's threads.

  `choice`: `auto` only where the process may use more cores than it has
  devices (one device on a many-core host gains from it), or where its
  cores are unknown (None); where every core runs a device, a partitioned
  operation waits for a thread busy with another device (`compiling`). The
  cores are the process's CPU affinity, not a cgroup's CPU quota.
  """
  if choice not in SPLIT_CHOICES:
    raise ValueError(f"split ops must be one of {', '.join(SPLIT_CHOICES)}, got {choice!r}")
  if choice != "auto":
    return choice == "always"
  return cores is None or cores > local_devices


def start_backend(*, split_ops: bool = True) -> tuple[list[Any], set[int]]:
  """Starts JAX's backend as the hooks see it: (`jax.devices()`, the threads it started).

  For the benchmarks' own workers, which start JAX without `jaxpipe.launch`.
  With `split_ops=False` and CPU devices, programs compiled from then on
  inside `compiling()` have no loop operation partitioned over the threads.
  """
  import jax  # pylint: disable=g-import-not-at-top
  before = thread_ids()
  devices = jax.devices()
  _note_backend(devices, split_ops=split_ops)
  return devices, thread_ids() - before


def _note_backend(devices: list, *, split_ops: bool) -> None:
  """Notes whether `devices` are CPUs and, if so and not `split_ops`, the cores `compiling` pins to."""
  cpu = bool(devices) and devices[0].platform == "cpu"
  _STATE["cpu"] = cpu
  _STATE["compile_cores"] = (frozenset(os.sched_getaffinity(0))
                             if not split_ops and cpu and hasattr(os, "sched_getaffinity")
                             else None)


def idle_io_thread(new_threads: set[int], local_devices: int, pid: int) -> list[int]:
  """Runs gloo's I/O thread idle-class where every core this process may use serves a device.

  `new_threads`: the threads that appeared while JAX's CPU backend started.
  Where the process may use more cores than it has devices, the I/O thread
  has a core to itself and is left alone. The thread is the one of them
  found waiting in epoll; where there are none or several, none is
  changed. Says on stderr what it did; returns the ids set idle-class. On a
  core that another process keeps busy an idle-class thread waits for it.
  """
  cores = usable_cores()
  if cores is None or cores > local_devices:
    return []
  found = epoll_threads(new_threads)
  done = make_idle_class(found) if len(found) == 1 else []
  if done:
    print(f"process {pid}: gloo's I/O thread {done[0]} runs idle-class ({cores} "
          f"core{'s' if cores > 1 else ''} for {local_devices} device"
          f"{'s' if local_devices > 1 else ''}; {IO_THREAD_ENV})", file=sys.stderr, flush=True)
  else:
    print(f"process {pid}: gloo's I/O thread left at the normal class ({len(found)} of the "
          "backend's new threads wait in epoll, where one was expected)",
          file=sys.stderr, flush=True)
  return done


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
# so `prepare` gives one arena (ONE_ARENA) to a process of one device
# unless JAXPIPE_CPU_ARENAS says otherwise. It holds for threads that
# allocate for the first time after it is set, which is why `prepare` sets
# it before JAX starts its backend. docs/benchmark.md measures each.
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
# collective alone"; the policy: `idle_io_thread`).
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


# `compiling`'s pins, shared by nested and concurrent uses: how deep they
# are, and each thread's cores before the outermost (restored when it ends).
_PINNED = {"depth": 0, "saved": {}}
_PIN_LOCK = threading.Lock()


@contextlib.contextmanager
def compiling():
  """Where `backend_started` found every core serving a device: XLA compiles in
  here without partitioning any loop operation over the threads.

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
  cores = _STATE["compile_cores"]
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
