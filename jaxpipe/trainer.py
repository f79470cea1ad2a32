"""The training loop: joins config, data, model, optimizer, schedule and checkpoints.

`make_run(cfg)` makes every piece of a run from its config; `train(cfg)` runs it:
resume or start, then per step fetch a batch, run the schedule's jitted step,
log, evaluate, checkpoint; stop cleanly on SIGTERM/SIGINT; guard against
non-finite values. The loop (`_train`) is short on purpose: each concern it
calls is a named piece of `jaxpipe._loop`, and the work lives in the packages
those call.

Files in `run.dir`:
  config.yaml    the resolved config (and the git commit that ran it)
  metrics.jsonl  {"step", "loss", "lr", "tokens", "epoch", "step_time_s", ...} per batch,
                 {"step", "val_loss"} per evaluation (step = updates done)
  tb/            TensorBoard event files with the same scalars
  checkpoints/   orbax checkpoints (see jaxpipe.checkpoint)
  device_memory.json  each device's peak memory at the end, where the devices
                 report it (GPUs, TPUs); device_memory.P.json for process P of several
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np
import yaml

from jaxpipe import _loop
from jaxpipe import _watchdog
from jaxpipe import accel
from jaxpipe import config as config_lib
from jaxpipe import data as data_lib
from jaxpipe import launch
from jaxpipe import model as model_lib
from jaxpipe import optim
from jaxpipe.checkpoint import (LAYOUT_KEYS, RESUMABLE_KEYS, Checkpointer, check_compatible,
                                config_differences, path_key)
from jaxpipe.config import Config
from jaxpipe.errors import CheckpointError, ConfigError, DataError, InputError
from jaxpipe.pipeline import (Schedule, StageFns, axes_across_nodes, expert_exchange, make_mesh,
                              make_schedule)

__all__ = ["Run", "make_run", "train", "schedule_change", "EXIT_NONFINITE", "EXIT_INTERRUPTED",
           "EXIT_SIGNAL", "EXIT_LOST"]

# Exit statuses (2, bad input, is every command's: jaxpipe.errors). A requeue
# loop must tell a stop that saved from one that did not, so they differ:
EXIT_NONFINITE = 3          # stopped on a non-finite loss or gradient (nan_policy=stop)
# SIGTERM/SIGINT stopped the run after a checkpoint was saved: rerun the same
# command to resume. sysexits.h's EX_TEMPFAIL ("a temporary failure: try
# again"), which is what a preemption is; below 128, so no shell or scheduler
# reads it as a death by a signal.
EXIT_INTERRUPTED = 75
# Plus the signal number (130 for Ctrl-C, 143 for SIGTERM): a second signal
# stopped the run at once, without saving (the next start resumes from the
# checkpoint before). As a shell reports a death by that signal, since that
# is what it was.
EXIT_SIGNAL = 128
# 69 (sysexits' EX_UNAVAILABLE): a process of a multi-process run was lost
# (killed, stopped, or a step made no progress for dist.step_timeout_s) and
# this one stopped at once without saving; rerun the same command on every
# process to resume from the newest checkpoint. Why 69: jaxpipe._watchdog.
EXIT_LOST = _watchdog.EXIT_LOST


@dataclasses.dataclass
class Run:
  """Everything a run is made of, built from its config by `make_run`."""
  cfg: Config
  data: data_lib.TokenData
  model: model_lib.Model
  fns: StageFns
  optimizer: Any
  lr_schedule: Callable[[Any], Any]
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
                  prepare=model.compute_blocks, loss_chunk=model.cfg.loss_chunk,
                  expert_axes=model.expert_axes)


def components(cfg: Config) -> tuple[model_lib.Model, StageFns, Any]:
  """The model, the functions a pipeline stage runs, and the optimizer of a config.

  `cfg.model.vocab_size` must be set (`resolve_model` fills it from the data).
  Tools that need no token data (the planner, the benchmarks) start here.
  The model is built with the pipeline's `expert_exchange`: a
  Mixture-of-Experts layer that a pipeline gives a slice of the experts sends
  tokens to them over 'data'.
  """
  model = model_lib.make_model(cfg.model, exchange=expert_exchange)
  return model, stage_fns(model), optim.make_optimizer(cfg.optimizer, cfg.run.steps)


def resolve_attention(cfg: Config) -> Config:
  """cfg with model.attention as it runs here; `auto` on a GPU tries cuDNN once on the run's shapes.

  If cuDNN fails there, `auto` becomes `blockwise` and process 0 says why in
  one line (`jaxpipe.model.resolve_attention`); an explicit `cudnn` that fails
  is a ConfigError.
  """
  rows = cfg.data.batch_size // cfg.pipeline.microbatches // cfg.mesh.data
  model, note = model_lib.resolve_attention(cfg.model, rows, cfg.data.seq_len)
  if note and jax.process_index() == 0:
    _say(note)
  return dataclasses.replace(cfg, model=model)


def _mesh(cfg: Config, devices) -> jax.sharding.Mesh:
  """The run's mesh laid out by mesh.layout; says which axes cross nodes when there are several."""
  try:
    mesh = make_mesh(cfg.pipeline.stages, cfg.mesh.data, devices, layout=cfg.mesh.layout)
  except ValueError as e:
    raise ConfigError(f"mesh.layout={cfg.mesh.layout}: {e}") from None
  across = axes_across_nodes(mesh.devices)
  if across and jax.process_index() == 0:
    _say(f"mesh stage x data = {cfg.pipeline.stages} x {cfg.mesh.data}: "
         f"{' and '.join(across)} across nodes (mesh.layout={cfg.mesh.layout})")
  return mesh


