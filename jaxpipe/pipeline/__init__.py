"""Pipeline schedules on a ('stage', 'data') device mesh.

This package knows pytrees, stage functions, stacked parameters and meshes; it
knows nothing of the model or of configs. See `make_schedule` and `timetable`.
"""

from jaxpipe.pipeline._engine import StageFns
from jaxpipe.pipeline._schedules import (SCHEDULE_NAMES, Schedule, make_mesh, make_schedule,
                                         merge_params, split_params)
from jaxpipe.pipeline._timetable import (Cell, StepPlan, Timetable, bubble_fraction,
                                         min_microbatches, step_plan, ticks_per_step, timetable)

__all__ = [
    "Cell", "SCHEDULE_NAMES", "Schedule", "StageFns", "StepPlan", "Timetable",
    "bubble_fraction", "make_mesh", "make_schedule", "merge_params", "min_microbatches",
    "split_params", "step_plan", "ticks_per_step", "timetable",
]
