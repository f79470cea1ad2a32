"""The training loop: joins config, data, model, optimizer, schedule and checkpoints.

`make_run(cfg)` makes every piece of a run from its config; `train(cfg)` runs it:
build, begin (one call into `jaxpipe.resume`, which starts fresh or resumes,
on whatever mesh), then per step fetch a batch, run the schedule's jitted
step, log, evaluate, checkpoint; stop cleanly on SIGTERM/SIGINT; guard
against non-finite values; finish. The loop (`_train`) is short on purpose:
each concern it calls is a named piece of `jaxpipe._loop` or `jaxpipe._report`,
and the work lives in the packages those call.

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
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe import _loop
from jaxpipe import _report
from jaxpipe import _watchdog
from jaxpipe import _writes
from jaxpipe import accel
from jaxpipe import config as config_lib
from jaxpipe import data as data_lib
from jaxpipe import launch
from jaxpipe import model as model_lib
from jaxpipe import optim
from jaxpipe import resume
from jaxpipe import rundir
from jaxpipe._writes import WriteFailed
from jaxpipe.checkpoint import Checkpointer
from jaxpipe.config import Config
from jaxpipe.errors import ConfigError, DataError
from jaxpipe.pipeline import (PIPELINED, Schedule, ScheduleOptions, StageFns, axes_across_nodes,
                              expert_exchange, make_mesh, make_schedule)

__all__ = ["Run", "make_run", "train", "EXIT_NONFINITE", "EXIT_INTERRUPTED", "EXIT_SIGNAL",
           "EXIT_LOST", "EXIT_IOERR"]

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
# (killed, stopped, or a step or save made no progress for dist.step_timeout_s
# or dist.save_timeout_s) and this one stopped at once without saving; rerun
# the same command on every process to resume from the newest checkpoint.
# Why 69: jaxpipe._watchdog.
EXIT_LOST = _watchdog.EXIT_LOST
# 74 (sysexits' EX_IOERR): a write into run.dir failed (disk full, quota,
# permission, the folder removed) and the run stopped at once; the newest
# intact checkpoint is named. Not 2: the input was fine, the disk was not.
EXIT_IOERR = _writes.EXIT_IOERR


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


def schedule_from_config(cfg: Config, fns: StageFns, optimizer: Any, mesh: jax.sharding.Mesh, *,
                         schedule: Optional[str] = None, stash: Optional[str] = None,
                         virtual_stages: Optional[int] = None) -> Schedule:
  """The config's schedule on `mesh`, as training runs it, its options read from `cfg`.

  The one place a config becomes a `make_schedule` call (its
  `ScheduleOptions`): `make_run`, the planner, the GPU compile
  (`jaxpipe.gpu`) and the benchmarks build their step through it.
  pipeline.stash, pipeline.virtual_stages, mesh.shard_optimizer,
  mesh.expert_parallel, pipeline.head (`config.vocab_parallel`) and
  optimizer.weight_prediction (gradients at `optim.predicted_params`) give
  the options, and `run.launch_hooks` may change them
  (`jaxpipe.launch.schedule_options`). `schedule`, `stash` and `virtual_stages` ask for another
  schedule, stash choice or chunk count than the config's.
  """
  p = cfg.pipeline
  name = schedule or p.schedule
  # Weight prediction is schedule none's (config.validate refuses it with
  # any other); a config asked for a pipelined schedule instead runs that
  # one without it.
  predict = (optim.predicted_params if cfg.optimizer.weight_prediction and name not in PIPELINED
             else None)
  options = ScheduleOptions(stash=stash or p.stash,
                            virtual_stages=virtual_stages or p.virtual_stages,
                            shard_optimizer=cfg.mesh.shard_optimizer,
                            expert_parallel=cfg.mesh.expert_parallel,
                            vocab_parallel=config_lib.vocab_parallel(cfg.model, p),
                            predict=predict)
  options = launch.schedule_options(cfg, name, options)
  return make_schedule(name, fns, optimizer, mesh, p.microbatches, options)


def abstract_step_inputs(cfg: Config, model: model_lib.Model,
                         schedule: Schedule) -> tuple[Any, jax.ShapeDtypeStruct]:
  """(state, batch) of `schedule`'s step as shapes placed in its shardings: nothing is allocated.

  What a step is lowered with to compile it ahead of time (the planner's
  `--compile`, `jaxpipe.gpu`): the state of `Schedule.init` at the model's
  initial parameters, and a [M, B/M, seq] batch of token ids.
  """
  m = cfg.pipeline.microbatches
  batch_shape = (m, cfg.data.batch_size // m, cfg.data.seq_len)
  params = jax.eval_shape(model.init, jax.random.key(0))
  state = jax.eval_shape(lambda p: schedule.init(p, batch_shape), params)
  state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                       state, schedule.state_shardings(state))
  return state, jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=schedule.batch_sharding())


def make_run(cfg: Config, devices=None) -> Run:
  """Builds data, model, optimizer, mesh and schedule from a validated config."""
  data = open_data(cfg)
  cfg = resolve_attention(resolve_model(cfg, data))
  model, fns, optimizer = components(cfg)
  lr_schedule = optim.learning_rate_schedule(cfg.optimizer, cfg.run.steps)
  devices = jax.devices() if devices is None else devices
  launch.check_devices(cfg, devices)
  mesh = _mesh(cfg, devices)
  schedule = schedule_from_config(cfg, fns, optimizer, mesh)
  run = Run(cfg, data, model, fns, optimizer, lr_schedule, mesh, schedule)
  # Refused here, before anything is written: this process's rows of a batch
  # must be one aligned block of it (the loop reads them again, `_batches`).
  _rows_of_process(schedule.batch_sharding(), run.batch_shape)
  return run


def peak_tflops(cfg: Config) -> Optional[float]:
  """The per-device peak for MFU: run.peak_tflops, else a known accelerator's, else None."""
  return cfg.run.peak_tflops or accel.device_peak_tflops(jax.devices()[0].device_kind)


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


