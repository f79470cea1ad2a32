"""The training loop: joins config, data, model, optimizer, schedule and checkpoints.

`build(cfg)` makes every piece of a run from its config; `train(cfg)` runs it:
resume or start, then per step fetch a batch, run the schedule's jitted step,
log, evaluate, checkpoint; stop cleanly on SIGTERM/SIGINT; guard against
non-finite values. The loop is short on purpose; the work lives in the
packages it calls.

Files in `run.dir`:
  config.yaml    the resolved config (and the git commit that ran it)
  metrics.jsonl  {"step", "loss", "lr", "tokens", "step_time_s", ...} per batch,
                 {"step", "val_loss"} per evaluation (step = updates done)
  tb/            TensorBoard event files with the same scalars
  checkpoints/   orbax checkpoints (see jaxpipe.checkpoint)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from jaxpipe import config as config_lib
from jaxpipe import data as data_lib
from jaxpipe import launch
from jaxpipe import model as model_lib
from jaxpipe import optim
from jaxpipe.checkpoint import (LAYOUT_KEYS, RESUMABLE_KEYS, Checkpointer, check_compatible,
                                config_differences, path_key)
from jaxpipe.config import Config
from jaxpipe.errors import CheckpointError, ConfigError, DataError, InputError
from jaxpipe.pipeline import Schedule, StageFns, make_mesh, make_schedule

__all__ = ["Run", "build", "train", "EXIT_NONFINITE", "EXIT_INTERRUPTED"]

EXIT_NONFINITE = 3          # stopped on a non-finite loss or gradient (nan_policy=stop)
EXIT_INTERRUPTED = 128      # plus the signal number (130 for Ctrl-C, 143 for SIGTERM)


@dataclasses.dataclass
class Run:
  """Everything a run is made of, built from its config by `build`."""
  cfg: Config
  data: data_lib.TokenData
  model: model_lib.Model
  fns: StageFns
  optimizer: Any
  lr_schedule: Callable[[int], Any]
  mesh: jax.sharding.Mesh
  schedule: Schedule

  @property
  def batch_shape(self) -> tuple[int, int, int]:
    """(M, B/M, seq) of a global batch."""
    m = self.cfg.pipeline.microbatches
    return (m, self.cfg.data.batch_size // m, self.cfg.data.seq_len)


def open_data(cfg: Config) -> data_lib.TokenData:
  """Opens `data.path`, or the embedded corpus (built into the cache on first use)."""
  path = cfg.data.path or data_lib.prepare_embedded(cfg.data.corpus, cfg.data.tokenizer,
                                                    cfg.data.cache_dir)
  data = data_lib.open_tokens(path)
  for split in ("train", "val"):
    if split not in data.split_names:
      raise DataError(f"{data.path}: the dataset has no '{split}' split; rebuild it with "
                      "tools/prepare_data.py (it writes train and val)")
    data.num_sequences(split, cfg.data.seq_len)
  return data


def resolve_model(cfg: Config, data: data_lib.TokenData) -> Config:
  """Fills model.vocab_size and data.tokenizer from the data; refuses a vocabulary too small."""
  vocab = cfg.model.vocab_size or data.vocab_size
  if vocab < data.vocab_size:
    raise ConfigError(f"model.vocab_size={vocab} is smaller than the data's vocabulary "
                      f"({data.vocab_size}, tokenizer {data.tokenizer}); set model.vocab_size=0")
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
  if cfg.data.path:
    # A prepared dataset brings its own tokenizer: record that one, not the default.
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=data.tokenizer))
  return cfg


def stage_fns(model: model_lib.Model) -> StageFns:
  """The model as a pipeline sees it: embedding, blocks, logits and vocabulary layout."""
  return StageFns(embed=model.embed, stage=model.apply_blocks, logits=model.logits,
                  vocab_size=model.cfg.vocab_size, vocab_axes=model.vocab_axes,
                  prepare=model.compute_blocks, loss_chunk=model.cfg.loss_chunk)


def components(cfg: Config) -> tuple[model_lib.Model, StageFns, Any]:
  """The model, the functions a pipeline stage runs, and the optimizer of a config.

  `cfg.model.vocab_size` must be set (`resolve_model` fills it from the data).
  Tools that need no token data (the planner, the benchmarks) start here.
  """
  model = model_lib.build(cfg.model)
  return model, stage_fns(model), optim.build(cfg.optimizer, cfg.run.steps)


def build(cfg: Config, devices=None) -> Run:
  """Builds data, model, optimizer, mesh and schedule from a validated config."""
  data = open_data(cfg)
  cfg = resolve_model(cfg, data)
  model, fns, optimizer = components(cfg)
  lr_schedule = jax.jit(optim.learning_rate_schedule(cfg.optimizer, cfg.run.steps))
  p = cfg.pipeline
  devices = jax.devices() if devices is None else devices
  launch.check_devices(cfg, devices)
  mesh = make_mesh(p.stages, cfg.mesh.data, devices)
  schedule = make_schedule(p.schedule, fns, optimizer, mesh, p.microbatches, stash=p.stash,
                           shard_optimizer=cfg.mesh.shard_optimizer,
                           predict=optim.predicted_params if cfg.optimizer.weight_prediction else None)
  return Run(cfg, data, model, fns, optimizer, lr_schedule, mesh, schedule)


# Dense bfloat16 peak TFLOP/s per chip, by a substring of `device_kind`.
_PEAK_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("TPU v6", 918.0),
                ("TPU v5p", 459.0), ("TPU v5", 197.0), ("TPU v4", 275.0))


def device_peak_tflops(kind: str) -> Optional[float]:
  """Dense bfloat16 peak TFLOP/s of a known accelerator `device_kind`, else None."""
  return next((peak for name, peak in _PEAK_TFLOPS if name.lower() in kind.lower()), None)


def peak_tflops(cfg: Config) -> Optional[float]:
  """The per-device peak for MFU: run.peak_tflops, else a known accelerator's, else None."""
  return cfg.run.peak_tflops or device_peak_tflops(jax.devices()[0].device_kind)


