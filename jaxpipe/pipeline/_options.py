"""`ScheduleOptions`: every choice a schedule takes beyond its name, mesh and microbatches.

One typed, frozen object with a default and a note per option, in place of
loose keyword arguments: `make_schedule` receives it, and
`jaxpipe.trainer.schedule_from_config` builds it from a run's config. Pure
Python, no JAX, like `_names`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from jaxpipe.pipeline._names import StashMode

__all__ = ["ScheduleOptions"]


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
  """The options of `make_schedule`, each with its default; see the note under each field.

  Frozen, so that one object can be shared and compared; a changed copy is
  `dataclasses.replace(options, stash="residuals")`, which raises TypeError
  naming any field that does not exist.

  Example:
    >>> opts = ScheduleOptions(stash="residuals", shard_optimizer=False)
    >>> dataclasses.replace(opts, virtual_stages=2).virtual_stages
    2
  """

  stash: StashMode = "inputs"
  """What a pipelined forward keeps for its backward (`Engine`). 'inputs': the
  stage input only, and the backward recomputes the stage's forward (4 units
  of work per microbatch where 3 suffice; one activation per stash slot).
  'residuals': what `jax.vjp` saves, as `model.remat` decides (no
  recomputation; more memory per stash slot)."""

  vocab_parallel: bool = True
  """True: the embedding and the output layer split over the stages by
  vocabulary (padded to a multiple of S), every stage computing its slice of
  each head (1/S of their memory per stage; per tick a broadcast of the last
  block's output and a sum of the head's input gradient). False: both whole
  on every stage, the embedding looked up on the first stage and the head
  computed on the last, with no collective per tick (the last stage does the
  head's work on top of its blocks)."""

  shard_optimizer: bool = True
  """ZeRO-1: the optimizer's parameter-shaped state split over 'data' on a
  mesh of D > 1 replicas (1/D of it per device; each replica updates its
  slice and the new weights are gathered once per step). See
  `Schedule.opt_param_specs`."""

  expert_parallel: bool = True
  """In a pipelined schedule on D > 1 replicas, the leaves that
  `StageFns.expert_axes` marks are split over 'data' (E/D experts per
  replica, the tokens exchanged by all-to-all; D must divide the experts).
  See `Schedule.param_specs`."""

  predict: Optional[Callable[[Any, Any], Any]] = None
  """Schedule none only: a function (params, opt_state) -> the weights the
  gradient is taken at, e.g. `jaxpipe.optim.predicted_params`; the update is
  applied to params, and evaluation uses params. None: the gradient at
  params. A pipelined schedule refuses it."""

  virtual_stages: int = 1
  """Interleaved only (>= 2 there; 1 for every other schedule): v, the chunks
  of blocks per device (`Interleaved`). A bubble of (S-1)/(vM+S-1) instead
  of 1f1b's (S-1)/(M+S-1), at the cost of v times the stage-to-stage
  transfers and a stash of up to (v+1)S-1 chunk inputs (or residuals)."""

  overlap_sends: Optional[bool] = None
  """Each stage-to-stage transfer placed where the tick's compute hides it
  (`Engine(overlap=...)`); the values computed are the same either way. None:
  on where the mesh's devices are not CPUs, on which a collective is a
  barrier and one exchange per tick is faster."""

  rings_in_state: bool = False
  """gpipe, 1f1b, zb1 and interleaved: the stash rings carried in the state
  from step to step (`FlushedState`) instead of made by each step. They hold
  nothing a later step reads (a checkpoint leaves them out), so this moves
  memory between the state and the step's temporaries and computes the
  same; the CPU tuning (tools/cpu/tuning.py) turns it on for gpipe and zb1,
  whose step-local rings a CPU's malloc mapped and faulted in afresh every
  step. Ignored by 2bw and pipedream, whose stash is state anyway."""

  compile_scope: Optional[Callable[[], Any]] = None
  """A function returning the context manager each compilation of the step
  runs in (its first call of each kind, `StepProgram.compile`), e.g. the
  launch hooks' (`jaxpipe.launch.compile_scope`); None: compile as XLA will.
  The compiled program's text is the same either way; what the scope
  changes is how the compiler runs (the CPU tuning pins its threads)."""

  def as_kwargs(self) -> dict[str, Any]:
    """{field: value}, shallow (`predict` stays the very function, unlike `dataclasses.asdict`)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
