"""Timing training steps of a real model shape on random tokens, on whatever devices exist.

The library behind `tools/bench_accel.py` and `tools/device_check.py`:

- `mesh_plan(...)`: for a device count, a model and the requested schedules,
  the stage count (one that divides the layers and the devices), each
  schedule's stage x data mesh and a global batch that splits into the
  microbatches and over every schedule's replicas; a bad combination is a
  ConfigError of one line.
- `measure(...)`: builds one schedule's state on its mesh, compiles the step
  (timed, with XLA's memory analysis), runs warm-up steps, times the rest
  and returns a `Row`: tokens/s, model TFLOP/s per device, MFU with causal
  and with full attention, hardware FLOP utilisation (`jaxpipe.accel.step_flops`).
- `format_table(rows)`: the rows as a Markdown table.

Nothing here reads token data: the tokens are random, so the numbers are
speed, not learning.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Optional, Sequence

from jaxpipe.errors import ConfigError

__all__ = ["MeshPlan", "mesh_plan", "Row", "measure", "format_table"]

# Chunks per device of the interleaved schedule when it is benchmarked.
INTERLEAVED_CHUNKS = 2

# Stages the automatic choice goes up to: deeper pipelines are a choice to
# make on purpose (--stages), with their microbatch counts.
MAX_AUTO_STAGES = 4


@dataclasses.dataclass(frozen=True)
class MeshPlan:
  """What a benchmark runs on the devices it has.

  Attributes:
    stages: S of the pipelined schedules (1 for `none`, which uses every
      device as a data replica).
    meshes: {schedule: (stages, data)}.
    batch: the global batch in sequences, the same for every schedule.
    microbatches: M.
  """
  stages: int
  meshes: dict[str, tuple[int, int]]
  batch: int
  microbatches: int


def mesh_plan(num_devices: int, n_layers: int, schedules: Sequence[str], *, microbatches: int,
              batch: int, stages: int = 0, max_stages: int = MAX_AUTO_STAGES,
              batch_fixed: bool = False) -> MeshPlan:
  """The stage count, meshes and batch for `schedules` on `num_devices` devices.

  Args:
    num_devices: devices available.
    n_layers: the model's blocks; a stage count must divide them.
    schedules: schedule names (validated here).
    microbatches: M per step.
    batch: the global batch in sequences. Unless `batch_fixed`, it is
      rounded up to the next multiple of M x (the largest data degree), so
      that every schedule's microbatch splits over its replicas.
    stages: S for the pipelined schedules; 0 picks the largest S up to
      `max_stages` that divides the layers and the device count and gives
      every pipelined schedule its minimum microbatches at M.
    max_stages: the automatic choice's ceiling.
    batch_fixed: refuse, rather than round, a batch that does not split.

  Raises:
    ConfigError: one line naming the option and the fix.
  """
  # pylint: disable-next=g-import-not-at-top
  from jaxpipe.pipeline import SCHEDULE_NAMES, min_microbatches
  if not schedules:
    raise ConfigError("--schedules is empty; give one or more of " + ", ".join(SCHEDULE_NAMES))
  for name in schedules:
    if name not in SCHEDULE_NAMES:
      raise ConfigError(f"unknown schedule '{name}'; choose from {', '.join(SCHEDULE_NAMES)}")
  if microbatches < 1 or batch < 1:
    raise ConfigError(f"--microbatches and --batch must be >= 1, got {microbatches} and {batch}")
  pipelined = [n for n in schedules if n != "none"]
  # Interleaved runs INTERLEAVED_CHUNKS chunks per device: S*v must divide
  # the layers and M must be a multiple of S.
  chunks = lambda n: INTERLEAVED_CHUNKS if n == "interleaved" else 1

  def fits(s: int) -> bool:
    return all(microbatches >= min_microbatches(n, s, chunks(n))
               and not n_layers % (s * chunks(n))
               and (chunks(n) == 1 or not microbatches % s) for n in pipelined)

  if stages:
    if n_layers % stages:
      raise ConfigError(f"{n_layers} layers do not split into --stages {stages}; choose a "
                        f"divisor of {n_layers}")
    if num_devices % stages:
      raise ConfigError(f"--stages {stages} does not divide the {num_devices} devices; choose "
                        f"a divisor of {num_devices}")
    for name in pipelined:
      need = min_microbatches(name, stages, chunks(name))
      if microbatches < need:
        raise ConfigError(f"{name} with {stages} stages needs --microbatches >= {need}")
      if name == "interleaved" and (microbatches % stages
                                    or n_layers % (stages * INTERLEAVED_CHUNKS)):
        raise ConfigError(f"interleaved ({INTERLEAVED_CHUNKS} chunks per device) with "
                          f"--stages {stages} needs --microbatches a multiple of {stages} and "
                          f"layers a multiple of {stages * INTERLEAVED_CHUNKS}")
  else:
    stages = max(s for s in range(1, min(max_stages, num_devices) + 1)
                 if not n_layers % s and not num_devices % s and fits(s))
  meshes = {n: (1, num_devices) if n == "none" else (stages, num_devices // stages)
            for n in schedules}
  # Every schedule's microbatch must split over its data replicas.
  unit = microbatches * math.lcm(*(d for _, d in meshes.values()))
  if batch % unit:
    if batch_fixed:
      degrees = ", ".join(f"{n} {d}" for n, (_, d) in meshes.items())
      raise ConfigError(f"--batch {batch} does not split into {microbatches} microbatches over "
                        f"the data replicas ({degrees}); give a multiple of {unit}")
    batch = unit * -(-batch // unit)
  return MeshPlan(stages, meshes, batch, microbatches)


@dataclasses.dataclass
class Row:
  """One schedule's measurement (see `measure`)."""
  schedule: str
  mesh: str
  devices: int
  kind: str
  attention: str
  batch: int
  compile_s: float
  step_s: float
  tokens_per_s: float
  tflops_per_device: float
  mfu: Optional[float]
  mfu_full: Optional[float]
  hfu: Optional[float]
  xla_gib: float
  loss: float


