"""Schedules as data: every per-(tick, stage) decision of a training step, as arrays.

A `StepPlan` is one training step in the form the engine executes. For each
tick t and stage s it names, in int32 arrays of shape [ticks, S]:

  fwd, bwd           the window index of the microbatch whose forward (and
                     whose backward) stage s runs, or -1 for none;
  fwd_version,       which of the weight versions given to the engine that
  bwd_version        forward and that backward use (-1 where there is none);
  acc                the gradient accumulator the backward adds into;
  fwd_slot, bwd_slot the stash slot the forward writes and the backward reads,
                     as an offset the engine adds to the step's slot base;

and per tick (arrays of shape [ticks]), for the work every stage shares:

  embed_version      the shared-parameter version of stage 0's forward
                     microbatch, whose vocabulary-parallel embedding every stage
                     takes part in;
  head_version,      the shared version and accumulator of the last stage's
  head_acc           forward microbatch, whose output layer and loss every stage
                     computes a slice of (the same tick, before the backwards);
  embed_grad_version the shared version and accumulator of stage 0's backward
  embed_acc          microbatch, whose embedding gradient every stage adds to
                     its slice.

ZB-H1 (`zb1`, a backward split into B and W: `split_backward`) adds, per
(tick, stage),

  wgt                int32 [T, S, J]: the window indices of the microbatches
                     whose weight gradients (W) stage s runs in the tick,
                     oldest first, -1 padded (J = 1 and -1 throughout in
                     every other plan);
  bwd_wslot,         the slot of W's stash that B writes ([T, S]) and each W
  wgt_slot           reads ([T, S, J]; the engine's second ring, of `w_slots`
                     slots);

and there `bwd` is B alone (the input's gradient; its weight gradient waits
in W's stash for the stage's W).

Interleaved 1F1B (`virtual_stages` v > 1) adds, per (tick, stage),

  fwd_chunk,         which of the stage's v chunks of blocks that forward (and
  bwd_chunk          that backward) runs (-1 for none; 0 in every other plan),

and its per-tick shared entries name only the ticks whose microbatch meets
them: stage 0's forward of chunk 0 (the embedding), the last stage's forward
of chunk v-1 (the head), stage 0's backward of chunk 0 (the embedding
gradient). Device s holds chunks s, s+S, ..., s+(v-1)S of the L/(S v)-block
chunks, in that order (`layer_order`).

Block versions and shared versions are separate tuples: 2bw gives the engine
(v[k-1], v[k]) for both; pipedream gives each stage its own lagged blocks and,
for the shared parameters, (the embedding's version, the head's version),
since the embedding belongs to stage 0 and the head to the last stage.

Window indices number the microbatches a step can touch: 0..M-1 are the
previous batch and M..2M-1 the current one for 2bw (which never flushes, so
it finishes the previous batch while it starts the current one); 0..M-1 the
current batch for the flushed schedules. The tick kinds (forward-only,
backward-only, both) follow from the arrays: a tick in which no stage has a
backward runs no backward code at all, and the engine runs each run of ticks
of one kind as its own loop.

Each schedule's plan is built by `step_plan` (`_builders`); `_timetable`
reads a schedule's facts and its drawn cells off it. Pure Python and NumPy.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__ = ["StepPlan", "TickKind", "FORWARD_COST", "BACKWARD_COST", "INPUT_GRAD_COST",
           "WEIGHT_GRAD_COST"]


# The cost model of a tick: a forward of one stage on one microbatch is one
# unit, its backward two (a backward computes the gradients of both the
# inputs and the weights). A tick lasts as long as its slowest stage: a tick
# in which some stage runs a backward and some stage a forward costs 3.
FORWARD_COST, BACKWARD_COST = 1.0, 2.0
# Split into its two halves (zb1): B, the input's gradient, and W, the
# weights', one unit each (ZB-H1's own model, F = B = W); they add up to the
# backward, since the split recomputes nothing (`_split`). A zb1 tick runs at
# most one F, one B and any number of W per stage and lasts as long as its
# busiest stage (`_zbh1`).
INPUT_GRAD_COST, WEIGHT_GRAD_COST = 1.0, 1.0


@dataclasses.dataclass(frozen=True)
class TickKind:
  """What a tick runs, the same on every stage (the engine specialises its loop body).

  Attributes:
    fwd, bwd: whether any stage runs a forward / a backward this tick.
    fwd_version, bwd_version: the block version every forward (backward) of
      the tick uses, or None when stages differ (the engine then selects per
      stage). The backward's accumulator is the same as its version.
    embed_version, head_version, head_acc, embed_grad_version, embed_acc:
      the per-tick entries of the plan (None where no microbatch is there).
      In an interleaved plan (v > 1) they say what the tick would use if
      its microbatch met the embedding (the head, ...): whether it does
      changes with the chunks every S ticks, and the engine reads that from
      the tick's chunks, so that the steady state stays one loop. In a zb1
      plan, likewise, from the tick's row: every tick of its step is of one
      kind (see `StepPlan.kind`).
    wgt: whether any stage runs a weight gradient W (zb1 only).
  """
  fwd: bool
  bwd: bool
  fwd_version: Optional[int]
  bwd_version: Optional[int]
  embed_version: Optional[int]
  head_version: Optional[int]
  head_acc: Optional[int]
  embed_grad_version: Optional[int]
  embed_acc: Optional[int]
  wgt: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
  """One step of a schedule, as the engine executes it (see the module docstring).

  Attributes:
    schedule, num_stages, num_microbatches: the schedule and its S and M.
    window: how many microbatches the window holds (2M for 2bw, else M).
    history: window indices below this belong to the previous batch, which
      does not exist in the first step (M for 2bw, else 0).
    num_versions: the length of the block-version tuple the engine receives.
    num_shared_versions: the length of its shared-version tuple.
    num_accumulators: the length of its accumulator tuple.
    slots: stash slots per stage (`stash_slots`).
    slot_base_step: the slot base advances by M each step (2bw; the flushed
      schedules start every step from slot 0).
    head_stash: the last stage's head cotangent must wait in the stash for
      a later backward tick (gpipe), instead of being used in the same tick.
    virtual_stages: v, the chunks of blocks each device holds (1 but for
      interleaved).
    fwd, bwd, fwd_version, bwd_version, acc, fwd_slot, bwd_slot: int32 [T, S].
    embed_version, head_version, head_acc, embed_grad_version, embed_acc: int32 [T].
    fwd_chunk, bwd_chunk: int32 [T, S], the chunk of each forward and
      backward (-1 for none).
    split_backward: B and W run apart (zb1): `bwd` is B, `wgt` W.
    wgt, wgt_slot: int32 [T, S, J]; bwd_wslot: int32 [T, S] (-1 throughout
      but in zb1).
    w_slots: W's stash slots per stage (0 but in zb1).
    inbox_slots: in zb1, how many received inputs (cotangents) a stage
      must hold at once before its F (B) of them (`_inbox_slots`; 1 on
      1F1B's ticks, which the engine requires).
  """
  schedule: str
  num_stages: int
  num_microbatches: int
  window: int
  history: int
  num_versions: int
  num_shared_versions: int
  num_accumulators: int
  slots: int
  slot_base_step: bool
  head_stash: bool
  virtual_stages: int
  fwd: np.ndarray
  bwd: np.ndarray
  fwd_version: np.ndarray
  bwd_version: np.ndarray
  acc: np.ndarray
  fwd_slot: np.ndarray
  bwd_slot: np.ndarray
  embed_version: np.ndarray
  head_version: np.ndarray
  head_acc: np.ndarray
  embed_grad_version: np.ndarray
  embed_acc: np.ndarray
  fwd_chunk: np.ndarray
  bwd_chunk: np.ndarray
  split_backward: bool = False
  wgt: Optional[np.ndarray] = None
  bwd_wslot: Optional[np.ndarray] = None
  wgt_slot: Optional[np.ndarray] = None
  w_slots: int = 0
  inbox_slots: int = 0

  @property
  def num_ticks(self) -> int:
    return self.fwd.shape[0]

  def kind(self, tick: int) -> TickKind:
    """The kind of tick `tick` (see `TickKind`)."""
    def uniform(values, present):
      vals = {int(v) for v, p in zip(values, present) if p}
      return vals.pop() if len(vals) == 1 else None

    def scalar(x):
      return None if int(x) < 0 else int(x)

    if self.split_backward:
      return self._split_kind()
    f_ok, b_ok = self.fwd[tick] >= 0, self.bwd[tick] >= 0
    shared = (self.embed_version[tick], self.head_version[tick], self.head_acc[tick],
              self.embed_grad_version[tick], self.embed_acc[tick])
    if self.virtual_stages > 1:
      # Whether stage 0's forward embeds (the last stage's meets the head)
      # changes with its chunk; the kind names the version it would use.
      shared = (self.fwd_version[tick, 0] if f_ok[0] else -1,
                self.fwd_version[tick, -1] if f_ok[-1] else -1,
                self.fwd_version[tick, -1] if f_ok[-1] else -1,
                self.bwd_version[tick, 0] if b_ok[0] else -1,
                self.acc[tick, 0] if b_ok[0] else -1)
    return TickKind(bool(f_ok.any()), bool(b_ok.any()),
                    uniform(self.fwd_version[tick], f_ok), uniform(self.bwd_version[tick], b_ok),
                    *map(scalar, shared))

  def _split_kind(self) -> TickKind:
    """zb1's one kind for every tick: a loop of F, head, B and W, each gated per tick.

    A slot's three kinds of work move between the stages every tick, so the
    step is one loop whose body holds all of them, each stage's under a cond
    on its own row (and the head on the last stage's forward). The shared
    entries say whether the plan has any such microbatch (a plan cut to one
    tick, as the planner costs it, may have none).
    """
    def any_of(column):
      return 0 if (column >= 0).any() else None

    return TickKind(bool((self.fwd >= 0).any()), bool((self.bwd >= 0).any()), 0, 0,
                    any_of(self.embed_version), any_of(self.head_version),
                    any_of(self.head_acc), any_of(self.embed_grad_version),
                    any_of(self.embed_acc), wgt=bool((self.wgt >= 0).any()))

  def kinds(self) -> list[TickKind]:
    """The distinct tick kinds of the step, in order of first appearance."""
    out = []
    for t in range(self.num_ticks):
      k = self.kind(t)
      if k not in out:
        out.append(k)
    return out

  def segments(self) -> list[tuple[TickKind, int, int]]:
    """Maximal runs of consecutive ticks of one kind: (kind, first tick, end tick)."""
    out = []
    for t in range(self.num_ticks):
      k = self.kind(t)
      if out and out[-1][0] == k:
        out[-1] = (k, out[-1][1], t + 1)
      else:
        out.append((k, t, t + 1))
    return out

  def tick_costs(self) -> np.ndarray:
    """[T] duration of each tick under the cost model (FORWARD_COST, BACKWARD_COST).

    An interleaved tick runs one chunk, 1/v of a stage's blocks: it lasts 1/v
    of a tick of the other schedules. A zb1 tick lasts as long as its
    busiest stage's F, B and W's (one unit each).
    """
    if self.split_backward:
      work = (FORWARD_COST * (self.fwd >= 0) + INPUT_GRAD_COST * (self.bwd >= 0)
              + WEIGHT_GRAD_COST * (self.wgt >= 0).sum(axis=-1))
      return work.max(axis=1).astype(float)
    return np.array([(FORWARD_COST * k.fwd + BACKWARD_COST * k.bwd) / self.virtual_stages
                     for k in map(self.kind, range(self.num_ticks))])
