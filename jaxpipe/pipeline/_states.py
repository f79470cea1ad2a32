"""The schedules' typed states and the parameter-tree helpers they are built with.

Each state is a `NamedTuple` whose `KINDS` name the kind of each field; the
shardings `jax.jit` places a state with and the specs `shard_map` splits it
by are both derived from those kinds (`_placement.Placement`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

Tree = Any

__all__ = ["SyncState", "FlushedState", "PipeDreamState", "TwoBWState", "InFlight",
           "split_params", "merge_params", "pick_version", "local_block", "per_device"]


def split_params(params: Tree) -> tuple[Tree, Tree]:
  """(blocks, shared): params['blocks'] and a dict of every other entry."""
  return params["blocks"], {k: v for k, v in params.items() if k != "blocks"}


def merge_params(blocks: Tree, shared: Tree) -> Tree:
  """Inverse of `split_params`."""
  return {**shared, "blocks": blocks}


# --- typed states --------------------------------------------------------------
#
# Field kinds: 'step' a replicated counter; 'params' a parameter tree (natural
# layout, padded vocabulary); 'versions' a parameter tree with a leading
# version axis; 'opt' optimizer state following the parameters; 'device'
# per-device buffers with leading [stage, data] axes; 'batch' a [M, B, t]
# token batch; 'inflight' a nested `InFlight`.


class SyncState(NamedTuple):
  """State of none, 1f1b and interleaved.

  Attributes:
    step: updates done.
    params: the weights.
    opt_state: the optimizer's state.
  """
  step: jax.Array
  params: Tree
  opt_state: Tree

  KINDS = {"step": "step", "params": "params", "opt_state": "opt"}


class FlushedState(NamedTuple):
  """State of a flushed schedule with `rings_in_state`: `SyncState`'s fields and the stash rings.

  Attributes:
    step: updates done.
    params: the weights.
    opt_state: the optimizer's state.
    rings: per device ([S, D, ...] each leaf): the stash rings a step's
      ticks write and read (the forward's stash, and W's stash or None).
      They hold nothing from one step to the next (each step writes a slot
      before it reads it); they are state so that a step neither allocates
      nor zero-fills them (on CPUs a step's block of over 64 MiB is mapped
      afresh, and faulted in, at every step). A checkpoint leaves them out.
      With `ScheduleOptions.rings_in_state` only; otherwise a step makes
      its rings and the state is a `SyncState`.
  """
  step: jax.Array
  params: Tree
  opt_state: Tree
  rings: Tree

  KINDS = {"step": "step", "params": "params", "opt_state": "opt", "rings": "device"}


class PipeDreamState(NamedTuple):
  """State of pipedream.

  Attributes:
    step: updates done (k).
    versions: [S, ...] the last S weight versions, v[j] at index j % S.
    opt_state: the optimizer's state.
  """
  step: jax.Array
  versions: Tree
  opt_state: Tree

  KINDS = {"step": "step", "versions": "versions", "opt_state": "opt"}


class InFlight(NamedTuple):
  """What a 2bw pipeline holds between step k-1 and step k (per device: [S, D, ...]).

  Attributes:
    fwd_buf, bwd_buf: the activation and cotangent in transit between stages.
    stash: the stash ring (stage inputs or residuals of microbatches whose
      backward has not run).
    acc: (blocks, shared) batch k-1's gradient accumulated so far.
    loss: batch k-1's loss sum so far.
    tokens, targets: batch k-1, whose last microbatches still run in step k.
  """
  fwd_buf: jax.Array
  bwd_buf: jax.Array
  stash: Tree
  acc: Tree
  loss: jax.Array
  tokens: jax.Array
  targets: jax.Array

  KINDS = {"fwd_buf": "device", "bwd_buf": "device", "stash": "device", "acc": "device",
           "loss": "device", "tokens": "batch", "targets": "batch"}


class TwoBWState(NamedTuple):
  """State of 2bw at the start of step k.

  Attributes:
    step: k.
    prev: v[k-1], the version batch k-1's last microbatches still run on
      (v[0] at k = 0).
    cur: v[k], the version batch k runs on.
    opt_state: the optimizer's state.
    inflight: the pipeline's in-flight state (`InFlight`).
  """
  step: jax.Array
  prev: Tree
  cur: Tree
  opt_state: Tree
  inflight: InFlight

  KINDS = {"step": "step", "prev": "params", "cur": "params", "opt_state": "opt",
           "inflight": "inflight"}


def pick_version(tree: Tree, index) -> Tree:
  """Version `index` of a ring of weight versions (each leaf's leading axis)."""
  return jax.tree.map(lambda v: v[index], tree)


def local_block(tree: Tree) -> Tree:
  """A per-device tree's own block: each leaf without its [stage, data] axes of size 1."""
  return jax.tree.map(lambda x: x[0, 0], tree)


def per_device(tree: Tree) -> Tree:
  """The inverse of `local_block`: each leaf given leading [stage, data] axes of size 1."""
  return jax.tree.map(lambda x: x[None, None], tree)