def _git_commit() -> str:
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                         text=True, timeout=5)
    return out.stdout.strip() if out.returncode == 0 else "unknown"
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def _rows_of_process(sharding: jax.sharding.NamedSharding, shape) -> tuple[int, int]:
  """(shard_index, shard_count) of the row blocks this process's devices hold."""
  rows = shape[1]
  starts = sorted({idx[1].start or 0 for idx in
                   sharding.addressable_devices_indices_map(shape).values()})
  stops = sorted({idx[1].stop or rows for idx in
                  sharding.addressable_devices_indices_map(shape).values()})
  lo, hi = starts[0], stops[-1]
  size = hi - lo
  if rows % size or lo % size:
    raise ConfigError("this process's devices hold rows that are not one aligned block of "
                      "the batch; use a mesh whose 'data' axis splits evenly over processes")
  return lo // size, rows // size


class _Metrics:
  """metrics.jsonl (process 0 only) and TensorBoard scalars."""

  def __init__(self, run_dir: str, start_step: int, lag: int, enabled: bool):
    self.enabled = enabled
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self.val_steps: set[int] = set()  # evaluations already on file
    self._tb = None
    if not enabled:
      return
    self._truncate(start_step, lag)
    self._file = open(self.path, "a")
    try:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step)
    except ImportError:
      self._tb = None

  def _truncate(self, start_step: int, lag: int) -> None:
    # A resumed run rewrites what came after its checkpoint: training records
    # of batches it will report again, evaluations it will repeat; a run
    # that starts over (at step 0) rewrites everything.
    if not os.path.exists(self.path):
      return
    if start_step == 0:
      os.remove(self.path)
      return
    keep = []
    self.val_steps = set()
    with open(self.path) as f:
      for line in f:
        try:
          rec = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line cut short by a kill
        if "val_loss" in rec and rec["step"] <= start_step:
          keep.append(line)
          self.val_steps.add(rec["step"])
        elif "loss" in rec and rec["step"] < start_step - lag:
          keep.append(line)
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(l if l.endswith("\n") else l + "\n" for l in keep)
    os.replace(tmp, self.path)

  def write(self, record: dict[str, Any]) -> None:
    if not self.enabled:
      return
    # JSON has no NaN: a non-finite value is written as null.
    record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
              for k, v in record.items()}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)):
          group = "val" if key.startswith("val") else "train"
          self._tb.add_scalar(f"{group}/{key}", value, record["step"])

  def close(self) -> None:
    if self.enabled:
      self._file.close()
      if self._tb is not None:
        self._tb.close()


