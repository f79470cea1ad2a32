"""Each schedule's `StepPlan`: the rules a schedule sets on S, M and v, and its arrays.

`step_plan` builds a pipelined schedule's plan in two parts: the schedule's
own builder lays out which microbatch each stage runs forward and backward
in each tick (GPipe's forwards then backwards, 1F1B's lockstep, 2BW's window
over two batches, interleaved's chunks, ZB-H1's W's moved into idle ticks),
and the bookkeeping every plan shares reads the rest off that layout:
versions, accumulators, stash slots, the per-tick shared entries. The rules
(`min_microbatches`, `check_virtual_stages`) are checked here, and by the
schedules and the config before anything is built. Pure Python and NumPy.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import numpy as np

from jaxpipe.pipeline._names import PIPELINED
from jaxpipe.pipeline._plan import StepPlan
from jaxpipe.pipeline._zbh1 import one_f_one_b, zb_h1

__all__ = ["step_plan", "forward_plan", "min_microbatches", "check_virtual_stages",
           "layer_order", "stash_slots"]


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


class _Layout(NamedTuple):
  """One schedule's layout of a step, before the bookkeeping that every plan shares.

  Attributes:
    window, history, versions: `StepPlan`'s window, history and num_versions.
    fwd, bwd: int [T, S], the window index of each forward (backward), -1 for none.
    batch: int [window], the batch of each window index: its weight version
      and its accumulator (0: batch k-1, 1: batch k in 2bw; else 0).
    slot: int [window], the stash slot offset of each window index; None
      where the builder gives the slots per (tick, stage) (`chunked`).
    chunked: interleaved's (fwd_chunk, bwd_chunk, fwd_slot, bwd_slot), else None.
    wgt: zb1's W's, int [T, S, J], else None.
  """
  window: int
  history: int
  versions: int
  fwd: np.ndarray
  bwd: np.ndarray
  batch: np.ndarray
  slot: Optional[np.ndarray]
  chunked: Optional[tuple] = None
  wgt: Optional[np.ndarray] = None


def _two_bw(num_stages: int, num_microbatches: int, virtual_stages: int) -> _Layout:
  """2BW: a window of two batches, the previous one's backwards beside this one's forwards."""
  del virtual_stages
  s_, m = num_stages, num_microbatches
  stage = np.arange(s_)[None, :]
  tick = np.arange(m)[:, None]
  # Forward of microbatch t-s, backward of t-2(S-1)+s, both counted from
  # the start of this step's batch; negative ones are the previous batch's.
  fwd = m + tick - stage
  bwd = m + tick - 2 * (s_ - 1) + stage
  window = 2 * m
  batch = (np.arange(window) >= m).astype(np.int32)   # 0: batch k-1, 1: batch k
  slot = np.arange(window) - m                        # offset from this batch's first
  return _Layout(window, m, 2, fwd, bwd, batch, slot)


def _one_f_one_b(num_stages: int, num_microbatches: int, virtual_stages: int) -> _Layout:
  """1F1B (and pipedream, whose versions the engine is given per stage): `_zbh1.one_f_one_b`."""
  del virtual_stages
  m = num_microbatches
  fwd, bwd = one_f_one_b(num_stages, m)
  return _Layout(m, 0, 1, fwd, bwd, np.zeros(m, np.int32), np.arange(m))


def _interleaved_layout(num_stages: int, num_microbatches: int,
                        virtual_stages: int) -> _Layout:
  """Interleaved 1F1B: v chunks per stage, slots given per (tick, stage) (`_interleaved`)."""
  m = num_microbatches
  fwd, fwd_chunk, bwd, bwd_chunk, fwd_slot, bwd_slot, _ = _interleaved(num_stages, m,
                                                                       virtual_stages)
  return _Layout(m, 0, 1, fwd, bwd, np.zeros(m, np.int32), None,
                 chunked=(fwd_chunk, bwd_chunk, fwd_slot, bwd_slot))


def _zb1(num_stages: int, num_microbatches: int, virtual_stages: int) -> _Layout:
  """ZB-H1: 1F1B's ticks, each stage's W moved into ticks it would idle in (`_zbh1`)."""
  del virtual_stages
  m = num_microbatches
  table = zb_h1(num_stages, m)
  return _Layout(m, 0, 1, table.fwd, table.bwd, np.zeros(m, np.int32), np.arange(m),
                 wgt=table.wgt)


def _gpipe(num_stages: int, num_microbatches: int, virtual_stages: int) -> _Layout:
  """GPipe: M+S-1 forward ticks, then the backwards in reverse order."""
  del virtual_stages
  m = num_microbatches
  tick = np.arange(m + num_stages - 1)[:, None]
  f = tick - np.arange(num_stages)[None, :]
  f = np.where((f >= 0) & (f < m), f, -1)
  none = np.full_like(f, -1)
  return _Layout(m, 0, 1, np.concatenate([f, none]), np.concatenate([none, f[::-1]]),
                 np.zeros(m, np.int32), np.arange(m))


_BUILDERS = {"2bw": _two_bw, "1f1b": _one_f_one_b, "pipedream": _one_f_one_b,
             "interleaved": _interleaved_layout, "zb1": _zb1, "gpipe": _gpipe}


def step_plan(schedule: str, num_stages: int, num_microbatches: int,
              virtual_stages: int = 1) -> StepPlan:
  """Builds the per-step plan of a pipelined schedule (see `_plan`'s module docstring).

  `virtual_stages`: v, the chunks of blocks per device (interleaved only).
  """
  s_, m, v = num_stages, num_microbatches, virtual_stages
  if schedule not in PIPELINED:
    raise ValueError(f"schedule {schedule!r} has no stage plan; choose from {PIPELINED}")
  check_virtual_stages(schedule, s_, m, v)
  if m < min_microbatches(schedule, s_, v):
    raise ValueError(f"{schedule} needs at least {min_microbatches(schedule, s_, v)} "
                     f"microbatches for {s_} stages, got {m}")
  lay = _BUILDERS[schedule](s_, m, v)
  fwd, bwd, batch = lay.fwd.astype(np.int32), lay.bwd.astype(np.int32), lay.batch
  if lay.chunked is None:
    fwd_chunk = np.where(fwd >= 0, 0, -1)
    bwd_chunk = np.where(bwd >= 0, 0, -1)
    fwd_slot, bwd_slot = _per_tick(fwd, lay.slot), _per_tick(bwd, lay.slot)
  else:
    fwd_chunk, bwd_chunk, fwd_slot, bwd_slot = lay.chunked
  fwd_chunk, bwd_chunk = fwd_chunk.astype(np.int32), bwd_chunk.astype(np.int32)
  # The per-tick shared entries: stage 0's forward of the first chunk (the
  # embedding), the last stage's of the last chunk (the head), stage 0's
  # backward of the first chunk (the embedding's gradient).
  embeds = np.where(fwd_chunk[:, 0] == 0, fwd[:, 0], -1)
  heads = np.where(fwd_chunk[:, -1] == v - 1, fwd[:, -1], -1)
  grads = np.where(bwd_chunk[:, 0] == 0, bwd[:, 0], -1)
  head_version = _per_tick(heads, batch)
  shared_versions = lay.versions
  split = lay.wgt is not None
  if split:
    wgt = lay.wgt
    bwd_wslot, wgt_slot, w_slots = _w_slots(bwd, wgt)
  else:
    wgt = np.full(fwd.shape + (1,), -1, np.int32)
    bwd_wslot, wgt_slot, w_slots = np.full_like(fwd, -1), wgt.copy(), 0
  if schedule == "pipedream":
    # Shared version 0 is the embedding's (stage 0's lag), 1 the head's (none).
    head_version = np.where(fwd[:, -1] >= 0, 1, -1).astype(np.int32)
    shared_versions = 2
  return StepPlan(
      schedule=schedule, num_stages=s_, num_microbatches=m, window=lay.window,
      history=lay.history, num_versions=lay.versions, num_shared_versions=shared_versions,
      num_accumulators=lay.versions, slots=stash_slots(schedule, s_, m, v),
      slot_base_step=schedule == "2bw", head_stash=schedule == "gpipe", virtual_stages=v,
      fwd=fwd, bwd=bwd, fwd_version=_per_tick(fwd, batch), bwd_version=_per_tick(bwd, batch),
      acc=_per_tick(bwd, batch), fwd_slot=fwd_slot.astype(np.int32),
      bwd_slot=bwd_slot.astype(np.int32), embed_version=_per_tick(embeds, batch),
      head_version=head_version, head_acc=_per_tick(heads, batch),
      embed_grad_version=_per_tick(grads, batch), embed_acc=_per_tick(grads, batch),
      fwd_chunk=fwd_chunk, bwd_chunk=bwd_chunk, split_backward=split, wgt=wgt,
      bwd_wslot=bwd_wslot, wgt_slot=wgt_slot, w_slots=w_slots,
      inbox_slots=_inbox_slots(fwd, bwd) if split else 0)


def forward_plan(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> StepPlan:
  """The forward ticks of a flushed step alone, with every backward dropped: what evaluation runs.

  GPipe's M+S-1 forward ticks; with v > 1 chunks the forward halves of
  interleaved's first Mv+S-1 ticks (each group of S microbatches goes round
  the ring v times, chunk by chunk, the head after the last). Either way
  stage s runs its k-th forward in tick k + s, as in the step.
  """
  v = virtual_stages
  plan = step_plan("interleaved" if v > 1 else "gpipe", num_stages, num_microbatches, v)
  ticks = num_microbatches * v + num_stages - 1
  cut = {f.name: getattr(plan, f.name)[:ticks] for f in dataclasses.fields(plan)
         if isinstance(getattr(plan, f.name), np.ndarray)}
  for name in ("bwd", "bwd_version", "acc", "bwd_slot", "bwd_chunk", "embed_grad_version",
               "embed_acc"):
    cut[name] = np.full_like(cut[name], -1)
  return dataclasses.replace(plan, head_stash=False, **cut)
