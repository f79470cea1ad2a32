"""ZB-H1 on 1F1B's ticks (after Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241).

ZB-H1 splits a stage's backward into B (the input's gradient, which the
previous stage waits for) and W (the weights' gradient, which can wait) and
moves W into the pipeline's drain, where 1F1B leaves stages idle. The paper
places one item per stage per slot; in an SPMD program in which every stage
runs the same tick in lockstep, each slot is a tick that lasts as long as
its slowest item and pays a tick's fixed costs (the exchange, the conds), so
3M + S - 1 short ticks cost more than ZB-H1 saves (measured:
docs/benchmark.md). Here the ticks are 1F1B's (M + 2(S-1) of them; stage s
runs the forward of microbatch t - s and the backward's B of microbatch
t - 2(S-1) + s in tick t) and only W moves: a tick runs, per stage, at most
one F, at most one B and any number of W, and lasts as long as the stage
with the most work in it.

W is placed greedily, tick by tick (`_place_w`): a stage keeps at most K - 1
W's pending after a tick (the older ones run in it; each costs a slot of W's
stash), the tick lasts as long as its busiest stage then, and every stage
fills what is left of the tick with its oldest pending W's; the last tick
runs every W still pending. K = 1 is 1F1B (W right after its B); a larger K
lets a stage skip W in the ticks where it is the slowest (the last stage
while the pipeline fills, and the first while it drains) and run it where
another stage sets the tick's length. `zb_h1` takes the K in 1..S+1 of the
cheapest step under ZB-H1's cost model (F = B = W = 1), the smallest on a
tie. At S = 2 this reaches ZB-H1's own 3M + S - 1 units (its bubble,
(S-1)/(3M+S-1), a third of 1F1B's); at larger S the fill, in which the
last stage runs F and B in one tick while the others run F alone, keeps
some of 1F1B's bubble (S=4, M=8: 29 units against ZB-H1's 27 and 1F1B's 33).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["ZBTable", "zb_h1", "one_f_one_b"]

# ZB-H1's cost model: F, B and W one unit each.
_F, _B, _W = 1.0, 1.0, 1.0


class ZBTable(NamedTuple):
  """Per tick and stage, the microbatch of each kind of work (-1: none).

  Attributes:
    fwd, bwd: int32 [ticks, stages]: F and B.
    wgt: int32 [ticks, stages, J]: the W's of the cell, oldest first, -1
      padded (J: the most W's any cell runs).
    cost: the step's length under the cost model (the sum over ticks of the
      busiest stage's work).
  """
  fwd: np.ndarray
  bwd: np.ndarray
  wgt: np.ndarray
  cost: float

  @property
  def num_ticks(self) -> int:
    """How many ticks the step takes."""
    return self.fwd.shape[0]


def one_f_one_b(num_stages: int, num_microbatches: int) -> tuple[np.ndarray, np.ndarray]:
  """1F1B's ticks: (fwd, bwd) int32 [M + 2(S-1), S], -1 where a stage has none.

  Stage s runs the forward of microbatch t - s and the backward of
  t - 2(S-1) + s in tick t (1f1b's and pipedream's plans, and zb1's F and B).
  """
  s_, m = num_stages, num_microbatches
  tick = np.arange(m + 2 * (s_ - 1))[:, None]
  stage = np.arange(s_)[None, :]
  f, b = tick - stage, tick - 2 * (s_ - 1) + stage
  return (np.where((f >= 0) & (f < m), f, -1).astype(np.int32),
          np.where((b >= 0) & (b < m), b, -1).astype(np.int32))


def _place_w(fwd: np.ndarray, bwd: np.ndarray, keep: int) -> tuple[list, float]:
  """W's placed greedily (module docstring) with at most `keep` - 1 pending after a tick.

  Returns (per tick and stage, the list of W's microbatches; the step's cost).
  """
  ticks, stages = fwd.shape
  pending = [[] for _ in range(stages)]
  cells, total = [], 0.0
  for t in range(ticks):
    fb = [_F * (fwd[t, s] >= 0) + _B * (bwd[t, s] >= 0) for s in range(stages)]
    for s in range(stages):
      if bwd[t, s] >= 0:
        pending[s].append(int(bwd[t, s]))
    may_keep = keep - 1 if t < ticks - 1 else 0
    runs = [max(0, len(p) - may_keep) for p in pending]
    length = max(fb[s] + _W * runs[s] for s in range(stages))
    row = []
    for s in range(stages):
      while runs[s] < len(pending[s]) and fb[s] + _W * (runs[s] + 1) <= length:
        runs[s] += 1
      row.append(pending[s][:runs[s]])
      pending[s] = pending[s][runs[s]:]
    cells.append(row)
    total += length
  return cells, total


def zb_h1(num_stages: int, num_microbatches: int) -> ZBTable:
  """zb1's timetable: 1F1B's F and B, each stage's W placed by `_place_w` (module docstring)."""
  fwd, bwd = one_f_one_b(num_stages, num_microbatches)
  best = None
  for keep in range(1, num_stages + 2):
    cells, cost = _place_w(fwd, bwd, keep)
    if best is None or cost < best[1]:
      best = (cells, cost)
  cells, cost = best
  most = max(1, max(len(w) for row in cells for w in row))
  wgt = np.full(fwd.shape + (most,), -1, np.int32)
  for t, row in enumerate(cells):
    for s, ws in enumerate(row):
      wgt[t, s, :len(ws)] = ws
  return ZBTable(fwd, bwd, wgt, float(cost))