class _Profile:
  """A `jax.profiler` trace of steps START..STOP-1 (`run.profile=START:STOP`) in run.dir/profile."""

  def __init__(self, spec: str, run_dir: str, is_main: bool):
    self.window = config_lib.profile_window(spec)
    self.dir = os.path.join(run_dir, "profile")
    self.is_main = is_main
    self.active = False

  def before(self, step: int) -> None:
    """Starts the trace before step START is dispatched."""
    if self.window and step == self.window[0] and not self.active:
      jax.profiler.start_trace(self.dir)
      self.active = True

  def after(self, step: int) -> None:
    """Stops the trace once step STOP-1 has finished."""
    if self.active and step == self.window[1] - 1:
      self.close()

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      if self.is_main:
        _say(f"wrote a profile of steps {self.window[0]}-{self.window[1] - 1} to {self.dir} "
             "(open it with TensorBoard's profile plugin, xprof or Perfetto)")


def _meta(cfg: Config, step: int) -> dict[str, Any]:
  return {"config": config_lib.to_dict(cfg), "step": step, "jaxpipe_commit": _git_commit()}


def _say(msg: str) -> None:
  """Prints a message on stderr, above the progress bar if one is showing."""
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  tqdm.write(msg, file=sys.stderr)
  sys.stderr.flush()


def train(cfg: Config, *, require_resume: bool = False, devices=None) -> dict[str, Any]:
  """Trains according to `cfg`; returns a summary dict (and writes run.dir).

  Resumes from the newest checkpoint in `run.dir` if there is one (with a
  compatible config, possibly on another mesh); with none, starts at step 0,
  also over the records of an earlier attempt of the same config that
  stopped before its first checkpoint. `require_resume` makes a missing
  checkpoint an error. Raises InputError subclasses for bad input;
  KeyboardInterrupt on a second SIGINT/SIGTERM (without waiting for a save
  in progress); returns with summary["exit_code"] 0, EXIT_NONFINITE or
  EXIT_INTERRUPTED+signal.
  """
  run = build(cfg, devices)
  init_params = None
  if (run.cfg.model.init_from and not require_resume
      and not os.path.isdir(os.path.join(run.cfg.run.dir, "checkpoints"))):
    # Surely a fresh run: read model.init_from before anything is written, so
    # a bad directory leaves nothing in run.dir. With a checkpoints/
    # directory, _train decides (a resumed run never reads it).
    init_params = _read_init_from(run.cfg)
  os.makedirs(run.cfg.run.dir, exist_ok=True)
  ckpt = Checkpointer(os.path.join(run.cfg.run.dir, "checkpoints"),
                      keep=run.cfg.checkpoint.keep, async_save=run.cfg.checkpoint.async_save)
  abandon = False
  try:
    return _train(run, ckpt, require_resume, init_params)
  except KeyboardInterrupt:
    abandon = True  # stop now: a save in progress is left unfinished, and ignored later
    raise
  finally:
    if not abandon:
      ckpt.close()


def _earlier_config(run_dir: str) -> Optional[dict[str, Any]]:
  """The config.yaml an earlier attempt left in run_dir, or None."""
  try:
    with open(os.path.join(run_dir, "config.yaml")) as f:
      out = yaml.safe_load(f)
  except (OSError, yaml.YAMLError):
    return None
  return out if isinstance(out, dict) else None


def _check_fresh_start(run_dir: str, cfg: Config, ckpt: Checkpointer) -> bool:
  """Whether run_dir holds records of an earlier attempt to replace; raises if not ours.

  An attempt killed before its first checkpoint was committed leaves
  records and config.yaml but nothing to resume from; the same config starts
  over from step 0 (the run is deterministic, so nothing is lost but time).
  """
  path = os.path.join(run_dir, "metrics.jsonl")
  if not (os.path.exists(path) and os.path.getsize(path) > 0):
    return False
  earlier = _earlier_config(run_dir)
  diffs = (config_differences(earlier, config_lib.to_dict(cfg), RESUMABLE_KEYS | LAYOUT_KEYS)
           if earlier is not None else ["no config.yaml"])
  if diffs:
    shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
    raise CheckpointError(
        f"{run_dir} holds metrics of another run ({shown}) and no checkpoint in "
        f"{ckpt.directory} to resume from; choose a new run.dir, or delete that directory "
        "to start over")
  return True