_say = _loop.say


def train(cfg: Config, *, require_resume: bool = False, devices=None,
          guard: Optional[_watchdog.Guard] = None) -> dict[str, Any]:
  """Trains according to `cfg`; returns a summary dict (and writes run.dir).

  Resumes from the newest checkpoint in `run.dir` if there is one (with a
  compatible config, possibly on another mesh); with none, starts at step 0,
  also over the records of an earlier attempt of the same config that
  stopped before its first checkpoint (`jaxpipe.resume`). `require_resume`
  makes a missing checkpoint an error. `guard`: the process's
  `jaxpipe._watchdog.Guard` (from `jaxpipe.launch.start`), through which a
  step or save that hangs ends a run of several processes; a lone process's
  by default. Raises InputError subclasses for bad
  input; `jaxpipe._writes.WriteFailed` when a write into run.dir fails (with
  the newest intact checkpoint); KeyboardInterrupt(signal number) on a second SIGINT/SIGTERM (without
  waiting for a save in progress); returns with summary["exit_code"] 0,
  EXIT_NONFINITE or EXIT_INTERRUPTED.
  """
  # These refuse before anything is built or written: a refused run creates nothing.
  main = jax.process_index() == 0
  rundir.check_writable(cfg.run.dir)
  if main:  # process 0 holds the folder for every process of the run
    rundir.check_free(cfg.run.dir)
  resume.check_request(cfg, require_resume=require_resume)
  run = make_run(cfg, devices)
  init_params = resume.fresh_weights(run.cfg, require_resume=require_resume)
  try:
    os.makedirs(run.cfg.run.dir, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"run.dir={cfg.run.dir} cannot be created ({e.strerror})") from None
  lock = rundir.hold(run.cfg.run.dir) if main else None
  abandon = False
  try:
    ckpt = Checkpointer(resume.checkpoint_dir(run.cfg), keep=run.cfg.checkpoint.keep,
                        async_save=run.cfg.checkpoint.async_save)
    try:
      start = resume.begin(run, ckpt, require_resume=require_resume, init_params=init_params)
      return _train(run, ckpt, start, guard or _watchdog.Guard())
    except (OSError, WriteFailed) as e:
      failure = e if isinstance(e, WriteFailed) else _writes.from_oserror(e, run.cfg.run.dir)
      if failure is None:
        raise
      abandon = True  # after a failed write, waiting for the other writers could block
      if failure.checkpoint_dir is None:  # not found by the checkpointer: say what it holds
        failure.newest, failure.checkpoint_dir = _newest(ckpt), ckpt.directory
      raise failure from None
    except KeyboardInterrupt:
      abandon = True  # stop now: a save in progress is left unfinished, and ignored later
      raise
    finally:
      if not abandon:
        ckpt.close()
  finally:
    if lock is not None:
      lock.release()  # never blocks, so also after a failed write or a second signal


