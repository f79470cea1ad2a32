"""What a schedule costs before it runs: the planner's models of memory, work, traffic, bubbles.

Each function takes what a run is built from (a `Schedule`, the model's
`StageFns`, abstract parameters, a `StepPlan`), never a config: the planner
(`jaxpipe.cli.planner`) builds those from a config exactly as training does,
calls these for every schedule and stash choice, and keeps the results in an
`Estimate`. Nothing is compiled: every shape comes from `jax.eval_shape`,
every FLOP count from a jaxpr (`_cost`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np

from jaxpipe.pipeline import _vocab
from jaxpipe.pipeline._cost import MemoryTerm, flops, memory_terms, memory_total, stage_tick
from jaxpipe.pipeline._engine import Engine, StageFns
from jaxpipe.pipeline._names import STASH_MODES
from jaxpipe.pipeline._plan import StepPlan
from jaxpipe.pipeline._states import Tree, split_params
from jaxpipe.pipeline._timetable import check_virtual_stages, facts, min_microbatches

__all__ = ["Estimate", "ScheduleMemory", "cannot_run", "schedule_memory", "stage_work",
           "steady_bubble", "tick_traffic"]


def steady_bubble(schedule: str, num_stages: int, num_microbatches: int,
                  virtual_stages: int = 1) -> Optional[float]:
  """Idle share of a steady-state step, from the engine's plan (None: invalid)."""
  try:
    return facts(schedule, num_stages, num_microbatches, virtual_stages).bubble
  except ValueError:
    return None


def cannot_run(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int,
               num_layers: int) -> bool:
  """Whether `schedule` refuses S, M, v (interleaved's chunks per device) or the layer count."""
  s_, m, v = num_stages, num_microbatches, virtual_stages
  if schedule == "none":
    return False
  try:
    check_virtual_stages(schedule, s_, m, v)
  except ValueError:
    return True
  return m < min_microbatches(schedule, s_, v) or num_layers % (s_ * v) != 0


def _bytes(tree: Tree) -> int:
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


class ScheduleMemory(NamedTuple):
  """One schedule's memory, as `schedule_memory` counts it.

  Attributes:
    terms: the named terms per device (`memory_terms`).
    checkpoint: (bytes a checkpoint's state holds, bytes of the whole state),
      over the whole mesh (`Schedule.checkpointed`).
    stage_params: parameters one pipeline device holds per weight version;
      None without stages.
  """
  terms: list[MemoryTerm]
  checkpoint: tuple[int, int]
  stage_params: Optional[int]


def schedule_memory(sched, params: Tree, batch_shape: tuple[int, int, int],
                    opt_parts: Optional[Callable[[Tree], dict[str, int]]] = None
                    ) -> ScheduleMemory:
  """Memory of `sched` (a `Schedule`) for abstract natural `params` and (M, B/M, seq) batches.

  The schedule counts its own terms from the plan it executes
  (`memory_terms`, which `opt_parts` splits the optimizer state for).
  """
  state = jax.eval_shape(lambda p: sched.init(p, batch_shape), params)
  checkpoint = (_bytes(sched.checkpointed(state)), _bytes(state))
  terms = memory_terms(sched, params, batch_shape, opt_parts=opt_parts)
  if not sched.pipelined:
    return ScheduleMemory(terms, checkpoint, None)
  padded = jax.eval_shape(sched.pad, params)
  stage_params = sum(int(np.prod(s.shard_shape(x.shape))) for x, s in zip(
      jax.tree.leaves(padded), jax.tree.leaves(sched.param_shardings(padded))))
  return ScheduleMemory(terms, checkpoint, stage_params)


def _as_run(fns: StageFns, vocab_parallel: bool) -> StageFns:
  """The stage functions as a schedule gives them to its engine (`Schedule`)."""
  return fns if vocab_parallel else fns._replace(vocab_axes=jax.tree.map(
      lambda _: None, fns.vocab_axes, is_leaf=lambda a: a is None))