def make_run(cfg: Config, devices=None) -> Run:
  """Builds data, model, optimizer, mesh and schedule from a validated config."""
  data = open_data(cfg)
  cfg = resolve_attention(resolve_model(cfg, data))
  model, fns, optimizer = components(cfg)
  lr_schedule = optim.learning_rate_schedule(cfg.optimizer, cfg.run.steps)
  p = cfg.pipeline
  devices = jax.devices() if devices is None else devices
  launch.check_devices(cfg, devices)
  mesh = _mesh(cfg, devices)
  schedule = make_schedule(p.schedule, fns, optimizer, mesh, p.microbatches, stash=p.stash,
                           shard_optimizer=cfg.mesh.shard_optimizer,
                           expert_parallel=cfg.mesh.expert_parallel,
                           vocab_parallel=config_lib.vocab_parallel(cfg.model, p),
                           predict=optim.predicted_params if cfg.optimizer.weight_prediction else None)
  return Run(cfg, data, model, fns, optimizer, lr_schedule, mesh, schedule)


def device_peak_tflops(kind: str) -> Optional[float]:
  """Dense bfloat16 peak TFLOP/s of the accelerator whose device kind is `kind`, else None.

  The name must match exactly (`jaxpipe.accel.PEAK_TFLOPS`).
  """
  return accel.device_peak_tflops(kind)


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


def _meta(cfg: Config, step: int) -> dict[str, Any]:
  return {"config": config_lib.to_dict(cfg), "step": step, "jaxpipe_commit": _git_commit()}


_say = _loop.say


def train(cfg: Config, *, require_resume: bool = False, devices=None) -> dict[str, Any]:
  """Trains according to `cfg`; returns a summary dict (and writes run.dir).

  Resumes from the newest checkpoint in `run.dir` if there is one (with a
  compatible config, possibly on another mesh); with none, starts at step 0,
  also over the records of an earlier attempt of the same config that
  stopped before its first checkpoint. `require_resume` makes a missing
  checkpoint an error. Raises InputError subclasses for bad input;
  KeyboardInterrupt(signal number) on a second SIGINT/SIGTERM (without
  waiting for a save in progress); returns with summary["exit_code"] 0,
  EXIT_NONFINITE or EXIT_INTERRUPTED.
  """
  checkpoints = os.path.abspath(os.path.join(cfg.run.dir, "checkpoints"))
  if require_resume and not os.path.isdir(checkpoints):
    # Refused before anything is built or written: a refused run creates nothing.
    raise CheckpointError(f"--resume: no checkpoint in {checkpoints}")
  run = make_run(cfg, devices)
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


