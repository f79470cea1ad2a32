"""What the benchmark tools share: the model shape, a compiled schedule to time, the ceiling.

`tools/cpu/bench_pipeline.py` (the emulated mesh) and `tools/cpu/bench_two_core.py`
(pinned processes on two cores) both import this module and nothing of each
other's. `Runner` compiles one schedule's step with a fixed random batch;
`CeilingRunner` is the no-collective ceiling of the two-core measurement:
every device runs the one-device step on its own data, with nothing
exchanged. Both time a step (`step`) and account for a traced step's time
per device and phase (`account`, see `account.py` here).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import tempfile
import time
from typing import Any, Optional

from jaxpipe.pipeline import SCHEDULE_NAMES as SCHEDULES

COUNT_FLAG = "--xla_force_host_platform_device_count"
# What the benchmarks measure, by label: every schedule, interleaved as
# "interleaved vN" with N chunks per device (v=2 and 4, the shapes).
LABELS = tuple(n for n in SCHEDULES if n != "interleaved") + ("interleaved v2", "interleaved v4")


def parse_label(label: str) -> tuple[str, int]:
  """(schedule, chunks per device) of a benchmark label (`LABELS`): 'interleaved v4' -> 4."""
  name, _, chunks = label.partition(" v")
  if name not in SCHEDULES or (chunks and (name != "interleaved" or not chunks.isdigit())):
    raise ValueError(f"unknown schedule label {label!r}; choose from {', '.join(LABELS)}")
  if name == "interleaved" and not chunks:
    raise ValueError(f"{label!r}: say the chunks per device, e.g. 'interleaved v2'")
  return name, int(chunks or 1)


def refusal(label: str, num_stages: int, num_microbatches: int,
            layers: Optional[int] = None) -> Optional[str]:
  """Why `label` cannot run at this S and M (and block count, if given): one line, or None."""
  from jaxpipe.pipeline import check_virtual_stages, min_microbatches  # pylint: disable=g-import-not-at-top
  name, v = parse_label(label)
  if name == "none":
    return None
  if num_microbatches < min_microbatches(name, num_stages):
    return f"needs M >= {min_microbatches(name, num_stages)}"
  if layers is not None and layers % (num_stages * v):
    return f"needs the {layers} blocks in S x v = {num_stages * v} chunks"
  if v > 1:
    try:
      check_virtual_stages(name, num_stages, num_microbatches, v)
    except ValueError as e:
      return str(e)
  return None


def emulate_devices(count: int) -> None:
  """Asks XLA for `count` CPU devices; must run before JAX is imported.

  A device count already in XLA_FLAGS is kept when it is large enough. The
  benchmark measures the host's cores, so JAX runs on the CPU even where an
  accelerator exists (unless JAX_PLATFORMS says otherwise).
  """
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "").split()
  have = [f.split("=", 1)[1] for f in flags if f.startswith(COUNT_FLAG + "=")]
  if have and have[-1].isdigit() and int(have[-1]) >= count:
    return
  flags = [f for f in flags if not f.startswith(COUNT_FLAG)] + [f"{COUNT_FLAG}={count}"]
  os.environ["XLA_FLAGS"] = " ".join(flags)


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """The benchmark's model and batch (see docs/benchmark.md for the choice)."""
  dim: int = 256
  layers: int = 8
  heads: int = 4
  kv_heads: int = 2
  seq_len: int = 64
  micro_rows: int = 2   # sequences per microbatch; global batch = M * micro_rows
  vocab: int = 257      # 257: bytes; 50257: GPT-2's
  remat: str = "none"   # model.remat
  stash: str = "residuals"  # pipeline.stash
  head: str = "auto"        # pipeline.head


