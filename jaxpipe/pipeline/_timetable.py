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

`facts` gives what the rest of the project needs to know about a schedule (the
fewest microbatches, ticks, the bubble, versions, stash slots), computed from
these arrays; `timetable` unrolls the plan over steps into the cells that
`tools/schedule_viz.py` draws and the tests check. Pure Python and NumPy.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from jaxpipe.pipeline._names import PIPELINED, SCHEDULE_NAMES
from jaxpipe.pipeline._zbh1 import one_f_one_b, zb_h1

__all__ = ["StepPlan", "TickKind", "Facts", "Cell", "Timetable",
           "step_plan", "facts", "timetable", "min_microbatches", "stash_slots",
           "FORWARD_COST", "BACKWARD_COST", "INPUT_GRAD_COST", "WEIGHT_GRAD_COST",
           "layer_order", "check_virtual_stages"]

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


def min_microbatches(schedule: str, num_stages: int, virtual_stages: int = 1) -> int:
  """The fewest microbatches per step a schedule accepts for S stages.

  Interleaved 1F1B with v > 1 chunks per device also needs M to be a multiple
  of S (`check_virtual_stages`).
  """
  if schedule == "2bw":
    # Every backward of batch k-1 must land within step k (docs/schedules.md).
    return max(1, 2 * (num_stages - 1))
  if schedule == "interleaved" and virtual_stages > 1:
    return num_stages
  return 1


def check_virtual_stages(schedule: str, num_stages: int, num_microbatches: int,
                         virtual_stages: int) -> None:
  """Raises ValueError (one line) where v chunks per device cannot run.

  Only `interleaved` splits a device's blocks into v > 1 chunks, and its
  order (Megatron's: groups of S microbatches go around the ring v times)
  needs M to be a multiple of S.
  """
  if virtual_stages < 1:
    raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
  if virtual_stages > 1 and schedule != "interleaved":
    raise ValueError(f"{schedule} runs one chunk of blocks per device; virtual_stages="
                     f"{virtual_stages} needs schedule interleaved")
  if schedule == "interleaved" and virtual_stages > 1 and num_microbatches % num_stages:
    raise ValueError(f"interleaved needs a number of microbatches that is a multiple of "
                     f"the {num_stages} stages, got {num_microbatches}")


def layer_order(num_layers: int, num_stages: int, virtual_stages: int) -> np.ndarray:
  """int [L]: the layer each position of interleaved's stacked blocks holds.

  The blocks are split into S*v chunks of L/(S v) consecutive layers; device
  s holds chunks s, s+S, ..., s+(v-1)S. Stacked in this order and sharded
  over 'stage' like every schedule's blocks, each device's contiguous slice
  is exactly its chunks, chunk j of the device (global chunk j*S + s) at
  local positions [j L/(S v), (j+1) L/(S v)). `own = canonical[order]`,
  `canonical = own[argsort(order)]`; v = 1 is the identity.
  """
  chunk = num_layers // (num_stages * virtual_stages)
  if chunk * num_stages * virtual_stages != num_layers:
    raise ValueError(f"{num_layers} layers do not split into {num_stages} stages x "
                     f"{virtual_stages} chunks")
  # [stage, chunk of the stage, layer of the chunk] -> canonical layer.
  s, j, i = np.meshgrid(np.arange(num_stages), np.arange(virtual_stages), np.arange(chunk),
                        indexing="ij")
  return ((j * num_stages + s) * chunk + i).reshape(-1)


