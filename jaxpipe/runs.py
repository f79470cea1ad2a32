"""Reading a finished (or running) run directory back: its records, config and newest weights.

`read_records(run_dir)` is the one reader of metrics.jsonl: the trainer's
resume, the plot and study tools and the tests all go through it.

`load_params(run_dir, step)` is what export and generation start from: the
run's config and the weights that the next batch would have run on, in the
model's natural shapes (the vocabulary unpadded) on one device, whatever
mesh and schedule wrote them. It reads only the parameter arrays of a
checkpoint (an orbax partial restore), never the optimizer state or 2bw's
in-flight buffers, and it writes nothing into the run: a run that is still
training keeps its partial saves.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import yaml

from jaxpipe import config as config_lib
from jaxpipe.config import Config
from jaxpipe.errors import CheckpointError, InputError

__all__ = ["load_params", "checkpoint_steps", "read_records", "losses", "METRICS"]

METRICS = "metrics.jsonl"


def read_records(run_dir: str, *, strict: bool = False) -> list[dict[str, Any]]:
  """Every record of `run_dir`/metrics.jsonl in file order ([] without the file).

  Training records carry "loss" (null when it was not finite), evaluations
  "val_loss"; both carry "step". A line that is not JSON (the last one, cut
  short by a kill) is skipped, or with `strict` raises ValueError naming it.
  """
  path = os.path.join(run_dir, METRICS)
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        if strict:
          raise ValueError(f"{path}:{n} is not a JSON line") from None
  return out


def losses(run_dir: str, key: str = "loss", *,
           strict: bool = False) -> dict[int, Optional[float]]:
  """step -> the records' `key` ("loss" or "val_loss"; None where it was not finite)."""
  return {r["step"]: r[key] for r in read_records(run_dir, strict=strict) if key in r}

# Where each schedule's state keeps the newest weights (`Schedule.newest`):
# a field of the saved state.
_NEWEST_FIELD = {"none": "params", "gpipe": "params", "1f1b": "params", "2bw": "cur",
                 "pipedream": "versions", "interleaved": "params", "zb1": "params"}


def _read_config(run_dir: str) -> Config:
  path = os.path.join(run_dir, "config.yaml")
  if not os.path.isdir(run_dir):
    raise InputError(f"run directory not found: {run_dir}")
  try:
    with open(path) as f:
      tree = yaml.safe_load(f)
  except FileNotFoundError:
    raise InputError(f"{run_dir} is not a jaxpipe run directory: it has no config.yaml "
                     "(give the run.dir a training run wrote)") from None
  except (OSError, yaml.YAMLError) as e:
    raise InputError(f"{path}: unreadable ({type(e).__name__})") from None
  if not isinstance(tree, dict):
    raise InputError(f"{path}: expected a mapping of config sections")
  # Saved by the run, perhaps before a key moved: read in today's keys.
  return config_lib.from_dict(config_lib.upgrade_saved(tree))


def _reader(ckpt_dir: str):
  """A read-only orbax manager: no directory created, no partial save cleaned up."""
  from jaxpipe import checkpoint  # pylint: disable=g-import-not-at-top
  return checkpoint.read_only_manager(ckpt_dir)


def checkpoint_steps(run_dir: str) -> list[int]:
  """The steps of the complete checkpoints in a run directory, oldest first."""
  ckpt_dir = os.path.abspath(os.path.join(run_dir, "checkpoints"))
  if not os.path.isdir(ckpt_dir):
    return []
  manager = _reader(ckpt_dir)
  try:
    return sorted(manager.all_steps())
  finally:
    manager.close()


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
  """{'blocks.attn.q.kernel': x} -> {'blocks': {'attn': {'q': {'kernel': x}}}}."""
  out: dict[str, Any] = {}
  for key, value in flat.items():
    node = out
    *parents, leaf = key.split(".")
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return out