def _saved_layout(run: Run, ckpt: Checkpointer, step: int,
                  saved: dict[str, Any]) -> tuple[int, int]:
  """(stages, data) checkpoint `step` was written on; refused if this schedule cannot continue it."""
  cfg = run.cfg
  s_old = saved.get("pipeline", {}).get("stages", cfg.pipeline.stages)
  d_old = saved.get("mesh", {}).get("data", cfg.mesh.data)
  if (s_old, d_old) != (cfg.pipeline.stages, cfg.mesh.data):
    try:
      run.schedule.check_relayout(s_old, d_old)
    except ValueError as e:
      raise CheckpointError(f"cannot resume {ckpt.directory}/{step}: {e}") from None
  return s_old, d_old


def _restore(run: Run, ckpt: Checkpointer, step: int, saved: dict[str, Any], state, rng):
  """Checkpoint `step` as (state, rng, data state), on this run's mesh whatever it was saved on."""
  cfg, schedule = run.cfg, run.schedule
  s_old, d_old = _saved_layout(run, ckpt, step, saved)
  if (s_old, d_old) == (cfg.pipeline.stages, cfg.mesh.data):
    (state, rng), data_state, _ = ckpt.restore(step, (state, rng))
    return state, rng, data_state
  shapes = ckpt.saved_shapes(step)
  keep = (schedule.restored_fields(state), True)
  abstract = {}
  for (path, x), wanted in zip(jax.tree_util.tree_flatten_with_path((state, rng))[0],
                               jax.tree.leaves(keep)):
    key = path_key(path)
    if not wanted:
      continue
    if key not in shapes:
      raise CheckpointError(f"checkpoint {ckpt.directory}/{step} has no array {key}; resume "
                            "with the config it was written with")
    # An array whose shape this mesh changes (a re-padded vocabulary) is read
    # whole onto every device, then fitted by the schedule.
    abstract[key] = jax.ShapeDtypeStruct(
        shapes[key], x.dtype,
        sharding=x.sharding if shapes[key] == x.shape else schedule.replicated())
  arrays, data_state = ckpt.restore_arrays(step, abstract)
  restored = jax.tree_util.tree_map_with_path(lambda p, x: arrays.get(path_key(p), x),
                                              (state, rng))
  try:
    new_state = schedule.relayout(restored[0], state)
  except ValueError as e:
    raise CheckpointError(f"cannot resume {ckpt.directory}/{step} on this mesh: {e}") from None
  if jax.process_index() == 0:
    _say(f"resharded the checkpoint from {s_old} stage(s) x {d_old} data to "
         f"{cfg.pipeline.stages} x {cfg.mesh.data}")
  return new_state, restored[1], data_state


def _read_init_from(cfg: Config) -> Any:
  """model.init_from's weights (numpy, natural shapes), checked against cfg.model."""
  from jaxpipe import hf  # pylint: disable=g-import-not-at-top
  try:
    return hf.load_params(cfg.model.init_from, cfg.model)
  except InputError as e:
    raise ConfigError(f"model.init_from: {e}") from None


def _initial_state(run: Run, params: Any, batch_shape):
  """The schedule's initial state around given weights (natural shapes, on the host)."""
  schedule = run.schedule
  params = schedule.pad(params)  # still on the host
  # Each device receives only its shard, straight from the host arrays.
  placed = jax.tree.map(
      lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]),
      params, schedule.param_shardings(params))
  return schedule.init(placed, batch_shape)


def _kill_at(point: Optional[tuple[str, int]], moment: str, step: int) -> None:
  """`run.debug_kill`: SIGKILL this process at the named moment (for tests of kills)."""
  if point == (moment, step):
    os.kill(os.getpid(), signal.SIGKILL)