def _interleaved(num_stages: int, num_microbatches: int, virtual_stages: int):
  """Interleaved 1F1B in lockstep: (fwd, fwd_chunk, bwd, bwd_chunk, slots, num_slots).

  Megatron's order (Narayanan et al. 2021): a device's k-th forward works on
  chunk (k // S) % v of microbatch (k // (S v)) S + k % S, its k-th backward
  on chunk v-1-(k // S) % v of the same microbatch formula. In lockstep
  stage s runs its forward k = t - s at tick t and its backward
  k = t - (v S + S - 2) + s. Then every transfer lands in the very next
  tick, across the ring's wrap too: stage S-1's output of chunk j of a
  microbatch is stage 0's input of chunk j+1 one tick later, and stage 0's
  input cotangent of chunk j+1 is stage S-1's output cotangent of chunk j.
  The last stage runs a microbatch's forward and backward of chunk v-1 in
  one tick (the head in between), as 1f1b does. v = 1 is 1f1b exactly.

  Stash slots: an entry lives from its forward's tick to its backward's; the
  engine writes a tick's forward before it reads its backward, so entries
  share a slot only when one is read before the other is written. Slots are
  given first-free in forward order (an interval colouring, which needs no
  more slots than entries alive at once: (v+1)S-1 on stage 0 once M v
  reaches it, Megatron's warm-up of 2(S-1) + (v-1)S forwards plus one).
  """
  s_, m, v = num_stages, num_microbatches, virtual_stages
  ticks = m * v + v * s_ + s_ - 2
  t = np.arange(ticks)[:, None]
  stage = np.arange(s_)[None, :]
  kf, kb = t - stage, t - (v * s_ + s_ - 2) + stage
  total = m * v

  def micro(k):
    return (k // (s_ * v)) * s_ + k % s_

  f_ok, b_ok = (kf >= 0) & (kf < total), (kb >= 0) & (kb < total)
  fwd = np.where(f_ok, micro(kf), -1)
  bwd = np.where(b_ok, micro(kb), -1)
  fwd_chunk = np.where(f_ok, (kf // s_) % v, -1)
  bwd_chunk = np.where(b_ok, v - 1 - (kb // s_) % v, -1)
  fwd_slot = np.full_like(fwd, -1)
  bwd_slot = np.full_like(bwd, -1)
  most = 0
  for st in range(s_):
    free, held = [], {}   # held: (mb, chunk) -> slot
    ends = []             # (read tick, slot) of the entries held
    used = 0
    for tick in range(ticks):
      # Slots read before this tick are free again.
      for end, slot in [e for e in ends if e[0] < tick]:
        free.append(slot)
        ends.remove((end, slot))
      if fwd[tick, st] >= 0:
        key = (int(fwd[tick, st]), int(fwd_chunk[tick, st]))
        if free:
          free.sort()
          slot = free.pop(0)
        else:
          slot, used = used, used + 1
        held[key] = slot
        fwd_slot[tick, st] = slot
        read = int(np.flatnonzero((bwd[:, st] == key[0]) & (bwd_chunk[:, st] == key[1]))[0])
        ends.append((read, slot))
      if bwd[tick, st] >= 0:
        bwd_slot[tick, st] = held.pop((int(bwd[tick, st]), int(bwd_chunk[tick, st])))
    most = max(most, used)
  return fwd, fwd_chunk, bwd, bwd_chunk, fwd_slot, bwd_slot, most


def stash_slots(schedule: str, num_stages: int, num_microbatches: int,
                virtual_stages: int = 1) -> int:
  """Stash slots each stage keeps (the ring the engine carries).

  A microbatch's stage input (or its residuals) lives on stage s from its
  forward to its backward, 2(S-1-s) ticks later; the engine writes a tick's
  forward before it reads its backward, so 2(S-1)+1 slots serve every stage
  of 1f1b, 2bw, pipedream and zb1 (whose F and B run in 1F1B's ticks).
  GPipe runs every forward before any backward: M slots.
  Interleaved: as many as its plan has alive at once ((v+1)S-1
  chunk inputs once M v reaches that; see `_interleaved`).
  """
  if schedule == "gpipe":
    return num_microbatches
  if schedule == "none":
    return 0
  if schedule == "interleaved":
    return _interleaved(num_stages, num_microbatches, virtual_stages)[-1]
  return 2 * (num_stages - 1) + 1


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

  def kind_index(self) -> np.ndarray:
    """int32 [T]: each tick's position in `kinds()` (the engine's branch)."""
    kinds = self.kinds()
    return np.array([kinds.index(self.kind(t)) for t in range(self.num_ticks)], np.int32)

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


def _per_tick(column: np.ndarray, table: np.ndarray) -> np.ndarray:
  """table[column] where column >= 0, else -1 (an int32 [T] or [T, S] array)."""
  return np.where(column >= 0, table[np.maximum(column, 0)], -1).astype(np.int32)


def _inbox_slots(fwd: np.ndarray, bwd: np.ndarray) -> int:
  """The fewest inbox slots K with which slot m mod K is never overwritten before it is read.

  Stage s's input of microbatch m arrives at the end of stage s-1's F of m
  and is read at the start of stage s's F of m; the input of m + K, which
  takes the same slot, must not arrive before that (the same for the
  cotangents, from stage s+1's B to stage s's). A tick reads before it writes.
  """
  def tick_of(table, s):
    return {int(m): t for t, m in enumerate(table[:, s]) if m >= 0}

  pairs = []
  for s in range(1, fwd.shape[1]):
    pairs.append((tick_of(fwd, s - 1), tick_of(fwd, s)))     # (sent, read) of the inputs
    pairs.append((tick_of(bwd, s), tick_of(bwd, s - 1)))     # and of the cotangents
  m = fwd.max() + 1
  for k in range(1, m + 1):
    if all(read[i] <= sent[i + k] for sent, read in pairs for i in range(m - k)):
      return k
  return int(m)


def _w_slots(bwd: np.ndarray, wgt: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
  """W's stash slots: (B's slot [T, S], each W's [T, S, J], slots per stage).

  Per stage, B takes the lowest free slot and W frees it. W's order is not
  B's (a W may wait past later ones), so slots are handed out, not m mod K.
  A tick's B writes before its W's read: their slots are not yet free.
  """
  bwd_wslot, wgt_slot = np.full_like(bwd, -1), np.full_like(wgt, -1)
  most = 0
  for s in range(bwd.shape[1]):
    held = {}
    for t in range(bwd.shape[0]):
      if bwd[t, s] >= 0:
        free = min(set(range(len(held) + 1)) - set(held.values()))
        held[int(bwd[t, s])] = bwd_wslot[t, s] = free
        most = max(most, len(held))
      for j, w in enumerate(wgt[t, s]):
        if w >= 0:
          wgt_slot[t, s, j] = held.pop(int(w))
  return bwd_wslot, wgt_slot, most


def step_plan(schedule: str, num_stages: int, num_microbatches: int,
              virtual_stages: int = 1) -> StepPlan:
  """Builds the per-step plan of a pipelined schedule (see module docstring).

  `virtual_stages`: v, the chunks of blocks per device (interleaved only).
  """
  s_, m, v = num_stages, num_microbatches, virtual_stages
  if schedule not in PIPELINED:
    raise ValueError(f"schedule {schedule!r} has no stage plan; choose from {PIPELINED}")
  check_virtual_stages(schedule, s_, m, v)
  if m < min_microbatches(schedule, s_, v):
    raise ValueError(f"{schedule} needs at least {min_microbatches(schedule, s_, v)} "
                     f"microbatches for {s_} stages, got {m}")
  stage = np.arange(s_)[None, :]
  fwd_chunk = bwd_chunk = fwd_slot = bwd_slot = None
  wgt = None
  if schedule == "2bw":
    window, history, versions = 2 * m, m, 2
    tick = np.arange(m)[:, None]
    # Forward of microbatch t-s, backward of t-2(S-1)+s, both counted from
    # the start of this step's batch; negative ones are the previous batch's.
    fwd = m + tick - stage
    bwd = m + tick - 2 * (s_ - 1) + stage
    batch = (np.arange(window) >= m).astype(np.int32)   # 0: batch k-1, 1: batch k
    slot = np.arange(window) - m                        # offset from this batch's first
  elif schedule in ("1f1b", "pipedream"):
    window, history, versions = m, 0, 1
    fwd, bwd = one_f_one_b(s_, m)
    batch = np.zeros(window, np.int32)
    slot = np.arange(window)
  elif schedule == "interleaved":
    window, history, versions = m, 0, 1
    fwd, fwd_chunk, bwd, bwd_chunk, fwd_slot, bwd_slot, _ = _interleaved(s_, m, v)
    batch = np.zeros(window, np.int32)
    slot = None
  elif schedule == "zb1":
    # 1F1B's ticks, each stage's W moved into ticks it would idle in (`_zbh1`).
    window, history, versions = m, 0, 1
    table = zb_h1(s_, m)
    fwd, bwd, wgt = table.fwd, table.bwd, table.wgt
    batch = np.zeros(window, np.int32)
    slot = np.arange(window)
  else:  # gpipe: M+S-1 forward ticks, then the backwards in reverse order.
    window, history, versions = m, 0, 1
    tick = np.arange(m + s_ - 1)[:, None]
    f = tick - stage
    f = np.where((f >= 0) & (f < m), f, -1)
    none = np.full_like(f, -1)
    fwd, bwd = np.concatenate([f, none]), np.concatenate([none, f[::-1]])
    batch = np.zeros(window, np.int32)
    slot = np.arange(window)
  fwd, bwd = fwd.astype(np.int32), bwd.astype(np.int32)
  if fwd_chunk is None:
    fwd_chunk = np.where(fwd >= 0, 0, -1)
    bwd_chunk = np.where(bwd >= 0, 0, -1)
    fwd_slot, bwd_slot = _per_tick(fwd, slot), _per_tick(bwd, slot)
  fwd_chunk, bwd_chunk = fwd_chunk.astype(np.int32), bwd_chunk.astype(np.int32)
  acc = _per_tick(bwd, batch)
  # The per-tick shared entries: stage 0's forward of the first chunk (the
  # embedding), the last stage's of the last chunk (the head), stage 0's
  # backward of the first chunk (the embedding's gradient).
  embeds = np.where(fwd_chunk[:, 0] == 0, fwd[:, 0], -1)
  heads = np.where(fwd_chunk[:, -1] == v - 1, fwd[:, -1], -1)
  grads = np.where(bwd_chunk[:, 0] == 0, bwd[:, 0], -1)
  head_version = _per_tick(heads, batch)
  shared_versions = versions
  split = wgt is not None
  if split:
    bwd_wslot, wgt_slot, w_slots = _w_slots(bwd, wgt)
  else:
    wgt = np.full(fwd.shape + (1,), -1, np.int32)
    bwd_wslot, wgt_slot, w_slots = np.full_like(fwd, -1), wgt.copy(), 0
  if schedule == "pipedream":
    # Shared version 0 is the embedding's (stage 0's lag), 1 the head's (none).
    head_version = np.where(fwd[:, -1] >= 0, 1, -1).astype(np.int32)
    shared_versions = 2
  return StepPlan(
      schedule=schedule, num_stages=s_, num_microbatches=m, window=window, history=history,
      num_versions=versions, num_shared_versions=shared_versions, num_accumulators=versions,
      slots=stash_slots(schedule, s_, m, v), slot_base_step=schedule == "2bw",
      head_stash=schedule == "gpipe", virtual_stages=v,
      fwd=fwd, bwd=bwd, fwd_version=_per_tick(fwd, batch), bwd_version=_per_tick(bwd, batch),
      acc=acc, fwd_slot=fwd_slot.astype(np.int32), bwd_slot=bwd_slot.astype(np.int32),
      embed_version=_per_tick(embeds, batch), head_version=head_version,
      head_acc=_per_tick(heads, batch), embed_grad_version=_per_tick(grads, batch),
      embed_acc=_per_tick(grads, batch), fwd_chunk=fwd_chunk, bwd_chunk=bwd_chunk,
      split_backward=split, wgt=wgt, bwd_wslot=bwd_wslot, wgt_slot=wgt_slot,
      w_slots=w_slots, inbox_slots=_inbox_slots(fwd, bwd) if split else 0)


@dataclasses.dataclass(frozen=True)
class Facts:
  """What the project needs to know of a schedule for S stages and M microbatches.

  Attributes:
    schedule, num_stages, num_microbatches: as given.
    min_microbatches: the fewest microbatches it accepts.
    ticks: ticks per step (0 for none).
    step_cost: a step's duration in units of one stage's forward (1) and
      backward (2) on one microbatch; `none` runs all S stages' work itself.
    bubble: share of stage time idle in a steady-state step (the fill of
      2bw's first step is not steady state).
    versions: weight versions each stage keeps.
    stash_slots: stash slots each stage keeps.
    gradient_delay: the gradient delay, in words.
    flushes: whether every step drains the pipeline.
    virtual_stages: v, the chunks of blocks each device holds.
    transfers: activations a step sends from device to device, over the
      whole pipeline (as many cotangents come back): M(S-1), and M(vS-1)
      for interleaved, whose microbatches go around the ring v times.
  """
  schedule: str
  num_stages: int
  num_microbatches: int
  min_microbatches: int
  ticks: int
  step_cost: float
  bubble: float
  versions: int
  stash_slots: int
  gradient_delay: str
  flushes: bool
  virtual_stages: int = 1
  transfers: int = 0


def facts(schedule: str, num_stages: int, num_microbatches: int,
          virtual_stages: int = 1) -> Facts:
  """The facts of a schedule, read off its plan (raises ValueError for a bad M or v)."""
  s_, m, v = num_stages, num_microbatches, virtual_stages
  if schedule not in SCHEDULE_NAMES:
    raise ValueError(f"unknown schedule '{schedule}'; choose from {', '.join(SCHEDULE_NAMES)}")
  delay = {"none": "none (or optimizer.delay)", "gpipe": "none", "1f1b": "none",
           "2bw": "one step", "pipedream": "S-1-s steps on stage s",
           "interleaved": "none", "zb1": "none"}[schedule]
  if schedule == "none":
    check_virtual_stages(schedule, s_, m, v)
    cost = (FORWARD_COST + BACKWARD_COST) * m * s_
    return Facts(schedule, s_, m, 1, 0, cost, 0.0, 1, 0, delay, True)
  plan = step_plan(schedule, s_, m, v)
  cost = float(plan.tick_costs().sum())
  # Busy time: every microbatch's forward and backward on every stage; a 2bw
  # step in steady state runs M of each (the previous batch's last ones
  # included), as do the flushed schedules (interleaved's v chunks make one
  # stage's work; zb1's B and W together cost a backward).
  busy = (FORWARD_COST + BACKWARD_COST) * m * s_
  versions = {"gpipe": 1, "1f1b": 1, "2bw": 2, "pipedream": s_, "interleaved": 1,
              "zb1": 1}[schedule]
  # Every forward sends its output on, but the last stage's of the last chunk.
  sends = int(((plan.fwd >= 0) & (plan.fwd_chunk * s_ + np.arange(s_) < v * s_ - 1)).sum())
  return Facts(schedule, s_, m, min_microbatches(schedule, s_, v), plan.num_ticks, cost,
               1.0 - busy / (cost * s_), versions, plan.slots, delay, schedule != "2bw", v,
               sends)


@dataclasses.dataclass(frozen=True)
class Cell:
  """What one stage does in one tick: global microbatch ids, versions, stash slots.

  A weight version is the number of updates the weights have seen (v[k] ran
  batch k in 2bw; with pipedream stage s runs batch k on v[k - (S-1-s)]).
  A chunk is which of the stage's chunks of blocks the forward (backward)
  runs: 0 but in interleaved, where chunk j of stage s is the pipeline's
  virtual stage j*S + s. In zb1 `bwd` is B (the input's gradient) and `wgt`
  the microbatches whose W (the weights' gradient) the stage runs, in
  order, with `wgt_slot` their W's stash slots; empty elsewhere.
  """
  fwd: Optional[int] = None
  bwd: Optional[int] = None
  fwd_version: Optional[int] = None
  bwd_version: Optional[int] = None
  fwd_slot: Optional[int] = None
  bwd_slot: Optional[int] = None
  fwd_chunk: Optional[int] = None
  bwd_chunk: Optional[int] = None
  wgt: tuple[int, ...] = ()
  wgt_slot: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Timetable:
  """A schedule unrolled over `num_steps` steps; `cells[tick][stage]`.

  `tick_costs[t]` is tick t's duration under the cost model (1 for a
  forward, 2 for a backward, 3 for a tick with both; divided by v for
  interleaved's ticks, which run one of a stage's v chunks; for zb1's, in
  which a stage runs F, B and W's of one unit each (`split_backward`), its
  busiest stage's count).
  """
  schedule: str
  num_stages: int
  num_microbatches: int
  num_steps: int
  ticks_per_step: int
  cells: tuple[tuple[Cell, ...], ...]
  tick_costs: tuple[float, ...]
  virtual_stages: int = 1
  split_backward: bool = False

  @property
  def num_ticks(self) -> int:
    return len(self.cells)

  def idle_fraction(self, step: int) -> float:
    """Share of one step's stage time left idle (the bubble, for a steady step).

    Counted from the cells: a stage is busy FORWARD_COST for each forward
    and BACKWARD_COST for each backward it runs (1/v of that for one of
    interleaved's chunks), out of the step's duration.
    """
    lo, hi = step * self.ticks_per_step, (step + 1) * self.ticks_per_step
    b_cost = INPUT_GRAD_COST if self.split_backward else BACKWARD_COST
    busy = sum(FORWARD_COST * (c.fwd is not None) + b_cost * (c.bwd is not None)
               + WEIGHT_GRAD_COST * len(c.wgt)
               for row in self.cells[lo:hi] for c in row) / self.virtual_stages
    return 1.0 - busy / (sum(self.tick_costs[lo:hi]) * self.num_stages)

  def ascii(self) -> str:
    """Renders the timetable: a row per stage, a column per tick.

    A cell reads `F3/B1`: forward of microbatch 3 and backward of microbatch 1
    (global numbers; batch = microbatch // M); a trailing `'v` gives the
    weight version when more than one is alive, and with v > 1 chunks a
    `c` the stage's chunk (`F3c1`: microbatch 3 through the stage's second
    chunk); `.` is an idle slot, and a tick in which no stage runs a forward
    (or a backward) drops that half. A zb1 cell lists its items, as in
    `F3/B1/W0W1` (B: the input's gradient; W: the weights'), or `.`.
    """
    if self.split_backward:
      return self._ascii_split()
    many_versions = self.schedule in ("2bw", "pipedream")
    chunks = self.virtual_stages > 1

    def part(kind: str, mb: Optional[int], ver: Optional[int], chunk: Optional[int]) -> str:
      if mb is None:
        return "."
      return (f"{kind}{mb}" + (f"v{ver}" if many_versions else "")
              + (f"c{chunk}" if chunks else ""))

    cols = []
    for row in self.cells:
      any_f = any(c.fwd is not None for c in row)
      any_b = any(c.bwd is not None for c in row)
      col = []
      for c in row:
        parts = ([part("F", c.fwd, c.fwd_version, c.fwd_chunk)] if any_f or not any_b
                 else []) + ([part("B", c.bwd, c.bwd_version, c.bwd_chunk)] if any_b else [])
        col.append("/".join(parts))
      cols.append(col)
    width = max(len(x) for col in cols for x in col)
    width = max(width, len(str(self.num_ticks - 1)))
    lines = [f"{self.schedule}: S={self.num_stages} M={self.num_microbatches}"
             + (f" v={self.virtual_stages}" if chunks else "")
             + f", {self.ticks_per_step} ticks per step, {self.num_steps} steps"]
    head = "tick    " + " ".join(f"{t:>{width}}" for t in range(self.num_ticks))
    lines.append(head)
    for s in range(self.num_stages):
      lines.append(f"stage {s:<2}" + " ".join(f"{cols[t][s]:>{width}}" for t in range(self.num_ticks)))
    lines += self._idle_lines()
    return "\n".join(lines)

  def _idle_lines(self) -> list[str]:
    return [f"step {k}: idle {self.idle_fraction(k):.1%} of stage time"
            for k in range(self.num_steps)]

  def _ascii_split(self) -> str:
    """`ascii` of a zb1 timetable: a cell's F, B and W's, or `.`."""
    def item(c: Cell) -> str:
      parts = [f"{kind}{mb}" for kind, mb in (("F", c.fwd), ("B", c.bwd)) if mb is not None]
      parts += ["".join(f"W{mb}" for mb in c.wgt)] if c.wgt else []
      return "/".join(parts) or "."

    cols = [[item(c) for c in row] for row in self.cells]
    width = max(max(len(x) for col in cols for x in col), len(str(self.num_ticks - 1)))
    lines = [f"{self.schedule}: S={self.num_stages} M={self.num_microbatches}, "
             f"{self.ticks_per_step} ticks per step, {self.num_steps} steps",
             "tick    " + " ".join(f"{t:>{width}}" for t in range(self.num_ticks))]
    for s in range(self.num_stages):
      lines.append(f"stage {s:<2}" + " ".join(f"{cols[t][s]:>{width}}"
                                              for t in range(self.num_ticks)))
    return "\n".join(lines + self._idle_lines())


def timetable(schedule: str, num_stages: int, num_microbatches: int,
              num_steps: int = 2, virtual_stages: int = 1) -> Timetable:
  """Unrolls a schedule's step plan over `num_steps` steps (2bw: step 0 fills).

  Global microbatch numbers, versions and slots come from the plan's arrays:
  window index w of step k is microbatch (k-1)*M + w for 2bw (k*M + w for
  the flushed schedules), plan version i of a 2bw step k is v[k-1+i], and a
  stash slot is (base + offset) mod slots with base k*M when the plan's base
  advances. Pipedream's plan has one block version, the one the engine is
  given: stage s's v[max(0, k-(S-1-s))]. Chunks are the plan's.
  """
  s_, m = num_stages, num_microbatches
  if schedule == "none":
    check_virtual_stages(schedule, s_, m, virtual_stages)
    cells = tuple((Cell(k * m + j, k * m + j, k, k),)
                  for k in range(num_steps) for j in range(m))
    cost = FORWARD_COST + BACKWARD_COST
    return Timetable(schedule, 1, m, num_steps, m, cells, (cost,) * len(cells))
  plan = step_plan(schedule, s_, m, virtual_stages)
  first = -m if plan.history else 0

  def version(k: int, stage: int, plan_version: int) -> int:
    if schedule == "pipedream":
      return max(0, k - (s_ - 1 - stage))
    if schedule == "2bw":
      return k - 1 + plan_version
    return k

  rows = []
  for k in range(num_steps):
    base = k * m if plan.slot_base_step else 0
    for t in range(plan.num_ticks):
      row = []
      for s in range(s_):
        f, b = int(plan.fwd[t, s]), int(plan.bwd[t, s])
        ws = [(int(w), int(slot)) for w, slot in zip(plan.wgt[t, s], plan.wgt_slot[t, s])
              if w >= 0]
        fg = k * m + first + f if f >= 0 else None
        bg = k * m + first + b if b >= 0 else None
        fg = fg if fg is not None and fg >= 0 else None   # 2bw's fill: no batch -1
        bg = bg if bg is not None and bg >= 0 else None
        row.append(Cell(
            fg, bg,
            None if fg is None else version(k, s, int(plan.fwd_version[t, s])),
            None if bg is None else version(k, s, int(plan.bwd_version[t, s])),
            None if fg is None else (base + int(plan.fwd_slot[t, s])) % plan.slots,
            None if bg is None else (base + int(plan.bwd_slot[t, s])) % plan.slots,
            None if fg is None else int(plan.fwd_chunk[t, s]),
            None if bg is None else int(plan.bwd_chunk[t, s]),
            tuple(k * m + w for w, _ in ws), tuple(slot for _, slot in ws)))
      rows.append(tuple(row))
  costs = tuple(float(c) for c in plan.tick_costs()) * num_steps
  return Timetable(schedule, s_, m, num_steps, plan.num_ticks, tuple(rows), costs,
                   virtual_stages, plan.split_backward)