def _restore(run: Run, ckpt: Checkpointer, step: int, saved: dict[str, Any], state):
  """Checkpoint `step` as (state, data state), on this run's mesh whatever it was saved on.

  `state` is this run's initial state (its buffers are consumed). The arrays
  the schedule saves are read into their shardings here; what it does not
  save (2bw's in-flight state) it recomputes (`Schedule.resume`). An older
  checkpoint that holds 2bw's in-flight arrays too is read the same way:
  they are left on disk and recomputed, bit for bit where they are read.
  """
  cfg, schedule = run.cfg, run.schedule
  s_old, d_old = _saved_layout(run, ckpt, step, saved)
  # Whether the experts were split over 'data' changes the per-device shapes
  # of 2bw's in-flight state (its gradient accumulator, a residual stash); a
  # checkpoint from before the key existed did not split them.
  split_old = config_lib.experts_split(cfg.pipeline.schedule, d_old, cfg.model.moe.num_experts,
                                       saved.get("mesh", {}).get("expert_parallel", False))
  split_new = config_lib.experts_split(cfg.pipeline.schedule, cfg.mesh.data,
                                       cfg.model.moe.num_experts, cfg.mesh.expert_parallel)
  # Where the embedding and head live changes their shapes (the vocabulary's
  # padding) and 2bw's in-flight gradient slices; a checkpoint from before
  # `pipeline.head` existed split them over the stages.
  saved_head = saved.get("pipeline", {}).get("head", "vocab_parallel")
  vp_old = config_lib.vocab_parallel(cfg.model, dataclasses.replace(
      cfg.pipeline, stages=s_old, head=saved_head))
  vp_new = config_lib.vocab_parallel(cfg.model, cfg.pipeline)
  moved = (s_old, d_old, split_old, vp_old) != (cfg.pipeline.stages, cfg.mesh.data, split_new,
                                                vp_new)
  keep = schedule.saved_fields(state)
  if not moved and all(jax.tree.leaves(keep)):  # the whole state, read as it was saved
    state, data_state, _ = ckpt.restore(step, state)
    return state, data_state
  shapes = ckpt.saved_shapes(step)
  abstract = {}
  for (path, x), wanted in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                               jax.tree.leaves(keep)):
    key = path_key(path)
    # An empty array (saved as a 0-d stand-in, `Checkpointer.save`) has nothing to read.
    if not wanted or x.size == 0:
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
  restored = jax.tree_util.tree_map_with_path(lambda p, x: arrays.get(path_key(p), x), state)
  try:
    new_state = schedule.resume(restored, state, guarded=cfg.run.nan_policy == "stop")
  except ValueError as e:
    raise CheckpointError(f"cannot resume {ckpt.directory}/{step} on this mesh: {e}") from None
  if moved and jax.process_index() == 0:
    experts = (f" (experts {'split over data' if split_new else 'on every replica'})"
               if split_old != split_new else "")
    head = (f" (embedding and head {'split over the stages' if vp_new else 'whole'})"
            if vp_old != vp_new else "")
    _say(f"resharded the checkpoint from {s_old} stage(s) x {d_old} data to "
         f"{cfg.pipeline.stages} x {cfg.mesh.data}{experts}{head}")
  return new_state, data_state


def schedule_change(cfg: Config, saved_steps: Optional[int], step: int) -> Optional[str]:
  """What resuming at `step` with cfg.run.steps in place of `saved_steps` does to the rate.

  A cosine or wsd schedule spans run.steps, so another run.steps re-spans it
  from the start and the rate of the steps still to run changes (a constant
  schedule's does not: its warmup, the only part that has a length, must
  match the checkpoint). One line naming the old and the new horizon, or
  None when nothing changes.
  """
  new_steps, kind = cfg.run.steps, cfg.optimizer.schedule
  if saved_steps is None or saved_steps == new_steps or kind == "constant":
    return None
  rate = lambda steps: float(optim.learning_rate_schedule(cfg.optimizer, steps)(step))
  old, new = rate(saved_steps), rate(new_steps)
  if f"{old:.3g}" != f"{new:.3g}":
    then = f"the rate at step {step} changes from {old:.3g} to {new:.3g}"
  else:
    then = f"the rate at step {step} stays {new:.3g}, later ones change"
  return (f"run.steps {saved_steps} -> {new_steps}: the {kind} schedule now spans "
          f"{new_steps} steps instead of {saved_steps}; {then}")


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


class _Begun(NamedTuple):
  """Where the loop starts: the step, the state, the data iterator, the batch placer."""
  start: int
  latest: Optional[int]
  state: Any
  it: Any
  to_global: Callable[[np.ndarray], jax.Array]
  shard: tuple[int, int]