class _Batches(NamedTuple):
  """The training batches, and how this process's rows of a batch reach the mesh."""
  it: Any                                        # the training iterator, at the start's batch
  to_global: Callable[[np.ndarray], jax.Array]   # [M, this process's rows, seq] -> the batch
  shard: tuple[int, int]                         # (shard_index, shard_count) of those rows


def _batches(run: Run, data_state: Optional[dict[str, Any]]) -> _Batches:
  """The training iterator at `data_state` (None: at the first batch) and the batch placer."""
  cfg = run.cfg
  sharding = run.schedule.batch_sharding()
  shard = _rows_of_process(sharding, run.batch_shape)
  it = data_lib.train_iterator(
      run.data, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
      num_microbatches=cfg.pipeline.microbatches, seed=cfg.run.seed,
      shard_index=shard[0], shard_count=shard[1])
  if data_state is not None:
    it.set_state(data_state)
  to_global = lambda x: jax.make_array_from_process_local_data(sharding, x, run.batch_shape)
  return _Batches(it, to_global, shard)


def _evaluation(run: Run, batches: _Batches, watch: _watchdog.Watchdog) -> _loop.Evaluation:
  """The run's validation batches, placed on the mesh once."""
  cfg = run.cfg
  placed = [(batches.to_global(b["tokens"]), batches.to_global(b["targets"]))
            for b in data_lib.eval_batches(
                run.data, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
                num_microbatches=cfg.pipeline.microbatches, num_batches=cfg.eval.batches,
                shard_index=batches.shard[0], shard_count=batches.shard[1])]
  return _loop.Evaluation(run.schedule, placed, cfg.eval.every, cfg.run.steps, watch)


def _report_for(run: Run, start: int, policy: _loop.NonFinitePolicy, watch: _watchdog.Watchdog,
                writes: _writes.Watch, kill: Optional[tuple[str, int]]) -> _report.Report:
  """The run's `jaxpipe._report.Report`, from `start`: its records, progress, summary, profile."""
  cfg, main = run.cfg, jax.process_index() == 0
  lr = _loop.host_schedule(run.lr_schedule, cfg.run.steps)
  throughput = _report.Throughput(cfg, peak_tflops(cfg), start,
                                  run.data.num_sequences("train", cfg.data.seq_len))
  log = _loop.Metrics(cfg.run.dir, start, run.schedule.loss_lag, main, writes)
  return _report.Report(_report.Records(log, lr, throughput, kill),
                        _report.Progress(cfg, start, main, lr, throughput),
                        _report.Summary(start, main),
                        _loop.Profile(cfg.run.profile, cfg.run.dir, main), policy, watch)