def _train(run: Run, ckpt: Checkpointer, require_resume: bool,
           init_params: Any = None) -> dict[str, Any]:
  """The body of `train`, with the checkpointer it closes (and model.init_from's weights)."""
  cfg = run.cfg
  is_main = jax.process_index() == 0
  run_dir = cfg.run.dir
  kill = config_lib.kill_point(cfg.run.debug_kill)
  latest = ckpt.latest_step()
  restart = False
  if latest is None:
    if require_resume:
      raise CheckpointError(f"--resume: no checkpoint in {ckpt.directory}")
    restart = _check_fresh_start(run_dir, cfg, ckpt)
    meta = None
  else:
    meta = ckpt.read_meta(latest)
    check_compatible(meta.get("config", {}), config_lib.to_dict(cfg), ckpt.directory)
    if latest > cfg.run.steps:
      raise ConfigError(f"run.steps={cfg.run.steps} is below the newest checkpoint's step "
                        f"({latest}) in {ckpt.directory}; give run.steps >= {latest}")
    _saved_layout(run, ckpt, latest, meta.get("config", {}))  # before anything compiles

  need = cfg.pipeline.stages * cfg.mesh.data
  if is_main and need > 1 and jax.default_backend() == "cpu":
    _say(f"no accelerator found: emulating {need} devices on the CPU "
         f"({jax.local_device_count()} per process)")
  schedule, lag = run.schedule, run.schedule.loss_lag
  batch_shape = run.batch_shape
  if latest is None and cfg.model.init_from:
    state = _initial_state(run, init_params if init_params is not None
                           else _read_init_from(cfg), batch_shape)
    if is_main:
      _say(f"initialised the weights from {cfg.model.init_from}")
  else:
    state = schedule.init_sharded(run.model.init, jax.random.key(cfg.run.seed), batch_shape)
  # The run's RNG key, replicated over the mesh like the step counter.
  rng = jax.make_array_from_process_local_data(
      schedule.replicated(), np.asarray(jax.random.key_data(jax.random.key(cfg.run.seed))))

  sharding = schedule.batch_sharding()
  global_shape = batch_shape
  shard_index, shard_count = _rows_of_process(sharding, global_shape)
  it = data_lib.train_iterator(
      run.data, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
      num_microbatches=cfg.pipeline.microbatches, seed=cfg.run.seed,
      shard_index=shard_index, shard_count=shard_count)
  start = 0
  if latest is not None:
    state, rng, data_state = _restore(run, ckpt, latest, meta.get("config", {}), state, rng)
    it.set_state(data_state)
    start = latest
    if is_main:
      _say(f"resuming from {ckpt.directory}/{latest} (step {latest} of {cfg.run.steps})")
  elif restart and is_main:
    _say(f"no checkpoint in {ckpt.directory}: the earlier attempt stopped before its first "
         "one was saved; starting over from step 0")
  if is_main:
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
      f.write(f"# jaxpipe resolved config; commit {_git_commit()}\n")
      yaml.safe_dump(config_lib.to_dict(cfg), f, sort_keys=False)

  def to_global(x: np.ndarray) -> jax.Array:
    return jax.make_array_from_process_local_data(sharding, x, global_shape)

  eval_sets = [
      (to_global(b["tokens"]), to_global(b["targets"])) for b in data_lib.eval_batches(
          run.data, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
          num_microbatches=cfg.pipeline.microbatches, num_batches=cfg.eval.batches,
          shard_index=shard_index, shard_count=shard_count)]

  def evaluate(st) -> Optional[float]:
    if not eval_sets:
      return None
    return float(np.mean([float(schedule.eval_loss(st, *b)) for b in eval_sets]))

  log = _Metrics(run_dir, start, lag, is_main)
  tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
  # Useful model FLOPs per step, spread over every device of the mesh.
  flops_per_device = (model_lib.flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step
                      / (cfg.pipeline.stages * cfg.mesh.data))
  peak = peak_tflops(cfg)

  def speed(seconds: Optional[float]) -> dict[str, float]:
    if not seconds:
      return {}
    out = {"tokens_per_s": tokens_per_step / seconds,
           "tflops_per_device": flops_per_device / seconds / 1e12}
    if peak:
      out["mfu"] = out["tflops_per_device"] / peak
    return out

  step_times: dict[int, float] = {}
  summary: dict[str, Any] = {"exit_code": 0, "skipped": 0, "start_step": start,
                             "is_main": is_main}
  first_val = None
  if start == 0 and eval_sets:
    first_val = evaluate(state)
    log.write({"step": 0, "val_loss": first_val})

  def record(k: int, loss: float, extra: dict[str, Any]) -> None:
    # The rate comes out of float32 arithmetic: print its 7 significant digits.
    seconds = step_times.pop(k, None)
    rec = {"step": k, "loss": loss, "lr": float(f"{float(run.lr_schedule(k)):.7g}"),
           "tokens": (k + 1) * tokens_per_step, "step_time_s": seconds, **speed(seconds)}
    rec.update(extra)
    log.write(rec)
    summary["train_loss"] = loss
    summary["train_loss_step"] = k
    _kill_at(kill, "record", k)

  stop_signal = []

  def on_signal(signum, frame):
    del frame
    if stop_signal:  # a second signal: stop now
      raise KeyboardInterrupt
    stop_signal.append(signum)

  handlers = {}
  for sig in (signal.SIGTERM, signal.SIGINT):
    try:
      handlers[sig] = signal.signal(sig, on_signal)
    except ValueError:  # not the main thread: leave signals alone
      pass

  bar = None
  if is_main and cfg.run.progress:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=cfg.run.steps, initial=start, unit="step", dynamic_ncols=True,
               file=sys.stderr, desc=f"{cfg.pipeline.schedule}")

  saved_at = latest
  steady = [0, 0.0]  # steps after the first, and their seconds
  t_run = time.time()
  profile = _Profile(cfg.run.profile, run_dir, is_main)
  # With nan_policy=stop, step k+1 runs only if step k's update was finite:
  # it is queued before the host has read step k's metrics, and the state is
  # donated, so the device program itself keeps the last good state.
  halt = cfg.run.nan_policy == "stop"
  go = jax.device_put(np.asarray(True), schedule.replicated()) if halt else None
  clock = {"ready": None}

  def settle(k: int, met_dev: Any, dispatched: float) -> bool:
    """Reads step k's metrics (waiting for it), records them; False: stop (non-finite)."""
    met = jax.device_get(met_dev)
    now = time.time()
    # A step's time is the interval between two steps' completions, so time
    # the host spends between steps (and a stalled device) is counted.
    since = clock["ready"] if clock["ready"] is not None else dispatched
    step_times[k] = now - since
    clock["ready"] = now
    if k > start:  # the first step of a process includes compilation
      steady[0] += 1
      steady[1] += step_times[k]
    j = int(met["loss_step"])
    finite = bool(met["finite"])
    if not finite and cfg.run.nan_policy == "skip":
      summary["skipped"] += 1
    if j >= 0:
      record(j, float(met["loss"]), {"grad_norm": float(met["grad_norm"]),
                                     "skipped": summary["skipped"]})
    if not finite:
      where = _where_nonfinite(met, schedule.num_stages)
      if cfg.run.nan_policy == "stop":
        summary["stopped_at"] = (k, k - lag, where)
        return False
      _say(f"skipped the update of step {k}: non-finite loss or gradient of batch "
           f"{k - lag} {where} ({summary['skipped']} skipped so far)")
    if bar is not None:
      if j >= 0 and ((k + 1) % cfg.run.log_every == 0 or k + 1 == cfg.run.steps):
        fast = speed(step_times.get(k))
        bar.set_postfix(loss=f"{float(met['loss']):.4f}",
                        tok_s=f"{fast.get('tokens_per_s', 0):.0f}",
                        **({"mfu": f"{fast['mfu']:.1%}"} if "mfu" in fast else {}))
      bar.update(1)
    profile.after(k)
    return True

  def stop_nonfinite() -> None:
    # The step after the bad one did nothing (go was false), so `state` is
    # the last good state: the bad step's update was skipped.
    k, batch_k, where = summary["stopped_at"]
    ckpt.save(k + 1, (state, rng), it.get_state(), _meta(cfg, k + 1))
    ckpt.wait()
    _say(f"stopped: non-finite loss or gradient of batch {batch_k} (step {k}) {where}; "
         f"the last good state is saved as step {k + 1} in {ckpt.directory}")
    summary["exit_code"] = EXIT_NONFINITE

  pending = None  # (step, its metrics on the device, dispatch time)
  step = start
  try:
    for step in range(start, cfg.run.steps):
      batch = next(it)  # the host prepares batch k while the devices run step k-1
      if step == cfg.run.debug_nan_step:
        batch["targets"] = np.full_like(batch["targets"], -1)
      tokens, targets = to_global(batch["tokens"]), to_global(batch["targets"])
      profile.before(step)
      t0 = time.time()
      state, met = schedule.step(state, tokens, targets, go)
      if halt:
        go = met["finite"]
      previous, pending = pending, (step, met, t0)
      if previous is not None and not settle(*previous):
        pending = None
        stop_nonfinite()
        break
      done = step + 1
      if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.run.steps:
        log.write({"step": done, "val_loss": evaluate(state)})
      if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < cfg.run.steps:
        ckpt.save(done, (state, rng), it.get_state(), _meta(cfg, done))
        saved_at = done
        _kill_at(kill, "save", done)
      if stop_signal:
        ok, pending = settle(*pending), None
        if not ok:
          stop_nonfinite()
          break
        if saved_at != done:
          ckpt.save(done, (state, rng), it.get_state(), _meta(cfg, done))
        ckpt.wait()
        saved_at = done
        name = signal.Signals(stop_signal[0]).name
        _say(f"interrupted by {name} after step {done} of {cfg.run.steps}: checkpoint saved in "
             f"{ckpt.directory}; run the same command to resume")
        summary["exit_code"] = EXIT_INTERRUPTED + stop_signal[0]
        break
    else:
      if pending is not None and not settle(*pending):
        stop_nonfinite()
      else:
        # Every process runs the end of a run (evaluation is a collective), also
        # when a finished run is started again: its last reports are redone.
        done = cfg.run.steps
        if start == done and is_main:
          _say(f"the run in {run_dir} is already complete at step {done}; raise run.steps "
               "to continue it")
        pending_loss = schedule.pending_loss(state)
        if pending_loss is not None:
          # The last batch's gradient is still in flight: it has no norm yet.
          record(done - 1, float(pending_loss), {"grad_norm": None,
                                                 "skipped": summary["skipped"]})
        val = evaluate(state)
        if val is not None:
          if done not in log.val_steps:
            log.write({"step": done, "val_loss": val})
          summary["val_loss"] = val
        if saved_at != done:
          ckpt.save(done, (state, rng), it.get_state(), _meta(cfg, done))
          _kill_at(kill, "save", done)
  finally:
    profile.close()
    if bar is not None:
      bar.close()
    for sig, handler in handlers.items():
      signal.signal(sig, handler)
    log.close()

  elapsed = time.time() - t_run
  summary.update({"steps": cfg.run.steps, "elapsed_s": elapsed, "first_val_loss": first_val,
                  "tokens_per_s": steady[0] * tokens_per_step / steady[1] if steady[1] else 0.0,
                  "state": state, "run": run})
  if peak and steady[1]:
    summary["mfu"] = speed(steady[1] / steady[0])["mfu"]
  return summary


