"""Checkpoints with orbax: the whole training state, the data position and the config.

A checkpoint at step n (n optimizer steps done) holds three items:
  state: the schedule's state pytree (weights and their versions, optimizer
         state, for 2bw everything in flight between steps) plus the run's
         RNG key, each array restored into the sharding it had;
  data:  the input pipeline's iterator state (JSON);
  meta:  the resolved config and the step (JSON).
orbax writes each checkpoint into a temporary directory and renames it when
complete, so a process killed mid-save leaves the previous checkpoint intact
and the next start ignores the partial one.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import jax
import orbax.checkpoint as ocp

from jaxpipe.errors import CheckpointError

__all__ = ["Checkpointer", "RESUMABLE_KEYS", "config_differences", "check_compatible"]

# Config keys a resumed run may change; everything else must match the
# checkpoint, since it changes what the saved state means.
RESUMABLE_KEYS = frozenset({
    "run.dir", "run.steps", "run.log_every", "run.progress", "run.nan_policy",
    "run.debug_nan_step", "run.peak_tflops", "run.profile",
    "data.cache_dir", "checkpoint.every", "checkpoint.keep", "checkpoint.async_save",
    "eval.every", "eval.batches", "dist.coordinator", "dist.num_processes", "dist.process_id",
})


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                       allowed=RESUMABLE_KEYS) -> list[str]:
  """Lists `key: saved -> current` for every differing key not in `allowed`."""
  a, b = _flatten(saved), _flatten(current)
  diffs = []
  for key in sorted(set(a) | set(b)):
    if key in allowed:
      continue
    if a.get(key, "<absent>") != b.get(key, "<absent>"):
      diffs.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
  return diffs


def check_compatible(saved: Mapping[str, Any], current: Mapping[str, Any], where: str) -> None:
  """Raises CheckpointError naming the differences that forbid resuming."""
  diffs = config_differences(saved, current)
  if diffs:
    shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
    raise CheckpointError(
        f"the checkpoint in {where} was written with a different config ({shown}); "
        "resume with the saved config, or choose a new run.dir")


class Checkpointer:
  """Saves and restores (state, data iterator state, meta) under one directory."""

  def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True)
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options,
                                            item_names=("state", "data", "meta"))
    except Exception as e:  # orbax raises many types for an unusable directory
      raise CheckpointError(f"cannot open checkpoint directory {self.directory}: {e}") from None

  def latest_step(self) -> Optional[int]:
    """The newest complete checkpoint's step, or None."""
    self._manager.reload()
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    self._manager.reload()
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, data_state: Mapping[str, Any],
           meta: Mapping[str, Any]) -> None:
    """Starts writing checkpoint `step` (in the background when async)."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(dict(data_state)),
        meta=ocp.args.JsonSave(dict(meta))), force=True)

  def read_meta(self, step: int) -> dict[str, Any]:
    """The meta item of checkpoint `step` (config and step), without the arrays."""
    path = os.path.join(self.directory, str(step))
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      return dict(out["meta"])
    except Exception as e:
      raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}); "
                            "delete it to resume from an earlier one") from None

  def restore(self, step: int, template: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Restores checkpoint `step` into arrays shaped and sharded like `template`."""
    path = os.path.join(self.directory, str(step))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template)
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore(),
          meta=ocp.args.JsonRestore()))
    except Exception as e:
      raise CheckpointError(f"checkpoint {path} does not fit this run or is damaged "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                            "resume with the config it was written with") from None
    return out["state"], dict(out["data"]), dict(out["meta"])

  def wait(self) -> None:
    """Blocks until background saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
