"""Where a run starts: fresh, or from its newest checkpoint on whatever mesh it now has.

`begin(run, ckpt)` is the one call the trainer makes once its pieces are
built and its checkpoint directory is open. It returns a `Start`: the step,
the training state on this run's mesh and the data iterator's position. On
the way it

1. decides (`decide`, from the run directory and the newest checkpoint's
   meta item, before any array is read or compiled): resume that
   checkpoint, start fresh, or start over the records of an earlier attempt
   of the same config that stopped before its first checkpoint; and refuses
   in one line what cannot continue (another config, run.steps below the
   checkpoint, a mesh the schedule cannot carry the state to, another run's
   records, --resume with nothing to resume);
2. builds the initial state: random from run.seed, or model.init_from's
   weights on a fresh start;
3. restores the checkpoint into it: whole where the mesh is the one it was
   saved on and the checkpoint holds every array; otherwise the arrays it
   holds, by name, read as saved, fitted to this mesh and completed by the
   schedule (`Schedule.saved_fields`, `Schedule.resume`);
4. writes run.dir/config.yaml, which the next start's decision reads.

Two checks come earlier, before anything is built or written, so that a
refused start leaves nothing behind: `check_request` (--resume needs a
checkpoint directory) and `fresh_weights` (model.init_from, read for a run
that surely starts fresh).

What a start reads back (config.yaml, a checkpoint's meta item from
`checkpoint_meta`) is defined here; `jaxpipe.checkpoint` stores it.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from typing import Any, Mapping, NamedTuple, Optional, Protocol

import jax
import yaml

from jaxpipe import _loop
from jaxpipe import config as config_lib
from jaxpipe import optim
from jaxpipe.checkpoint import Checkpointer, flatten_dict, path_key
from jaxpipe.config import Config
from jaxpipe.errors import CheckpointError, ConfigError, InputError



class Run(Protocol):
  """What a start needs of a run's pieces (`jaxpipe.trainer.Run` has them).

  A protocol rather than the trainer's class, so that this module does not
  import the trainer, which imports it.
  """
  cfg: Config
  model: Any
  schedule: Any
  batch_shape: tuple[int, int, int]

__all__ = ["Start", "Decision", "Layout", "begin", "decide", "layout", "saved_layout",
           "check_request", "fresh_weights", "checkpoint_dir", "checkpoint_meta",
           "schedule_change", "RESUMABLE_KEYS", "LAYOUT_KEYS", "config_differences",
           "check_compatible"]


# Config keys a resumed run may change; everything else must match the
# checkpoint, since it changes what the saved state means.
RESUMABLE_KEYS = frozenset({
    "run.dir", "run.steps", "run.log_every", "run.progress", "run.nan_policy",
    "run.debug_nan_step", "run.peak_tflops", "run.profile",
    "data.cache_dir", "checkpoint.every", "checkpoint.keep", "checkpoint.async_save",
    "eval.every", "eval.batches", "dist.coordinator", "dist.num_processes", "dist.process_id",
    "run.debug_kill",
    # How the same function is computed, not what the state holds: rounding apart.
    "model.loss_chunk", "model.attention", "mesh.shard_optimizer",
    # Where a fresh run's weights came from; a resumed run has its own.
    "model.init_from",
    # How and where the same program runs: XLA's flags, its compilation cache,
    # which devices a process takes and how the mesh is laid over the nodes,
    # the launch hooks (the CPU tuning: how the host runs it, not what).
    "run.deterministic", "run.compile_cache", "dist.local_device_ids", "mesh.layout",
    "run.launch_hooks",
    # When a run of several processes gives up on a lost one.
    "dist.heartbeat_timeout_s", "dist.init_timeout_s", "dist.shutdown_timeout_s",
    "dist.step_timeout_s", "dist.save_timeout_s",
})

# Keys that change the mesh: a resumed run may change them where its schedule
# can carry its state over (`Schedule.check_relayout`); the global batch stays.
LAYOUT_KEYS = frozenset({"mesh.data", "pipeline.stages", "mesh.expert_parallel",
                         "pipeline.head"})


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                       allowed=RESUMABLE_KEYS) -> list[str]:
  """Lists `key: saved -> current` for every differing key not in `allowed`.

  A key the saved config lacks (written before the key existed) counts as
  its default value; one it holds under an older name (written before the
  key moved, `config.MOVED_KEYS`) counts under today's (`config.upgrade_saved`).
  """
  defaults = flatten_dict(config_lib.to_dict(config_lib.Config()))
  a = {**defaults, **flatten_dict(config_lib.upgrade_saved(saved))}
  b = flatten_dict(current)
  diffs = []
  for key in sorted(set(a) | set(b)):
    if key in allowed:
      continue
    if a.get(key, "<absent>") != b.get(key, "<absent>"):
      diffs.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
  return diffs


def check_compatible(saved: Mapping[str, Any], current: Mapping[str, Any], where: str,
                     allowed=RESUMABLE_KEYS | LAYOUT_KEYS) -> None:
  """Raises CheckpointError naming the differences that forbid resuming."""
  diffs = config_differences(saved, current, allowed)
  if diffs:
    shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
    raise CheckpointError(
        f"the checkpoint in {where} was written with a different config ({shown}); "
        "resume with the saved config, or choose a new run.dir")


class Layout(NamedTuple):
  """How a run lays its state over the mesh: what a resume on another mesh must change.

  Attributes:
    stages: pipeline stages, `pipeline.stages`.
    data: data-parallel replicas, `mesh.data`.
    experts_split: whether each replica holds a slice of the MoE experts
      (`config.experts_split`); it changes the per-device shapes of 2bw's
      in-flight state (its gradient accumulator, a residual stash).
    vocab_parallel: whether the embedding and head are split over the stages
      (`config.vocab_parallel`); it changes their shapes (the vocabulary's
      padding) and 2bw's in-flight gradient slices.
  """
  stages: int
  data: int
  experts_split: bool
  vocab_parallel: bool


def layout(cfg: Config) -> Layout:
  """The layout `cfg` runs on (`cfg.model.vocab_size` resolved)."""
  return Layout(cfg.pipeline.stages, cfg.mesh.data,
                config_lib.experts_split(cfg.pipeline.schedule, cfg.mesh.data,
                                         cfg.model.moe.num_experts, cfg.mesh.expert_parallel),
                config_lib.vocab_parallel(cfg.model, cfg.pipeline))


def saved_layout(saved: Mapping[str, Any], cfg: Config) -> Layout:
  """The layout a checkpoint whose config is `saved` (a dict, as stored) was written on.

  `cfg` (this run's, compatible with `saved` but for `LAYOUT_KEYS`) gives the
  model. Keys an older checkpoint lacks count as they were before they
  existed: no expert parallelism, and the head split over the stages; the
  stage and data counts as this run's.
  """
  stages = saved.get("pipeline", {}).get("stages", cfg.pipeline.stages)
  data = saved.get("mesh", {}).get("data", cfg.mesh.data)
  split = config_lib.experts_split(cfg.pipeline.schedule, data, cfg.model.moe.num_experts,
                                   saved.get("mesh", {}).get("expert_parallel", False))
  head = saved.get("pipeline", {}).get("head", "vocab_parallel")
  vocab = config_lib.vocab_parallel(cfg.model, dataclasses.replace(
      cfg.pipeline, stages=stages, head=head))
  return Layout(stages, data, split, vocab)


class Decision(NamedTuple):
  """What a start does, decided before any array is read.

  Attributes:
    latest: the step of the checkpoint to resume from; None for a fresh start.
    meta: that checkpoint's meta item (its config under "config", as saved);
      {} for a fresh start.
    restart: a fresh start over the records (metrics.jsonl, config.yaml) of
      an earlier attempt of this config that stopped before its first
      checkpoint; they are replaced as the run writes its own.
    saved: the layout checkpoint `latest` was written on; this run's when fresh.
    layout: this run's layout.
  """
  latest: Optional[int]
  meta: dict[str, Any]
  restart: bool
  saved: Layout
  layout: Layout

  @property
  def relayout(self) -> bool:
    """Whether the checkpoint's arrays must be fitted to another layout."""
    return self.saved != self.layout

  @property
  def saved_config(self) -> dict[str, Any]:
    """The config checkpoint `latest` was written with ({} when fresh)."""
    return self.meta.get("config", {})


def decide(cfg: Config, schedule: Any, ckpt: Checkpointer, *,
           require_resume: bool = False) -> Decision:
  """Fresh start, restart or resume of `cfg` (resolved) with the checkpoints of `ckpt`.

  Reads the newest complete checkpoint's meta item, or with none, run.dir's
  records; `schedule.check_relayout` says whether a checkpoint of another
  mesh can continue here. Raises CheckpointError or ConfigError (one line)
  where the run cannot start: --resume (`require_resume`) without a
  checkpoint, a checkpoint of an incompatible config or of more steps than
  run.steps, a layout this schedule cannot take, another run's records.
  """
  here = layout(cfg)
  latest = ckpt.latest_step()
  if latest is None:
    if require_resume:
      raise CheckpointError(f"--resume: no checkpoint in {ckpt.directory}")
    return Decision(None, {}, _check_fresh_start(cfg.run.dir, cfg, ckpt), here, here)
  meta = ckpt.read_meta(latest)
  saved = meta.get("config", {})
  check_compatible(saved, config_lib.to_dict(cfg), ckpt.directory)
  if latest > cfg.run.steps:
    raise ConfigError(f"run.steps={cfg.run.steps} is below the newest checkpoint's step "
                      f"({latest}) in {ckpt.directory}; give run.steps >= {latest}")
  was = saved_layout(saved, cfg)
  if (was.stages, was.data) != (here.stages, here.data):
    try:
      schedule.check_relayout(was.stages, was.data)
    except ValueError as e:
      raise CheckpointError(f"cannot resume {ckpt.directory}/{latest}: {e}") from None
  return Decision(latest, meta, False, was, here)


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


class Start(NamedTuple):
  """Where the training loop starts, as `begin` built or restored it.

  Attributes:
    step: updates already done, the loop's first step (0 on a fresh start).
    latest: the step of the checkpoint resumed from, None on a fresh start;
      the loop never saves that step again.
    state: the schedule's training state on this run's mesh.
    data_state: the training iterator's position to continue from (its
      `set_state`), None on a fresh start.
    decision: what `decide` decided.
  """
  step: int
  latest: Optional[int]
  state: Any
  data_state: Optional[dict[str, Any]]
  decision: Decision


def begin(run: Run, ckpt: Checkpointer, *, require_resume: bool = False,
          init_params: Any = None) -> Start:
  """Decides, builds and restores where `run` starts; writes run.dir/config.yaml.

  `init_params`: model.init_from's weights if `fresh_weights` read them
  already (a fresh start reads them itself otherwise; a resume never does).
  Raises what `decide` raises, and CheckpointError for a checkpoint that
  cannot be read onto this mesh.
  """
  cfg = run.cfg
  is_main = jax.process_index() == 0
  decision = decide(cfg, run.schedule, ckpt, require_resume=require_resume)
  if decision.latest is None and cfg.model.init_from:
    state = _state_from_weights(run, init_params if init_params is not None
                                else read_init_from(cfg))
    if is_main:
      _loop.say(f"initialised the weights from {cfg.model.init_from}")
  else:
    state = run.schedule.init_sharded(run.model.init, jax.random.key(cfg.run.seed),
                                      run.batch_shape)
  step, data_state = 0, None
  if decision.latest is not None:
    state, data_state = _restore(run, ckpt, decision, state)
    step = decision.latest
    if is_main:
      _loop.say(f"resuming from {ckpt.directory}/{step} (step {step} of {cfg.run.steps})")
      change = schedule_change(cfg, decision.saved_config.get("run", {}).get("steps"), step)
      if change:
        _loop.say(change)
  elif decision.restart and is_main:
    _loop.say(f"no checkpoint in {ckpt.directory}: the earlier attempt stopped before its "
              "first one was saved; starting over from step 0")
  if is_main:
    with open(os.path.join(cfg.run.dir, "config.yaml"), "w") as f:
      f.write(f"# jaxpipe resolved config; commit {_git_commit()}\n")
      yaml.safe_dump(config_lib.to_dict(cfg), f, sort_keys=False)
  return Start(step, decision.latest, state, data_state, decision)


def _restore(run: Run, ckpt: Checkpointer, decision: Decision, state: Any):
  """Checkpoint `decision.latest` as (state, data state), on this run's mesh.

  `state` is this run's initial state (its buffers are consumed). The arrays
  the schedule saves are read into their shardings here; what it does not
  save (2bw's in-flight state) it recomputes (`Schedule.resume`). An older
  checkpoint that holds 2bw's in-flight arrays too is read the same way:
  they are left on disk and recomputed, bit for bit where they are read; so
  is a flushed schedule's checkpoint written with its stash rings in the
  state or without them, whichever this run keeps.
  """
  cfg, schedule, step = run.cfg, run.schedule, decision.latest
  keep = schedule.saved_fields(state)
  # The whole state, as saved: one restore of the tree. A checkpoint of other
  # fields (a flushed schedule's, written with its stash rings in the state,
  # `ScheduleOptions.rings_in_state`) is read array by array below.
  if (not decision.relayout and all(jax.tree.leaves(keep))
      and ckpt.has_fields_of(step, state)):
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
    new_state = schedule.resume(restored, state, guarded=cfg.run.nan_policy == "stop",
                                saved_stages=decision.saved.stages)
  except ValueError as e:
    raise CheckpointError(f"cannot resume {ckpt.directory}/{step} on this mesh: {e}") from None
  if decision.relayout and jax.process_index() == 0:
    was, now = decision.saved, decision.layout
    experts = (f" (experts {'split over data' if now.experts_split else 'on every replica'})"
               if was.experts_split != now.experts_split else "")
    head = (f" (embedding and head {'split over the stages' if now.vocab_parallel else 'whole'})"
            if was.vocab_parallel != now.vocab_parallel else "")
    _loop.say(f"resharded the checkpoint from {was.stages} stage(s) x {was.data} data to "
              f"{now.stages} x {now.data}{experts}{head}")
  return new_state, data_state


def _state_from_weights(run: Run, params: Any):
  """The schedule's initial state around given weights (natural shapes, on the host)."""
  schedule = run.schedule
  params = schedule.pad(params)  # still on the host
  # Each device receives only its shard, straight from the host arrays.
  placed = jax.tree.map(
      lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]),
      params, schedule.param_shardings(params))
  return schedule.init(placed, run.batch_shape)