def make_config(shape: ModelShape, schedule: str, num_stages: int, num_microbatches: int,
                data: int = 1) -> Any:
  """A validated `jaxpipe.config.Config` for one benchmark point (D=`data` replicas).

  `schedule` is a label (`LABELS`): 'interleaved v2' sets pipeline.virtual_stages.
  """
  from jaxpipe import config as config_lib  # pylint: disable=g-import-not-at-top
  schedule, chunks = parse_label(schedule)
  tree = {
      # The CPU tuning's options and compile scope for the schedules, as a
      # train.py run with them gets (`tuning.schedule_options`, `compiling`).
      "run": {"dir": "runs/bench", "steps": 1000, "progress": False,
              "launch_hooks": "tools.cpu.tuning"},
      "data": {"batch_size": num_microbatches * shape.micro_rows * data,
               "seq_len": shape.seq_len},
      "model": {"vocab_size": shape.vocab, "dim": shape.dim, "n_layers": shape.layers,
                "n_heads": shape.heads, "n_kv_heads": shape.kv_heads, "remat": shape.remat},
      "mesh": {"data": data},
      "pipeline": {"schedule": schedule, "stages": 1 if schedule == "none" else num_stages,
                   "microbatches": num_microbatches, "stash": shape.stash,
                   "head": shape.head, "virtual_stages": chunks},
      "optimizer": {"name": "adamw", "lr": 1e-3, "schedule": "constant"},
  }
  cfg = config_lib.from_dict(tree)
  config_lib.validate(cfg)
  return cfg


@functools.lru_cache(maxsize=4)
def model_parts(shape: ModelShape, seed: int) -> tuple[Any, Any, Any]:
  """(the model, its StageFns, the optimizer) of the benchmark model, built once per shape."""
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  # The pieces `jaxpipe.trainer.make_run` makes, minus the token data.
  return trainer.components(make_config(shape, "none", 1, 1))


def _random_batch(shape: ModelShape, batch_shape: tuple, sharding: Any, seed: int):
  """(tokens, targets): random ids placed with `sharding` (every process draws the same)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(2):
    host = rng.integers(0, shape.vocab - 1, batch_shape, dtype=np.int32)
    out.append(jax.make_array_from_callback(batch_shape, sharding, lambda idx, h=host: h[idx]))
  return tuple(out)


class _Timed:
  """A compiled step with its state and batch: one step timed, or several accounted."""

  compiled: Any
  state: Any
  tokens: Any
  targets: Any
  mesh: Any = None   # the step's mesh, where its collectives name devices by place in it

  def _run(self):
    self.state, metrics = self.compiled(self.state, self.tokens, self.targets)
    return metrics

  def step(self) -> tuple[float, float]:
    """Runs one step; returns (wall seconds, process CPU seconds)."""
    import jax  # pylint: disable=g-import-not-at-top
    c0, t0 = time.process_time(), time.perf_counter()
    jax.block_until_ready((self._run(), self.state))
    return time.perf_counter() - t0, time.process_time() - c0

  def account(self, steps: int) -> dict[str, Any]:
    """The account of `steps` traced steps run back to back, per step on average.

    (`account.summarise`: each part's mean over the steps after the first.)
    """
    import jax  # pylint: disable=g-import-not-at-top

    import account  # pylint: disable=g-import-not-at-top
    with tempfile.TemporaryDirectory(prefix="jaxpipe-trace-") as trace_dir:
      done = account.profile_steps(self._run, jax.block_until_ready, steps, trace_dir)
      result = account.account(account.read_trace(trace_dir), self.compiled.as_text(), done,
                               account.partitions_of(self.mesh) if self.mesh else None)
    return account.summarise(result)


class Runner(_Timed):
  """One schedule, compiled, with its state and a fixed random batch."""

  def __init__(self, shape: ModelShape, schedule: str, num_stages: int, num_microbatches: int,
               *, seed: int = 0, compile_now: bool = True, data: int = 1):
    import jax  # pylint: disable=g-import-not-at-top
    from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
    from jaxpipe.pipeline import make_mesh  # pylint: disable=g-import-not-at-top

    self.name = schedule
    cfg = make_config(shape, schedule, num_stages, num_microbatches, data)  # validates the shape
    model, fns, optimizer = model_parts(shape, seed)
    mesh = self.mesh = make_mesh(cfg.pipeline.stages, data)
    self.schedule = trainer.schedule_from_config(cfg, fns, optimizer, mesh)
    batch_shape = (num_microbatches, shape.micro_rows * data, shape.seq_len)
    # Drawn in their shardings: every schedule starts from the same weights,
    # also when the devices belong to several processes.
    self.state = self.schedule.init_sharded(model.init, jax.random.key(seed), batch_shape)
    self.tokens, self.targets = _random_batch(shape, batch_shape,
                                              self.schedule.batch_sharding(), seed)
    self.lower_s = self.compile_s = self.compile_cpu_s = 0.0
    self.memory = None
    self.compiled = None
    if compile_now:
      self.compile()

  def compile(self) -> None:
    """Lowers and compiles the step, timing both, and reads XLA's memory analysis."""
    t0 = time.perf_counter()
    lowered = self.schedule.lower_step(self.state, self.tokens, self.targets)
    t1, c1 = time.perf_counter(), time.process_time()
    self.compiled = lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    # CPU seconds of the whole process (all of XLA's threads): what the
    # compilation cost, whatever share of the cores other processes took.
    self.lower_s, self.compile_s, self.compile_cpu_s = t1 - t0, t2 - t1, c2 - c1
    self.memory = self.compiled.memory_analysis()


class CeilingRunner(_Timed):
  """Each of `devices` devices runs the one-device step on its own batch, exchanging nothing.

  The one-device schedule's step function (`none`, the global batch as M
  microbatches of gradient accumulation, the optimizer update included) runs
  inside a `shard_map` over a mesh of these devices with a stacked copy of
  its state per device; no value crosses devices, so there is no collective.
  It is what the devices of one process give when nothing makes them wait
  for each other: the ceiling of a pipeline on them.
  """

  def __init__(self, shape: ModelShape, num_microbatches: int, devices: int, *, seed: int = 0):
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

    from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
    from jaxpipe.pipeline import make_mesh  # pylint: disable=g-import-not-at-top
    self.name = "ceiling"
    cfg = make_config(shape, "none", 1, num_microbatches)  # validates the shape
    model, fns, optimizer = model_parts(shape, seed)
    one = trainer.schedule_from_config(cfg, fns, optimizer, make_mesh(1, 1, jax.devices()[:1]))
    batch_shape = (num_microbatches, shape.micro_rows, shape.seq_len)
    state = one.init_sharded(model.init, jax.random.key(seed), batch_shape)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",),
                axis_types=(jax.sharding.AxisType.Auto,))
    split = NamedSharding(mesh, P("data"))
    self.state = jax.tree.map(
        lambda x: jax.device_put(np.stack([np.asarray(x)] * devices), split), state)
    self.tokens, self.targets = _random_batch(shape, (devices, *batch_shape), split, seed)

    def body(state, tokens, targets):
      own = jax.tree.map(lambda x: x[0], state)
      out = one._step_fn(own, tokens[0], targets[0])  # pylint: disable=protected-access
      return jax.tree.map(lambda x: x[None], out)

    # check_vma off: the one-device step knows no mesh axis, and nothing here
    # is reduced over one.
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data"),
                       check_vma=False)
    from tools.cpu import tuning  # pylint: disable=g-import-not-at-top
    with tuning.compiling():  # as the pipelines' steps are compiled
      self.compiled = jax.jit(fn, donate_argnums=0).lower(
          self.state, self.tokens, self.targets).compile()


