"""Checkpoints with orbax: the whole training state, the data position and the config.

A checkpoint at step n (n optimizer steps done) holds three items:
  state: the schedule's state as `Schedule.checkpointed` gives it: what
         cannot be recomputed (weights and their versions, optimizer state,
         for 2bw the tokens of the batch still in flight), each array
         restored into the sharding it had. 2bw's stash, activations in
         transit and partial gradient are left out (None in the tree) and
         recomputed at resume from the saved batch and weights; older
         checkpoints that hold them still resume, those arrays unread;
  data:  the input pipeline's iterator state (JSON);
  meta:  the resolved config and the step (JSON).
orbax writes each checkpoint into a temporary directory and renames it when
complete, so a process killed mid-save leaves the previous checkpoint intact
and the next start ignores the partial one.

Older checkpoints saved the pair (state, the run's RNG key); nothing used the
key, so the state is now saved alone. Every reader here takes both: an old
pair's key is read (orbax restores a sequence whole) and dropped, and its
arrays are named as the state's own (`saved_pair`).

A checkpoint written on one mesh can be read on another (`jaxpipe.resume.LAYOUT_KEYS`):
`restore` reads it into the shardings of a state shaped like this run's;
`saved_shapes` and `restore_arrays` read the arrays a changed mesh can use
as they were saved, for the schedule to fit (`Schedule.resume`). Which of
them a start uses, and whether it resumes at all, `jaxpipe.resume` decides.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Mapping, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpipe import _writes
from jaxpipe._writes import WriteFailed
from jaxpipe.errors import CheckpointError

__all__ = ["Checkpointer", "path_key", "flatten_dict"]

def path_key(path) -> str:
  """A pytree path as orbax names the array: 'inflight.stash.1'."""
  parts = []
  for k in path:
    for attr in ("name", "key", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return ".".join(parts)


def saved_pair(tree: Any) -> bool:
  """Whether a saved state tree (orbax metadata) is the older (state, RNG key) pair."""
  return (isinstance(tree, (list, tuple)) and len(tree) == 2 and isinstance(tree[0], Mapping)
          and hasattr(tree[1], "shape"))


def _is_empty(x: Any) -> bool:
  return hasattr(x, "shape") and math.prod(x.shape) == 0


def _saveable(state: Any) -> Any:
  """`state` with each zero-size array (SOAP's unrotated side) as a 0-d zero of its dtype.

  orbax refuses to save an array without elements; the stand-in keeps the
  tree's structure, and `restore` puts the template's empty array back.
  """
  def stand_in(x):
    if not _is_empty(x):
      return x
    return jax.device_put(np.zeros((), x.dtype), _replicated_like([x]))
  return jax.tree.map(stand_in, state)


def _replicated_like(leaves: Any) -> jax.sharding.Sharding:
  """A replicated sharding on the mesh of the first sharded leaf (a stand-in's, an old key's)."""
  for x in jax.tree.leaves(leaves):
    mesh = getattr(x.sharding, "mesh", None)
    if mesh is not None:
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def flatten_dict(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{'a': {'b': x}} -> {'a.b': x}: nested mappings as one level of dotted keys."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(flatten_dict(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


class _DropInterrupts(logging.Filter):
  """Drops log records of a KeyboardInterrupt (our second signal), which the run reports.

  orbax logs, with its traceback, any exception that reaches it while it
  waits for a save to finish; a second signal raises KeyboardInterrupt there,
  and the trainer then says in one line that it stopped without saving.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.exc_info and record.exc_info[0] is KeyboardInterrupt)


_INTERRUPTS = _DropInterrupts()


