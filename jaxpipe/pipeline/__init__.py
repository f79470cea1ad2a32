"""Pipeline schedules on a ('stage', 'data') device mesh.

This package knows pytrees, stage functions, stacked parameters and meshes; it
knows nothing of the model or of configs. See `make_schedule` (with its
`ScheduleOptions`), `step_plan` and `facts`; what a schedule costs before it
runs (the planner's `Estimate`: memory, work, traffic, bubbles) is counted by
`schedule_memory`, `stage_work`, `tick_traffic` and `steady_bubble`. The
plans (`_timetable`) and the options are pure Python and NumPy: importing
them, or this package, does not start JAX; the engine, the schedules and the
estimates load on first use.
"""

import importlib

from jaxpipe.pipeline._names import (HEAD_ON_LAST_STAGE, LAYOUTS, PIPELINED, SCHEDULE_NAMES,
                                     STASH_MODES, Layout, ScheduleName, StashMode, experts_split,
                                     vocab_parallel)
from jaxpipe.pipeline._options import ScheduleOptions
from jaxpipe.pipeline._timetable import (Cell, Facts, StepPlan, TickKind, Timetable,
                                         check_virtual_stages, facts, layer_order,
                                         min_microbatches, stash_slots, step_plan, timetable)

_LAZY = {
    "StageFns": "_engine", "Engine": "_engine",
    "expert_exchange": "_engine", "PHASE": "_engine",
    "Schedule": "_base", "StepProgram": "_base",
    "SyncState": "_states", "FlushedState": "_states", "PipeDreamState": "_states",
    "TwoBWState": "_states", "InFlight": "_states",
    "merge_params": "_states", "split_params": "_states",
    "Interleaved": "_schedules", "make_schedule": "_schedules",
    "make_mesh": "_mesh", "axes_across_nodes": "_mesh", "node_of": "_mesh",
    "residual_shapes": "_engine",
    "MemoryTerm": "_cost", "PHASES": "_cost", "memory_terms": "_cost", "memory_total": "_cost",
    "stage_tick": "_cost", "flops": "_cost",
    "Estimate": "_estimate", "ScheduleMemory": "_estimate", "cannot_run": "_estimate",
    "schedule_memory": "_estimate", "stage_work": "_estimate", "steady_bubble": "_estimate",
    "tick_traffic": "_estimate",
    "padded_vocab": "_vocab", "pad_vocab": "_vocab", "unpad_vocab": "_vocab",
}

__all__ = ["Cell", "Facts", "HEAD_ON_LAST_STAGE", "LAYOUTS", "Layout", "PIPELINED",
           "SCHEDULE_NAMES", "STASH_MODES",
           "ScheduleName", "ScheduleOptions", "StashMode", "StepPlan", "experts_split",
           "TickKind", "Timetable", "check_virtual_stages", "facts", "layer_order",
           "min_microbatches", "stash_slots", "step_plan", "timetable", "vocab_parallel", *_LAZY]


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(f"jaxpipe.pipeline.{_LAZY[name]}"), name)
  raise AttributeError(f"module 'jaxpipe.pipeline' has no attribute {name!r}")
