"""The pipeline's choices, each defined once as a `typing.Literal` and its tuple of values,
and the rules for when experts are split and when the vocabulary is.

Pure Python, no JAX: `jaxpipe.config` validates its `pipeline.schedule`,
`pipeline.stash` and `mesh.layout` against these, the planner and the tools
iterate over them, and the timetable, engine, mesh and schedules read them.
"""

from __future__ import annotations

import typing
from typing import Literal

__all__ = ["ScheduleName", "StashMode", "Layout", "SCHEDULE_NAMES", "PIPELINED", "STASH_MODES",
           "LAYOUTS", "STAGE", "DATA", "experts_split", "vocab_parallel", "HEAD_ON_LAST_STAGE"]

# `none` is one device with gradient accumulation; the others are pipelined.
ScheduleName = Literal["none", "gpipe", "1f1b", "2bw", "pipedream", "interleaved", "zb1"]
# What a forward keeps for its backward: the stage input (recomputed) or jax.vjp's residuals.
StashMode = Literal["inputs", "residuals"]
# The mesh's axes; a layout names the one that spans nodes when the devices are on several.
Layout = Literal["stage", "data"]

SCHEDULE_NAMES: tuple[str, ...] = typing.get_args(ScheduleName)
PIPELINED: tuple[str, ...] = tuple(n for n in SCHEDULE_NAMES if n != "none")
STASH_MODES: tuple[str, ...] = typing.get_args(StashMode)
LAYOUTS: tuple[str, ...] = typing.get_args(Layout)
STAGE, DATA = LAYOUTS


def experts_split(schedule: str, num_data: int, num_experts: int, expert_parallel: bool) -> bool:
  """Whether a run splits its experts over the data replicas (expert parallelism).

  A pipelined schedule (only its `shard_map` program exchanges tokens between
  the replicas; `none` keeps every expert on every replica), D > 1
  replicas, an MoE model and `expert_parallel` asked for.
  """
  return bool(expert_parallel and num_experts and num_data > 1 and schedule != "none")


# `pipeline.head=auto` keeps the output layer on the last stage while it
# adds at most this share to that stage's work per token: below it the
# imbalance costs less than the vocabulary split's collectives
# (docs/benchmark.md).
HEAD_ON_LAST_STAGE = 0.05


def vocab_parallel(head: str, *, head_params: int, block_params: int, num_layers: int,
                   num_stages: int) -> bool:
  """Whether a run splits its embedding and output layer over the stages.

  `head` is `vocab_parallel` (split), `last_stage` (whole, on the last
  stage) or `auto`: split when the output layer's matmul parameters
  (`head_params`, dim x vocab) exceed HEAD_ON_LAST_STAGE of a stage's
  blocks' (num_layers / num_stages blocks of `block_params` each).
  """
  if head != "auto":
    return head == "vocab_parallel"
  stage = num_layers / max(num_stages, 1) * block_params
  return head_params > HEAD_ON_LAST_STAGE * stage