def _begin(run: Run, ckpt: Checkpointer, require_resume: bool, init_params: Any) -> _Begun:
  """Builds or resumes the state and the data iterator; writes config.yaml."""
  cfg, schedule = run.cfg, run.schedule
  is_main = jax.process_index() == 0
  latest = ckpt.latest_step()
  restart = False
  if latest is None:
    if require_resume:
      raise CheckpointError(f"--resume: no checkpoint in {ckpt.directory}")
    restart = _check_fresh_start(cfg.run.dir, cfg, ckpt)
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
  batch_shape = run.batch_shape
  if latest is None and cfg.model.init_from:
    state = _initial_state(run, init_params if init_params is not None
                           else _read_init_from(cfg), batch_shape)
    if is_main:
      _say(f"initialised the weights from {cfg.model.init_from}")
  else:
    state = schedule.init_sharded(run.model.init, jax.random.key(cfg.run.seed), batch_shape)

  sharding = schedule.batch_sharding()
  shard = _rows_of_process(sharding, batch_shape)
  it = data_lib.train_iterator(
      run.data, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
      num_microbatches=cfg.pipeline.microbatches, seed=cfg.run.seed,
      shard_index=shard[0], shard_count=shard[1])
  start = 0
  if latest is not None:
    state, data_state = _restore(run, ckpt, latest, meta.get("config", {}), state)
    it.set_state(data_state)
    start = latest
    if is_main:
      _say(f"resuming from {ckpt.directory}/{latest} (step {latest} of {cfg.run.steps})")
      change = schedule_change(cfg, meta.get("config", {}).get("run", {}).get("steps"), latest)
      if change:
        _say(change)
  elif restart and is_main:
    _say(f"no checkpoint in {ckpt.directory}: the earlier attempt stopped before its first "
         "one was saved; starting over from step 0")
  if is_main:
    with open(os.path.join(cfg.run.dir, "config.yaml"), "w") as f:
      f.write(f"# jaxpipe resolved config; commit {_git_commit()}\n")
      yaml.safe_dump(config_lib.to_dict(cfg), f, sort_keys=False)
  to_global = lambda x: jax.make_array_from_process_local_data(sharding, x, batch_shape)
  return _Begun(start, latest, state, it, to_global, shard)


def _evaluation(run: Run, begun: _Begun, watch: _watchdog.Watchdog) -> _loop.Evaluation:
  """The run's validation batches, placed on the mesh once."""
  cfg = run.cfg
  batches = [(begun.to_global(b["tokens"]), begun.to_global(b["targets"]))
             for b in data_lib.eval_batches(
                 run.data, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
                 num_microbatches=cfg.pipeline.microbatches, num_batches=cfg.eval.batches,
                 shard_index=begun.shard[0], shard_count=begun.shard[1])]
  return _loop.Evaluation(run.schedule, batches, cfg.eval.every, cfg.run.steps, watch)