def tick_traffic(fns: StageFns, params: Tree, plan: StepPlan, tokens: jax.ShapeDtypeStruct, *,
                 stash: str, vocab_parallel: bool) -> dict[str, float]:
  """Bytes one device sends in a steady tick of `plan`, by kind (`Engine.traffic`).

  `params` are abstract natural parameters; `tokens` one microbatch's
  [rows per device, seq] token ids.
  """
  _, shared = split_params(params)
  engine = Engine(_as_run(fns, vocab_parallel), plan, stash=stash)
  return engine.traffic(_bytes(jax.eval_shape(fns.embed, shared, tokens)),
                        tokens.shape[0] * tokens.shape[1])


def stage_work(fns: StageFns, params: Tree, plan: StepPlan, tokens: jax.ShapeDtypeStruct, *,
               vocab_parallel: bool) -> dict[str, list[float]]:
  """{stash: [FLOPs of one steady-state tick of stage s, s = 0..S-1]} for each stash choice.

  Counted from each stage's own tick program (`stage_tick`, `flops`): a
  forward and a backward of one microbatch (zb1: its F, head, B and W).
  """
  blocks, shared = split_params(params)
  run_fns = _as_run(fns, vocab_parallel)
  if vocab_parallel:
    shared = jax.eval_shape(lambda t: _vocab.pad_vocab(
        t, fns.vocab_axes, _vocab.padded_vocab(fns.vocab_size, plan.num_stages)), shared)
  return {stash: _tick_costs(run_fns, plan, blocks, shared, tokens, stash)
          for stash in STASH_MODES}


def _tick_costs(fns, plan_obj, blocks, shared, tokens, stash: str) -> list[float]:
  """FLOPs of the busiest tick of every stage's own program (see `Estimate.work`)."""
  if plan_obj.split_backward:
    return _split_tick_costs(fns, plan_obj, blocks, shared, tokens, stash)
  busy = [int((plan_obj.fwd[t] >= 0).sum() + (plan_obj.bwd[t] >= 0).sum())
          for t in range(plan_obj.num_ticks)]
  tick = int(np.argmax(busy))
  out = []
  for s in range(plan_obj.num_stages):
    fn, args = stage_tick(fns, plan_obj, s, blocks, shared, tokens, stash=stash, tick=tick)
    out.append(flops(fn, *args)["total"])
  if not plan_obj.fwd[tick].min() >= 0 or not plan_obj.bwd[tick].min() >= 0:
    # gpipe's ticks hold a forward or a backward: add the backward tick's work.
    t_b = int(np.argmax([int((plan_obj.bwd[t] >= 0).sum()) for t in range(plan_obj.num_ticks)]))
    for s in range(plan_obj.num_stages):
      fn, args = stage_tick(fns, plan_obj, s, blocks, shared, tokens, stash=stash, tick=t_b)
      out[s] += flops(fn, *args)["total"]
  return out


def _split_tick_costs(fns, plan_obj, blocks, shared, tokens, stash: str) -> list[float]:
  """zb1: per stage, the FLOPs of one microbatch's F, head, B and W.

  A zb1 tick's program holds each phase under a cond and `flops` counts a
  cond's costlier branch: a one-tick plan in which every stage runs F, B
  and one W (a steady tick) counts each phase once, the head included, as
  1f1b's steady tick does.
  """
  cells = np.zeros((1, plan_obj.num_stages), np.int32)
  rows = np.zeros((1,), np.int32)
  every = dataclasses.replace(
      plan_obj, **{k: cells for k in ("fwd", "bwd", "fwd_version", "bwd_version", "acc",
                                      "fwd_slot", "bwd_slot", "bwd_wslot",
                                      "fwd_chunk", "bwd_chunk")},
      **{k: cells[..., None] for k in ("wgt", "wgt_slot")},  # one W per cell
      **{k: rows for k in ("embed_version", "head_version", "head_acc", "embed_grad_version",
                           "embed_acc")})
  out = []
  for s in range(plan_obj.num_stages):
    fn, args = stage_tick(fns, every, s, blocks, shared, tokens, stash=stash, tick=0)
    out.append(flops(fn, *args)["total"])
  return out