def _resolved(model_cfg: Any, rows: int, seq: int) -> tuple[Any, str, Optional[str]]:
  """(model config as it runs here, the attention implementation, a fallback note or None)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxpipe import model  # pylint: disable=g-import-not-at-top
  cfg, note = model.resolve_attention(model_cfg, rows, seq)
  impl = model.select_attention(cfg.attention, backend=model.attention_backend(),
                                dtype=jnp.dtype(cfg.compute_dtype), seq_len=seq,
                                head_dim=cfg.dim // cfg.n_heads)
  return cfg, impl, note


def measure(model_cfg: Any, opt_cfg: Any, schedule: str, mesh_shape: tuple[int, int], *,
            batch: int, seq: int, microbatches: int, steps: int, warmup: int = 2,
            stash: str = "inputs", peak: Optional[float] = None, devices=None, seed: int = 0,
            say=None, keep_params: bool = False):
  """Times `steps` steps of `schedule` on a (stages, data) mesh after `warmup` untimed ones.

  The state is built from `model_cfg` (vocab_size set) and `opt_cfg` as the
  trainer builds them, on random tokens; the step is compiled ahead of time
  (the compile time and XLA's resident bytes per device come from that) and
  the compiled program runs every step. The step time is the median of the
  timed steps, each waited for. `peak` is the per-device TFLOP/s for the
  utilisations (None: MFU and HFU are None). `say` receives the attention
  fallback's note, if any. Returns the `Row`, or with `keep_params` (Row,
  the trained weights in natural shapes).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxpipe import accel, config as config_lib, trainer  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import make_mesh  # pylint: disable=g-import-not-at-top

  s, d = mesh_shape
  rows = batch // microbatches // d
  model_cfg, impl, note = _resolved(model_cfg, rows, seq)
  if note and say is not None:
    say(note)
  # The run this measures, as a config: the schedule is built from it as
  # training builds it. The head is split over the stages whatever its size
  # (pipeline.head=vocab_parallel, not auto), as this benchmark's tables were
  # measured.
  cfg = config_lib.Config(
      data=config_lib.DataConfig(batch_size=batch, seq_len=seq), model=model_cfg,
      pipeline=config_lib.PipelineConfig(
          schedule=schedule, stages=s, microbatches=microbatches, stash=stash,
          virtual_stages=INTERLEAVED_CHUNKS if schedule == "interleaved" else 1,
          head="vocab_parallel"),
      mesh=config_lib.MeshConfig(data=d), optimizer=opt_cfg)
  model, fns, optimizer = trainer.components(cfg)
  devices = jax.devices() if devices is None else devices
  mesh = make_mesh(s, d, devices[:s * d])
  sch = trainer.schedule_from_config(cfg, fns, optimizer, mesh)
  shape = (microbatches, batch // microbatches, seq)
  state = sch.init_sharded(model.init, jax.random.key(seed), shape)
  rng = np.random.default_rng(seed)
  put = lambda x: jax.device_put(jnp.asarray(x, jnp.int32), sch.batch_sharding())

  def batch_at(_):
    t = rng.integers(0, model_cfg.vocab_size, shape[:2] + (seq + 1,))
    return put(t[..., :-1]), put(t[..., 1:])

  tok, tgt = batch_at(0)
  t0 = time.perf_counter()
  compiled = sch.lower_step(state, tok, tgt).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  xla_bytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes
               - mem.alias_size_in_bytes + mem.temp_size_in_bytes) if mem is not None else 0
  times, met = [], None
  for i in range(warmup + steps):
    tok, tgt = batch_at(i)
    t0 = time.perf_counter()
    state, met = compiled(state, tok, tgt)
    jax.block_until_ready(met["loss"])
    if i >= warmup:
      times.append(time.perf_counter() - t0)
  step_s = float(np.median(times))
  tokens_s = batch * seq / step_s
  flops = accel.step_flops(model_cfg, seq, schedule=schedule, stash=stash, stages=s,
                           attention=impl)
  per_device = lambda f: f * tokens_s / (s * d) / 1e12
  util = lambda f: per_device(f) / peak if peak else None
  row = Row(schedule=schedule, mesh=f"{s}x{d}", devices=s * d, kind=devices[0].device_kind,
            attention=impl, batch=batch, compile_s=compile_s, step_s=step_s,
            tokens_per_s=tokens_s, tflops_per_device=per_device(flops.model),
            mfu=util(flops.model), mfu_full=util(flops.model_full), hfu=util(flops.hardware),
            xla_gib=xla_bytes / 2 ** 30, loss=float(met["loss"]))
  return (row, sch.params(state)) if keep_params else row