def _train(run: Run, ckpt: Checkpointer, begun: resume.Start,
           guard: _watchdog.Guard) -> dict[str, Any]:
  """The loop of `train` from where `begun` starts, with the checkpointer `train` closes;
  `guard` ends the run when a step or a save hangs (several processes)."""
  cfg, schedule = run.cfg, run.schedule
  steps, kill = cfg.run.steps, config_lib.kill_point(cfg.run.debug_kill)
  need = cfg.pipeline.stages * cfg.mesh.data
  if jax.process_index() == 0 and need > 1 and jax.default_backend() == "cpu":
    _say(f"no accelerator found: emulating {need} devices on the CPU "
         f"({jax.local_device_count()} per process)")
  start, state = begun.step, begun.state
  batches = _batches(run, begun.data_state)
  # With several processes, a step that never finishes (a hung collective)
  # ends the run, as a lost process does (jaxpipe._watchdog).
  several = jax.process_count() > 1
  watch = _watchdog.Watchdog(cfg.dist.step_timeout_s if several else 0,
                             pause_timeout_s=cfg.dist.save_timeout_s if several else 0,
                             guard=guard)
  evaluate = _evaluation(run, batches, watch)
  policy = _loop.NonFinitePolicy(cfg.run.nan_policy, schedule)
  writes = _writes.Watch()
  ckpt.watch = writes
  report = _report_for(run, start, policy, watch, writes, kill)

  def poison(step: int, batch: dict) -> dict:
    if step == cfg.run.debug_nan_step:
      return {**batch, "targets": np.full_like(batch["targets"], -1)}
    return batch

  feed = _loop.Feed(batches.it, batches.to_global, poison, start)
  saves = _loop.CheckpointPolicy(
      ckpt, cfg.checkpoint.every, steps, begun.latest, kill=kill,
      payload=lambda k: (schedule.checkpointed(state), feed.data_state(),
                         resume.checkpoint_meta(cfg, k)),
      watchdog=watch)
  if start == 0 and evaluate.batches:
    report.summary.first_val_loss = evaluate(state)
    report.validation(0, report.summary.first_val_loss)

  def stop_nonfinite() -> None:
    # The step after the bad one did nothing (go was false), so `state` is
    # the last good state: the bad step's update was skipped.
    k, batch_k, where = policy.stopped_at
    saves.save(k + 1, wait=True, crash_point=False)
    _say(f"stopped: non-finite loss or gradient of batch {batch_k} (step {k}) {where}; "
         f"the last good state is saved as step {k + 1} in {ckpt.directory}")
    report.summary.exit_code = EXIT_NONFINITE

  pending = None  # (step, its metrics on the device, dispatch time)
  with _loop.Signals() as signals, watch, writes:
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
        saves.check()  # a save that failed in the background stops the run here
        if signals.stop:
          ok, pending = report.settle(*pending), None
          if not ok:
            stop_nonfinite()
            break
          saves.save(done, wait=True, crash_point=False)
          _say(f"interrupted by {signal.Signals(signals.stop).name} after step {done} of "
               f"{steps}: checkpoint saved in {ckpt.directory}; run the same command to resume")
          report.summary.exit_code = EXIT_INTERRUPTED
          break
      else:
        if pending is not None and not report.settle(*pending):
          stop_nonfinite()
        else:
          _finish(run, report, saves, evaluate, state, start)
    except WriteFailed:
      report.close(abandon=True)  # train() says which checkpoint is intact
      raise
    except BaseException:
      report.close()
      raise
    report.close()
  report.summary.peak_memory_gib = accel.write_device_memory(
      cfg.run.dir, jax.local_devices(), jax.process_index(), jax.process_count())
  return report.finish(state, run)


def _newest(ckpt: Checkpointer) -> Optional[int]:
  """The newest complete checkpoint's step, or None (also when the folder is gone)."""
  try:
    return ckpt.latest_step()
  except Exception:  # pylint: disable=broad-except
    return None


def _finish(run: Run, report: _report.Report, saves: _loop.CheckpointPolicy,
            evaluate: _loop.Evaluation, state: Any, start: int) -> None:
  """The end of a run: the last batch's loss, the final evaluation and checkpoint.

  Every process runs it (evaluation is a collective), also when a finished
  run is started again: its last reports are redone.
  """
  done = run.cfg.run.steps
  if start == done and report.summary.is_main:
    _say(f"the run in {run.cfg.run.dir} is already complete at step {done}; raise run.steps "
         "to continue it")
  pending_loss = run.schedule.pending_loss(state)
  if pending_loss is not None:
    # The last batch's gradient is still in flight: it has no norm yet.
    report.record(done - 1, float(pending_loss), {"grad_norm": None,
                                                  "skipped": report.summary.skipped})
  val = evaluate(state)
  if val is not None:
    report.validation(done, val)
    report.summary.val_loss = val
  saves.save(done)


def format_summary(summary: dict[str, Any]) -> str:
  """The one-line end-of-run summary."""
  cfg = summary["run"].cfg
  parts = [f"jaxpipe {cfg.pipeline.schedule}",
           f"S={cfg.pipeline.stages} D={cfg.mesh.data} M={cfg.pipeline.microbatches}",
           f"{cfg.optimizer.name}"]
  if "train_loss" in summary:
    epoch = summary.get("epoch")
    # Steps counted from 1, as the progress line counts them.
    parts.append(f"train loss {summary['train_loss']:.4f} (step {summary['train_loss_step'] + 1}"
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