@dataclasses.dataclass
class Estimate:
  """Per-device memory and per-stage work of every schedule for one run's shapes.

  Attributes:
    schedule: the run's own schedule (`total`'s default is its stash choice).
    stash: the run's own stash choice (`total`'s and `balance`'s default).
    num_params: parameters of the whole model.
    stage_params: parameters one pipeline device holds per weight version
      (its L/S blocks with 1/D of their experts under expert parallelism,
      its 1/S of the (padded) vocabulary rows and columns, the final norm).
    terms: {schedule: {stash: [MemoryTerm, ...]}}: the named terms of the
      schedule's memory per device (`memory_terms`); None where the
      schedule refuses the run (2bw with M < 2(S-1)). `none` has one stash
      entry, 'inputs' (it has no stages).
    work: {stash: [FLOPs of one steady-state tick (a forward and a backward
      of one microbatch) of stage s, s = 0..S-1]}, counted from the stage's
      own program (`stage_work`); {} without stages.
    bubble: {schedule: steady-state idle share, or None}.
    warnings: one line each.
    traffic: bytes one device sends in a steady tick of the run's
      schedule, by kind ('point_to_point', 'head', 'embedding':
      `tick_traffic`); {} without stages.
    vocab_parallel: whether the embedding and head are split over the
      stages.
    checkpoint: {schedule: {stash: (bytes a checkpoint's state holds, bytes
      of the whole state)}}, over the whole mesh (`Schedule.checkpointed`:
      2bw's in-flight arrays are recomputed at resume, not saved); None
      where the schedule refuses the run.
    facts: `facts` of the run's schedule (ticks, bubble, stash slots,
      transfers, ...), as a dict; None where it refuses.
    cfg: what the estimate was made for (the planner's resolved config), for
      its report; nothing here reads it.
  """
  schedule: str
  stash: str
  num_params: int
  stage_params: int
  terms: dict[str, dict[str, Optional[list]]]
  work: dict[str, list[float]]
  bubble: dict[str, Optional[float]]
  warnings: list[str] = dataclasses.field(default_factory=list)
  traffic: dict[str, float] = dataclasses.field(default_factory=dict)
  vocab_parallel: bool = True
  checkpoint: dict[str, dict[str, Optional[tuple[int, int]]]] = dataclasses.field(
      default_factory=dict)
  facts: Optional[dict[str, Any]] = None
  cfg: Any = None

  @property
  def bytes(self) -> dict[str, dict[str, Optional[dict[str, int]]]]:
    """{schedule: {stash: {term key: bytes per device, 'ticks': the tick terms' sum}}}."""
    def row(terms):
      if terms is None:
        return None
      out = {t.key: t.nbytes for t in terms}
      out["ticks"] = sum(t.nbytes for t in terms if t.phase == "ticks")
      return out
    return {n: {st: row(ts) for st, ts in by.items()} for n, by in self.terms.items()}

  def total(self, schedule: str, stash: Optional[str] = None) -> Optional[int]:
    """Bytes per device of a schedule (with the run's stash choice by default).

    The state, what lives through the step, and the larger of one tick's
    working set and the update's temporaries (`memory_total`).
    """
    stash = stash or (self.stash if schedule != "none" else "inputs")
    terms = self.terms[schedule].get(stash if schedule != "none" else "inputs")
    return None if terms is None else memory_total(terms)

  def balance(self, stash: Optional[str] = None) -> Optional[float]:
    """The slowest stage's work per tick over the mean stage's (1.0 is even)."""
    work = self.work.get(stash or self.stash)
    if not work:
      return None
    return max(work) / (sum(work) / len(work))