def format_table(rows: Sequence[Row], peak: Optional[float] = None,
                 peak_memory_gib: Optional[float] = None) -> str:
  """The rows as a Markdown table, with a footer naming the device, the peak and the conventions."""
  pct = lambda x: f"{x:.1%}" if x is not None else "n/a"
  lines = ["| schedule | stage x data | attention | batch | step (s) | tokens/s "
           "| TFLOP/s per device | MFU | MFU, full attention | HFU | XLA GiB per device "
           "| compile (s) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    lines.append(f"| {r.schedule} | {r.mesh} | {r.attention} | {r.batch} | {r.step_s:.3f} "
                 f"| {r.tokens_per_s:,.0f} | {r.tflops_per_device:.3g} | {pct(r.mfu)} "
                 f"| {pct(r.mfu_full)} | {pct(r.hfu)} | {r.xla_gib:.2f} | {r.compile_s:.1f} |")
  if rows:
    lines.append("")
    lines.append(f"device: {rows[0].kind}; peak "
                 + (f"{peak:g} TFLOP/s (dense bf16)" if peak else
                    "unknown (give --peak-tflops for MFU)")
                 + (f"; peak memory of any device over the whole run {peak_memory_gib:.2f} GiB"
                    if peak_memory_gib is not None else ""))
    lines.append("MFU counts the model's FLOPs with causal attention (half the [T, T] "
                 "products); 'full attention' counts all of them (PaLM's 12LDT); HFU counts "
                 "what the devices compute, recomputation included (jaxpipe.accel.step_flops).")
  return "\n".join(lines)