def checkpoint_dir(cfg: Config) -> str:
  """The absolute path of the run's checkpoint directory, run.dir/checkpoints."""
  return os.path.abspath(os.path.join(cfg.run.dir, "checkpoints"))


def check_request(cfg: Config, *, require_resume: bool) -> None:
  """Refuses --resume (`require_resume`) when run.dir has no checkpoint directory.

  Cheap enough to run before anything is built or written, so that a refused
  run creates nothing; `decide` refuses the case it cannot see here (a
  directory without a complete checkpoint).
  """
  if require_resume and not os.path.isdir(checkpoint_dir(cfg)):
    raise CheckpointError(f"--resume: no checkpoint in {checkpoint_dir(cfg)}")


def fresh_weights(cfg: Config, *, require_resume: bool) -> Any:
  """model.init_from's weights if the run surely starts fresh (no checkpoint directory), else None.

  Read before anything is written, so that a bad directory leaves nothing in
  run.dir. With a checkpoint directory, `begin` decides: a resumed run never
  reads model.init_from.
  """
  if cfg.model.init_from and not require_resume and not os.path.isdir(checkpoint_dir(cfg)):
    return read_init_from(cfg)
  return None


def read_init_from(cfg: Config) -> Any:
  """model.init_from's weights (numpy, natural shapes), checked against cfg.model."""
  from jaxpipe import hf  # pylint: disable=g-import-not-at-top
  try:
    return hf.load_params(cfg.model.init_from, cfg.model)
  except InputError as e:
    raise ConfigError(f"model.init_from: {e}") from None


def _git_commit() -> str:
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                         text=True, timeout=5)
    return out.stdout.strip() if out.returncode == 0 else "unknown"
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def checkpoint_meta(cfg: Config, step: int) -> dict[str, Any]:
  """The meta item a checkpoint of `step` holds: the resolved config, the step, the commit.

  `decide` reads the config back from it.
  """
  return {"config": config_lib.to_dict(cfg), "step": step, "jaxpipe_commit": _git_commit()}


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