def memory_row(stats: Any) -> dict[str, int]:
  """The fields of `CompiledMemoryStats` that the tables report, in bytes.

  XLA compiles one SPMD program for all devices, so these are per device.
  `resident` = arguments + outputs - aliased + temporaries: the donated state
  is reused for the new state, so aliased bytes are counted once.
  """
  row = {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
         "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes}
  row["resident"] = row["argument"] + row["output"] - row["alias"] + row["temp"]
  return row


def write(text: str, path: Optional[str], log) -> None:
  """Writes `text` to `path` (creating its folder) and logs it; nothing without a path."""
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      f.write(text)
    log(f"wrote {path}")


def two_cores(spec: str) -> tuple[str, str]:
  """The two different cores of `spec` ("0,1"), each one this process may run on.

  Raises ValueError with a one-line message otherwise.
  """
  cores = tuple(spec.split(","))
  try:
    usable = os.sched_getaffinity(0)
  except AttributeError:
    usable = set(range(os.cpu_count() or 1))
  if (len(cores) != 2 or not all(c.isdigit() for c in cores) or int(cores[0]) == int(cores[1])
      or not all(int(c) in usable for c in cores)):
    raise ValueError(f"--cores needs two different cores of {sorted(usable)}, got {spec!r}")
  return cores[0], cores[1]


def free_port() -> int:
  """A TCP port on loopback that nothing listens on now (for a jax.distributed coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
