"""ZB-H1's timetable (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, 2024).

A slot is one unit of work on every stage: a forward F, an input-gradient
backward B or a weight-gradient backward W of one microbatch (the cost model
F = B = W = 1), with activations and cotangents crossing to the neighbour
stages between slots. Stage s runs, in order, 1F1B's sequence of F and B
(S - s forwards, then B and F alternately, then the remaining B), and W of
microbatch m right after B of microbatch m + s (then the last s W at the
end): stage s defers its W by s microbatches, which fills the drain that
1F1B leaves. Each stage then holds at most S microbatches between their F
and their W (1F1B's peak, on stage 0); B frees the forward's residuals and
W's stash lives from B to W, at most s + 1 microbatches.

The step takes 3M + S - 1 slots, a bubble of (S - 1) / (3M + S - 1) against
1F1B's 3(S - 1) / (3M + 3(S - 1)) in the same slots (B and W fused).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["ZBTable", "zb_h1"]


class ZBTable(NamedTuple):
  """Per slot and stage, the microbatch of each kind of work (-1: none).

  Attributes:
    fwd, bwd, wgt: int [slots, stages] arrays: F, B and W (one of them, at
      most, is >= 0 per entry).
  """
  fwd: np.ndarray
  bwd: np.ndarray
  wgt: np.ndarray

  @property
  def num_slots(self) -> int:
    """How many slots the step takes."""
    return self.fwd.shape[0]

  def render(self) -> str:
    """The table as text: a row per stage, a column per slot."""
    rows = ["slot " + " ".join(f"{t:>3}" for t in range(self.num_slots))]
    for s in range(self.fwd.shape[1]):
      cells = []
      for t in range(self.num_slots):
        for kind, a in (("F", self.fwd), ("B", self.bwd), ("W", self.wgt)):
          if a[t, s] >= 0:
            cells.append(f"{kind}{a[t, s]}")
            break
        else:
          cells.append(".")
      rows.append(f"s{s:<3} " + " ".join(f"{c:>3}" for c in cells))
    return "\n".join(rows)


def _order(num_stages: int, num_microbatches: int, stage: int) -> list:
  """Stage `stage`'s work in order: (kind, microbatch)."""
  warm = min(num_stages - stage, num_microbatches)
  seq = [("F", m) for m in range(warm)]
  next_f = warm
  for m in range(num_microbatches):
    seq.append(("B", m))
    if m - stage >= 0:
      seq.append(("W", m - stage))
    if next_f < num_microbatches:
      seq.append(("F", next_f))
      next_f += 1
  seq += [("W", m) for m in range(max(0, num_microbatches - stage), num_microbatches)]
  return seq


def zb_h1(num_stages: int, num_microbatches: int) -> ZBTable:
  """ZB-H1's timetable: each stage's order (module docstring), each item at its earliest slot.

  An item waits for its stage's previous item and for its input: F for the
  previous stage's F of the microbatch, B for the next stage's B (the last
  stage: its own F), W for its own B; a result is usable the slot after.
  """
  S, M = num_stages, num_microbatches
  orders = [_order(S, M, s) for s in range(S)]
  done, pos, free = {}, [0] * S, [0] * S
  placed = []
  progress = True
  while progress:
    progress = False
    for s in range(S):
      while pos[s] < len(orders[s]):
        kind, m = orders[s][pos[s]]
        if kind == "F":
          dep = ("F", s - 1, m) if s else None
        elif kind == "B":
          dep = ("F", s, m) if s == S - 1 else ("B", s + 1, m)
        else:
          dep = ("B", s, m)
        if dep is not None and dep not in done:
          break
        t = max(free[s], done[dep] if dep else 0)
        done[(kind, s, m)] = t + 1
        placed.append((t, s, kind, m))
        free[s], pos[s], progress = t + 1, pos[s] + 1, True
  if any(p < len(o) for p, o in zip(pos, orders)):
    raise AssertionError("ZB-H1's orders deadlocked")  # cannot happen: each order is 1F1B's
  slots = max(free)
  tables = {k: np.full((slots, S), -1, np.int32) for k in "FBW"}
  for t, s, kind, m in placed:
    tables[kind][t, s] = m
  return ZBTable(tables["F"], tables["B"], tables["W"])