def load_params(run_dir: str, step: Optional[int] = None) -> tuple[Config, Any, int]:
  """Returns (config, params, step): a run's config and its newest weights at a checkpoint.

  The weights are those the next batch would have run on (SyncState.params
  for none/gpipe/1f1b/interleaved, TwoBWState.cur for 2bw, the newest of
  PipeDreamState.versions for pipedream), in the model's natural shapes
  ('blocks' stacked on a leading layer axis in the natural order, which
  interleaved's checkpoints hold in an order of their own; the vocabulary cut back from
  the pipeline's padding to model.vocab_size), in model.param_dtype, as
  arrays on one device (the first).

  Args:
    run_dir: a run.dir that train.py wrote (config.yaml and checkpoints/).
    step: the checkpoint to read; None = the newest.

  Raises:
    InputError (one line) for a missing or foreign directory, a run without
    a checkpoint, a step that has none, or an unreadable checkpoint.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from jaxpipe import model as model_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import unpad_vocab  # pylint: disable=g-import-not-at-top

  cfg = _read_config(run_dir)
  steps = checkpoint_steps(run_dir)
  ckpt_dir = os.path.abspath(os.path.join(run_dir, "checkpoints"))
  if not steps:
    raise InputError(f"{run_dir} has no complete checkpoint in {ckpt_dir}; a run writes one "
                     "at checkpoint.every steps and at its end")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise InputError(f"{run_dir} has no checkpoint at step {step}; it has "
                     f"{', '.join(map(str, steps))}")
  schedule = cfg.pipeline.schedule
  field = _NEWEST_FIELD.get(schedule)
  if field is None:
    raise InputError(f"{run_dir}/config.yaml: unknown pipeline.schedule '{schedule}'")

  saved, flat_shapes = _saved_tree(ckpt_dir, step)
  if f"{field}.embed.embedding" not in flat_shapes:
    raise CheckpointError(f"checkpoint {ckpt_dir}/{step} holds no weights under '{field}' "
                          f"(the field schedule {schedule} keeps them in); was it written by "
                          "another version of jaxpipe?")
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  pd = model_lib.dtype_of(cfg.model.param_dtype)
  restored = _restore_fields(ckpt_dir, step, saved, (field, "step"), device, {field: pd})
  flat = _flatten(restored[field])
  if field == "versions":
    # Pipedream's ring: v[j] at index j % S, and the newest is v[k] after k updates.
    ring = flat["embed.embedding"].shape[0]
    newest = int(restored["step"]) % ring
    flat = {k: v[newest] for k, v in flat.items()}
  model = model_lib.make_model(cfg.model)
  missing = [k for k in _param_keys(model) if k not in flat]
  if missing:
    raise CheckpointError(f"checkpoint {ckpt_dir}/{step} lacks {', '.join(missing[:3])}; it "
                          "does not fit the run's config.yaml")
  params = _nest(flat)
  blocks = params.pop("blocks")
  if schedule == "interleaved":
    # Stacked in device order for the stage count that wrote the checkpoint
    # (`Interleaved`; a resumed run may have changed it): back to the natural order.
    from jaxpipe.pipeline import layer_order  # pylint: disable=g-import-not-at-top
    stages = _saved_config(ckpt_dir, step).get("pipeline", {}).get("stages",
                                                                   cfg.pipeline.stages)
    back = np.argsort(layer_order(cfg.model.n_layers, stages, cfg.pipeline.virtual_stages))
    blocks = jax.tree.map(lambda x: x[back], blocks)
  shared = unpad_vocab(params, model.vocab_axes, cfg.model.vocab_size)
  return cfg, {**shared, "blocks": blocks}, step


def _saved_config(ckpt_dir: str, step: int) -> dict[str, Any]:
  """The config checkpoint `step` was written with (its meta item)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  manager = _reader(ckpt_dir)
  try:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except Exception as e:  # orbax raises many types for a damaged checkpoint
    raise CheckpointError(f"checkpoint {ckpt_dir}/{step} has no readable meta "
                          f"({type(e).__name__}); give another --step") from None
  finally:
    manager.close()
  return dict(meta).get("config", {})


def _param_keys(model) -> list[str]:
  """The dotted names of a model's parameter leaves ('blocks.attn.q.kernel', ...)."""
  import jax  # pylint: disable=g-import-not-at-top

  from jaxpipe.checkpoint import path_key  # pylint: disable=g-import-not-at-top
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  return [path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]


def _flatten(tree: Any) -> dict[str, Any]:
  """{'a': {'b': x}} -> {'a.b': x} (the dotted names of checkpoint fields)."""
  from jaxpipe import checkpoint  # pylint: disable=g-import-not-at-top
  return checkpoint.flatten_dict(tree)


def _saved_tree(ckpt_dir: str, step: int) -> tuple[Any, dict[str, Any]]:
  """(the saved state's metadata tree, {dotted field name: array metadata}) of a checkpoint.

  The tree is the state, or an older checkpoint's (state, RNG key) pair.
  """
  from jaxpipe.checkpoint import saved_state  # pylint: disable=g-import-not-at-top
  advice = "give another --step"
  tree, state = saved_state(ckpt_dir, step, advice)
  if not isinstance(state, dict):
    raise CheckpointError(f"checkpoint {ckpt_dir}/{step} is unreadable "
                          f"({type(state).__name__}); {advice}")
  return tree, _flatten(state)


def _restore_fields(ckpt_dir: str, step: int, saved: Any, fields, device,
                    dtypes: dict[str, Any]) -> dict[str, Any]:
  """Restores the named fields of a checkpoint's state onto `device` (a partial restore).

  A field in `dtypes` is read in that dtype, the others as saved; the
  optimizer state and everything in flight stay on disk. An older pair's
  second element, the run's key, comes along (orbax restores a sequence whole).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  from jaxpipe.checkpoint import saved_pair  # pylint: disable=g-import-not-at-top
  is_array = lambda x: hasattr(x, "shape")
  pair = saved_pair(saved)
  state_md = saved[0] if pair else saved
  as_args = lambda tree, dtype=None: jax.tree.map(lambda m: ocp.ArrayRestoreArgs(
      sharding=device, global_shape=tuple(m.shape), dtype=dtype or m.dtype), tree,
      is_leaf=is_array)
  item = {f: state_md[f] for f in fields}
  args = {f: as_args(state_md[f], dtypes.get(f)) for f in fields}
  if pair:
    item, args = [item, saved[1]], [args, as_args(saved[1])]
  manager = _reader(ckpt_dir)
  try:
    out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=args, partial_restore=True)))
  except Exception as e:  # orbax raises many types for a damaged checkpoint
    raise CheckpointError(f"checkpoint {ckpt_dir}/{step} is damaged ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''}); give another "
                          "--step") from None
  finally:
    manager.close()
  return out["state"][0] if pair else out["state"]