def _train(run: Run, ckpt: Checkpointer, require_resume: bool,
           init_params: Any = None) -> dict[str, Any]:
  """The body of `train`, with the checkpointer it closes (and model.init_from's weights)."""
  cfg, schedule = run.cfg, run.schedule
  steps, kill = cfg.run.steps, config_lib.kill_point(cfg.run.debug_kill)
  begun = _begin(run, ckpt, require_resume, init_params)
  start, state, it = begun.start, begun.state, begun.it
  # With several processes, a step that never finishes (a hung collective)
  # ends the run, as a lost process does (jaxpipe._watchdog).
  watch = _watchdog.Watchdog(cfg.dist.step_timeout_s if jax.process_count() > 1 else 0)
  evaluate = _evaluation(run, begun, watch)
  policy = _loop.NonFinitePolicy(cfg.run.nan_policy, schedule)
  report = _loop.Report(cfg, _loop.host_schedule(run.lr_schedule, steps), start,
                        schedule.loss_lag, jax.process_index() == 0, policy, peak_tflops(cfg),
                        kill, epoch_sequences=run.data.num_sequences("train", cfg.data.seq_len),
                        watchdog=watch)

  def poison(step: int, batch: dict) -> dict:
    if step == cfg.run.debug_nan_step:
      return {**batch, "targets": np.full_like(batch["targets"], -1)}
    return batch

  feed = _loop.Feed(it, begun.to_global, poison, start)
  saves = _loop.CheckpointPolicy(
      ckpt, cfg.checkpoint.every, steps, begun.latest, kill=kill,
      payload=lambda k: (schedule.checkpointed(state), feed.data_state(), _meta(cfg, k)),
      watchdog=watch)
  if start == 0 and evaluate.batches:
    report.summary["first_val_loss"] = evaluate(state)
    report.validation(0, report.summary["first_val_loss"])

  def stop_nonfinite() -> None:
    # The step after the bad one did nothing (go was false), so `state` is
    # the last good state: the bad step's update was skipped.
    k, batch_k, where = policy.stopped_at
    saves.save(k + 1, wait=True, crash_point=False)
    _say(f"stopped: non-finite loss or gradient of batch {batch_k} (step {k}) {where}; "
         f"the last good state is saved as step {k + 1} in {ckpt.directory}")
    report.summary["exit_code"] = EXIT_NONFINITE

  pending = None  # (step, its metrics on the device, dispatch time)
  with _loop.Signals() as signals, watch:
    try:
      for step in range(start, steps):
        tokens, targets = feed.take()  # placed on the devices while step k-1 ran
        report.profile.before(step)
        t0 = time.time()
        state, met = schedule.step(state, tokens, targets, policy.go)
        policy.dispatched(met)
        if step + 1 < steps:
          feed.advance()  # batch k+1, drawn and placed while the devices run step k
        # Only now does the host wait, for step k-1's metrics: step k is queued.
        previous, pending = pending, (step, met, t0)
        if previous is not None and not report.settle(*previous):
          stop_nonfinite()
          break
        done = step + 1
        if evaluate.due(done):
          report.validation(done, evaluate(state))
        if saves.due(done):
          saves.save(done)
        if signals.stop:
          ok, pending = report.settle(*pending), None
          if not ok:
            stop_nonfinite()
            break
          saves.save(done, wait=True, crash_point=False)
          _say(f"interrupted by {signal.Signals(signals.stop).name} after step {done} of "
               f"{steps}: checkpoint saved in {ckpt.directory}; run the same command to resume")
          report.summary["exit_code"] = EXIT_INTERRUPTED
          break
      else:
        if pending is not None and not report.settle(*pending):
          stop_nonfinite()
        else:
          _finish(run, report, saves, evaluate, state, start)
    finally:
      report.close()
  report.summary["peak_memory_gib"] = accel.write_device_memory(
      cfg.run.dir, jax.local_devices(), jax.process_index(), jax.process_count())
  return report.finish(state, run)


def _finish(run: Run, report: _loop.Report, saves: _loop.CheckpointPolicy,
            evaluate: _loop.Evaluation, state: Any, start: int) -> None:
  """The end of a run: the last batch's loss, the final evaluation and checkpoint.

  Every process runs it (evaluation is a collective), also when a finished
  run is started again: its last reports are redone.
  """
  done = run.cfg.run.steps
  if start == done and report.summary["is_main"]:
    _say(f"the run in {run.cfg.run.dir} is already complete at step {done}; raise run.steps "
         "to continue it")
  pending_loss = run.schedule.pending_loss(state)
  if pending_loss is not None:
    # The last batch's gradient is still in flight: it has no norm yet.
    report.record(done - 1, float(pending_loss), {"grad_norm": None,
                                                  "skipped": report.summary["skipped"]})
  val = evaluate(state)
  if val is not None:
    report.validation(done, val)
    report.summary["val_loss"] = val
  saves.save(done)


def format_summary(summary: dict[str, Any]) -> str:
  """The one-line end-of-run summary."""
  cfg = summary["run"].cfg
  parts = [f"jaxpipe {cfg.pipeline.schedule}",
           f"S={cfg.pipeline.stages} D={cfg.mesh.data} M={cfg.pipeline.microbatches}",
           f"{cfg.optimizer.name}"]
  if "train_loss" in summary:
    epoch = summary.get("epoch")
    parts.append(f"train loss {summary['train_loss']:.4f} (batch {summary['train_loss_step']}"
                 + (f", epoch {epoch:.2f})" if epoch is not None else ")"))
  if summary.get("val_loss") is not None:
    first = summary.get("first_val_loss")
    parts.append(f"val loss {summary['val_loss']:.4f}"
                 + (f" (from {first:.4f})" if first is not None else ""))
  speed = ""
  if summary["tokens_per_s"]:
    speed = f", {summary['tokens_per_s']:,.0f} tokens/s after compilation" + (
        f", MFU {summary['mfu']:.1%}" if "mfu" in summary else "")
  if summary.get("peak_memory_gib") is not None:
    speed += f", peak device memory {summary['peak_memory_gib']:.1f} GiB"
  parts.append(f"{summary['elapsed_s']:.1f} s{speed}")
  if summary["skipped"]:
    parts.append(f"{summary['skipped']} updates skipped")
  parts.append(f"run dir {cfg.run.dir}")
  return " | ".join(parts)