class Checkpointer:
  """Saves and restores (state, data iterator state, meta) under one directory."""

  def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self._pending: Optional[int] = None  # the step of the save last started, until checked
    self.watch = None  # a jaxpipe._writes.Watch while a run trains: orbax's logged failures
    logging.getLogger("absl").addFilter(_INTERRUPTS)   # a logger keeps one copy of it
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True)
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options,
                                            item_names=("state", "data", "meta"))
    except Exception as e:  # orbax raises many types for an unusable directory
      raise CheckpointError(f"cannot open checkpoint directory {self.directory}: {e}") from None
    # The manager removes the partial checkpoints of a killed process in a
    # background thread that its close() does not wait for; a run that ends
    # at once (a refused resume) would then trace back from that thread at
    # interpreter exit. Waiting here costs a directory listing.
    await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:
      await_cleanup()

  def latest_step(self) -> Optional[int]:
    """The newest complete checkpoint's step, or None."""
    self._manager.reload()
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    self._manager.reload()
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, data_state: Mapping[str, Any],
           meta: Mapping[str, Any]) -> None:
    """Starts writing checkpoint `step` (in the background when async).

    Raises WriteFailed if the write fails at once; a background write that
    fails is found by `check_saved`, `wait` or `close`.
    """
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(_saveable(state)),
          data=ocp.args.JsonSave(dict(data_state)),
          meta=ocp.args.JsonSave(dict(meta))), force=True)
    except Exception as e:  # orbax and tensorstore raise many types for one failed write
      # orbax waits for the previous save first: its failure may be what this is.
      failed = self._pending if self._pending is not None and not self._complete(
          self._pending) else step
      if failed == step and not _writes.io_error(e):
        raise  # not the disk's doing: a bug, with its traceback
      raise self._failed(failed, e) from None
    self._pending = step

  def _complete(self, step: int) -> bool:
    try:
      return step in self.all_steps()
    except Exception:  # the folder itself may be gone
      return False

  def _failed(self, step: int, error: Optional[BaseException]) -> WriteFailed:
    logged = self.watch.orbax_error() if self.watch is not None else None
    if logged is not None:  # what the write itself said, rather than a later symptom
      error = RuntimeError(logged)
    try:
      newest = self.latest_step()
    except Exception:  # the folder itself may be gone
      newest = None
    return WriteFailed(f"the checkpoint of step {step}", self.directory, error,
                       newest=newest, checkpoint_dir=self.directory)

  def check_saved(self, error: Optional[BaseException] = None) -> None:
    """Raises WriteFailed if the last save has ended without its checkpoint on disk.

    orbax logs a failed background write and leaves the step unfinalized
    rather than raising (and, after a full disk, may never end the save), so
    a save has failed as soon as orbax has logged an error (`watch`), or
    when it is no longer in progress and its step is not among the complete
    ones. `error` (what the failure said, where known) goes into the report.
    Costs a flag read while a save runs and one directory listing when it
    has ended.
    """
    if self._pending is None:
      return
    logged = self.watch.orbax_error() if self.watch is not None else None
    if logged is None and self._manager.is_saving_in_progress():
      return
    step, self._pending = self._pending, None
    try:
      complete = logged is None and step in self.all_steps()
    except Exception as e:  # the folder itself may be gone
      complete, error = False, error or e
    if not complete:
      raise self._failed(step, error)

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
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _saveable(template))
    saved = self._saved_tree(step)
    pair = saved_pair(saved)
    if pair:
      abstract = (abstract, jax.ShapeDtypeStruct(saved[1].shape, saved[1].dtype,
                                                 sharding=_replicated_like(abstract)))
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore(),
          meta=ocp.args.JsonRestore()))
    except Exception as e:
      raise CheckpointError(f"checkpoint {path} does not fit this run or is damaged "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                            "resume with the config it was written with") from None
    state = out["state"][0] if pair else out["state"]
    state = jax.tree.map(lambda t, x: t if _is_empty(t) else x, template, state)
    return state, dict(out["data"]), dict(out["meta"])

  def has_fields_of(self, step: int, template: Any) -> bool:
    """Whether checkpoint `step`'s state has the fields of `template` (a NamedTuple state), no more, no fewer."""
    saved = self._saved_tree(step)
    saved = saved[0] if saved_pair(saved) else saved
    fields = getattr(template, "_fields", None)
    return fields is None or not isinstance(saved, Mapping) or set(saved) == set(fields)

  def _saved_tree(self, step: int) -> Any:
    """Checkpoint `step`'s saved tree (orbax's metadata: shapes, no arrays)."""
    return saved_state(self.directory, step, "delete it to resume from an earlier one")[0]

  def saved_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
    """The global shape of every array of checkpoint `step`'s state, by `path_key`."""
    _, tree = saved_state(self.directory, step, "delete it to resume from an earlier one")
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: hasattr(x, "shape"))[0]:
      out[path_key(path)] = tuple(leaf.shape)
    return out

  def restore_arrays(self, step: int, abstract: Mapping[str, jax.ShapeDtypeStruct]
                     ) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """Restores only the arrays named in `abstract` (by `path_key`), in their shardings.

    Returns (arrays by path key, the data item). For a checkpoint of another
    mesh, whose arrays the caller fits to this one.
    """
    path = os.path.join(self.directory, str(step))
    metadata = self._saved_tree(step)
    pair = saved_pair(metadata)
    if pair:  # the same arrays under the pair's first element, and its key whole
      key = metadata[1]
      abstract = {**{f"0.{k}": v for k, v in abstract.items()},
                  "1": jax.ShapeDtypeStruct(key.shape, key.dtype,
                                            sharding=_replicated_like(list(abstract.values())))}

    def has_arrays(node):
      return any(hasattr(x, "shape") for x in jax.tree.leaves(
          node, is_leaf=lambda x: hasattr(x, "shape")))

    # The saved tree, cut down to the wanted arrays: a mapping drops what is
    # not wanted (a partial restore), a sequence keeps its arity, and an
    # empty node (an optimizer's EmptyState) stays as it was saved.
    omit = object()

    def keep(node, prefix):
      if not has_arrays(node):
        return node
      if isinstance(node, Mapping):
        out = {k: keep(v, f"{prefix}{k}.") for k, v in node.items()}
        out = {k: v for k, v in out.items() if v is not omit}
        return out or omit
      if isinstance(node, (list, tuple)):
        subs = [keep(v, f"{prefix}{i}.") for i, v in enumerate(node)]
        if all(x is omit for x in subs):
          return omit
        if any(x is omit for x in subs):
          raise CheckpointError(f"checkpoint {path}: a partial sequence cannot be restored")
        return subs
      return abstract.get(prefix[:-1], omit)

    item = keep(metadata, "")
    if item is omit:
      raise CheckpointError(f"checkpoint {path}: none of the arrays asked for is in it")
    args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape,
                                                       dtype=x.dtype), item)
    reader = self._reader()
    try:
      out = reader.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True),
          data=ocp.args.JsonRestore()))
    except Exception as e:
      raise CheckpointError(f"checkpoint {path} does not fit this run or is damaged "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    finally:
      reader.close()
    flat = jax.tree_util.tree_flatten_with_path(out["state"][0] if pair else out["state"])[0]
    return {path_key(p): x for p, x in flat}, dict(out["data"])

  def _reader(self) -> ocp.CheckpointManager:
    return read_only_manager(self.directory)

  def wait(self) -> None:
    """Blocks until background saves are on disk; WriteFailed if one did not get there."""
    error = None
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # orbax re-raises a background failure here, sometimes
      error = e
    self.check_saved(error)
    if error is not None:  # every save is complete, so the failure was not a write's
      raise error

  def close(self) -> None:
    """Waits for background saves and releases the manager (a second call does nothing).

    Raises WriteFailed if the last save did not reach the disk.
    """
    if self._manager is not None:
      try:
        self.wait()
      except WriteFailed:
        self._manager = None  # closing would wait on, and raise, the same failure again
        raise
      manager, self._manager = self._manager, None
      manager.close()


def saved_state(directory: str, step: int, advice: str) -> Any:
  """(checkpoint `step`'s saved tree, its state): orbax's metadata (shapes, no arrays).

  The tree is the state, or an older checkpoint's (state, RNG key) pair. A
  checkpoint orbax cannot read raises CheckpointError, the message ending in
  `advice`.
  """
  reader = read_only_manager(directory)
  try:
    tree = reader.item_metadata(step)["state"].tree
    state = tree[0] if saved_pair(tree) else tree
  except Exception as e:  # orbax raises many types for a damaged checkpoint
    raise CheckpointError(f"checkpoint {os.path.join(directory, str(step))} is unreadable "
                          f"({type(e).__name__}); {advice}") from None
  finally:
    reader.close()
  return tree, state


def read_only_manager(directory: str) -> ocp.CheckpointManager:
  """An orbax manager that reads a checkpoint directory: creates nothing, cleans nothing up.

  The state item was written by StandardSave; reading a subset of it needs
  the PyTree handler underneath, in a manager of its own.
  """
  return ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(create=False),
      item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                     "data": ocp.JsonCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})