def _where_nonfinite(met: dict[str, Any], num_stages: int) -> str:
  bad = [s for s in range(num_stages) if not bool(np.asarray(met["stage_finite"])[s])]
  parts = []
  if bad:
    parts.append("in the blocks of stage " + ", ".join(map(str, bad)))
  if not bool(met["shared_finite"]):
    parts.append("in the embedding/head parameters (stage 0 / stage "
                 f"{num_stages - 1})")
  if not parts:
    parts.append("in the loss")
  return " and ".join(parts)


def format_summary(summary: dict[str, Any]) -> str:
  """The one-line end-of-run summary."""
  cfg = summary["run"].cfg
  parts = [f"jaxpipe {cfg.pipeline.schedule}",
           f"S={cfg.pipeline.stages} D={cfg.mesh.data} M={cfg.pipeline.microbatches}",
           f"{cfg.optimizer.name}"]
  if "train_loss" in summary:
    parts.append(f"train loss {summary['train_loss']:.4f} (batch {summary['train_loss_step']})")
  if summary.get("val_loss") is not None:
    first = summary.get("first_val_loss")
    parts.append(f"val loss {summary['val_loss']:.4f}"
                 + (f" (from {first:.4f})" if first is not None else ""))
  speed = ""
  if summary["tokens_per_s"]:
    speed = f", {summary['tokens_per_s']:,.0f} tokens/s after compilation" + (
        f", MFU {summary['mfu']:.1%}" if "mfu" in summary else "")
  parts.append(f"{summary['elapsed_s']:.1f} s{speed}")
  if summary["skipped"]:
    parts.append(f"{summary['skipped']} updates skipped")
  parts.append(f"run dir {cfg.run.dir}")
  return " | ".join(parts)
