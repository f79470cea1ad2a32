"""Plans a pipeline run before launch: memory per device, work per stage, bubbles.

  python tools/planner.py --config configs/smollm-360m.yaml   (installed: jaxpipe-plan ...)
  python tools/planner.py --config configs/smollm-360m.yaml pipeline.microbatches=4 \
      --device-gib 24
  python tools/planner.py --config configs/tiny.yaml pipeline.schedule=2bw \
      pipeline.stages=2 --compile

Nothing runs and, without --compile, nothing compiles: every shape comes from
`jax.eval_shape` of the model's init, the optimizer's init and each schedule's
`init` (the same pytrees that training and checkpoints hold), placed with the
schedule's own shardings, so the numbers are the bytes that one device holds.
What lives only inside a step (gradient sums, the flushed schedules' stash,
the ticks' working sets) is estimated from shapes of the model's stage
functions (`jax.eval_shape` of `jax.vjp`); docs/benchmark.md compares the
estimate with XLA's analysis of the compiled step.

For the config's S stages, D data replicas and M microbatches it prints a
table with a column per schedule and stash choice (`none` is the whole model
on one device of the data axis, for comparison) and a row per kind of
memory; the work per tick of every stage (FLOPs of the stage's own tick
program, for both stash choices) and how far the slowest stage is above the
mean; the steady-state bubble of each schedule from the engine's plan; and
warnings: M too small for 2bw (it needs M >= 2(S-1)), a synchronous schedule
idling more than --max-bubble of every step, a total above --device-gib,
stages more than 10% apart. --compile also compiles the config's step ahead
of time on the emulated devices and prints XLA's memory per device.

A bad config exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
from typing import Any, Optional

from jaxpipe import config as config_lib
from jaxpipe import launch
from jaxpipe.cli import Parser
from jaxpipe.errors import ConfigError, InputError
from jaxpipe.pipeline import SCHEDULE_NAMES, STASH_MODES

SCHEDULES, STASHES = SCHEDULE_NAMES, STASH_MODES
# Interleaved's chunks per device in the table when the config's schedule is
# another one (whose pipeline.virtual_stages is 1).
VIRTUAL_STAGES = 2

# Rows of the table, in order: (key, label).
ROWS = (
    ("weights", "weights (x versions)"),
    ("opt", "optimizer state"),
    ("ef", "error-feedback buffer"),
    ("delay", "delay buffer"),
    ("inflight", "2bw in flight (stash, partial grads)"),
    ("batch", "token batches"),
    ("grads", "gradient accumulators (f32)"),
    ("stash", "stash ring (inside the step)"),
    ("ticks", "tick working sets"),
    ("update", "reduced grads + update"),
    ("copies", "version copies"),
)


def steady_bubble(schedule: str, num_stages: int, num_microbatches: int,
                  virtual_stages: int = 1) -> Optional[float]:
  """Idle share of a steady-state step, from the engine's plan (None: invalid)."""
  from jaxpipe.pipeline import facts  # pylint: disable=g-import-not-at-top
  try:
    return facts(schedule, num_stages, num_microbatches, virtual_stages).bubble
  except ValueError:
    return None


def virtual_stages(cfg: config_lib.Config, schedule: str) -> int:
  """v for `schedule` in the plan: the config's for interleaved, else VIRTUAL_STAGES; 1 for the rest."""
  if schedule != "interleaved":
    return 1
  p = cfg.pipeline
  return p.virtual_stages if p.schedule == "interleaved" else VIRTUAL_STAGES


def _refuses(cfg: config_lib.Config, schedule: str) -> bool:
  """Whether `schedule` cannot run the config's S, M (and layers, for interleaved's chunks)."""
  from jaxpipe.pipeline import check_virtual_stages, min_microbatches  # pylint: disable=g-import-not-at-top
  s_, m, v = cfg.pipeline.stages, cfg.pipeline.microbatches, virtual_stages(cfg, schedule)
  if schedule == "none":
    return False
  try:
    check_virtual_stages(schedule, s_, m, v)
  except ValueError:
    return True
  return m < min_microbatches(schedule, s_, v) or cfg.model.n_layers % (s_ * v) != 0


def resolve_vocab(cfg: config_lib.Config) -> config_lib.Config:
  """Fills model.vocab_size as training would, without reading the token data.

  A prepared dataset (`data.path`) states its vocabulary in its header; the
  embedded corpus uses `data.tokenizer`, whose size is known without data.
  The trainer's own `resolve_model` then fills the size in, or refuses a
  model vocabulary that is too small.
  """
  from jaxpipe import data as data_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  try:
    if cfg.data.path:
      data = data_lib.open_tokens(cfg.data.path, verify=False)  # the header is enough
      vocab, tokenizer = data.vocab_size, data.tokenizer
    else:
      vocab, tokenizer = data_lib.get_tokenizer(cfg.data.tokenizer).vocab_size, cfg.data.tokenizer
  except InputError as e:
    if cfg.model.vocab_size:
      return cfg  # plan with the model's own vocabulary
    raise ConfigError(f"model.vocab_size=0 takes the vocabulary from the data, which cannot "
                      f"be read ({e}); set model.vocab_size=N to plan without it") from None
  return trainer.resolve_model(cfg, types.SimpleNamespace(vocab_size=vocab, tokenizer=tokenizer))


def _bytes(tree: Any) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _device_bytes(abstract: Any, shardings: Any) -> Any:
  """A tree of per-device byte counts: each leaf's shard shape times its itemsize."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  return jax.tree.map(
      lambda x, s: int(np.prod(s.shard_shape(x.shape), dtype=np.int64)) * x.dtype.itemsize,
      abstract, shardings)


def _split_opt_state(nbytes: Any) -> dict[str, int]:
  """Splits an optimizer state's byte tree into optimizer, error-feedback and delay bytes."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxpipe.optim import DelayState, ErrorFeedbackState  # pylint: disable=g-import-not-at-top
  out = {"opt": 0, "ef": 0, "delay": 0}
  wrappers = (DelayState, ErrorFeedbackState)

  def walk(node):
    for leaf in jax.tree.leaves(node, is_leaf=lambda x: isinstance(x, wrappers)):
      if isinstance(leaf, ErrorFeedbackState):
        out["ef"] += sum(jax.tree.leaves(leaf.prev_update))
        out["opt"] += sum(jax.tree.leaves(leaf.count))
        walk(leaf.inner_state)
      elif isinstance(leaf, DelayState):
        out["delay"] += sum(jax.tree.leaves(leaf.buffer))
        out["opt"] += sum(jax.tree.leaves(leaf.count))
        walk(leaf.inner_state)
      else:
        out["opt"] += leaf

  walk(nbytes)
  return out


@dataclasses.dataclass
class Plan:
  """Per-device memory and per-stage work of every schedule for one config.

  Attributes:
    cfg: the resolved config.
    num_params: parameters of the whole model.
    stage_params: parameters one pipeline device holds per weight version
      (its L/S blocks with 1/D of their experts under expert parallelism,
      its 1/S of the (padded) vocabulary rows and columns, the final norm).
    bytes: {schedule: {stash: {row key: bytes per device}}}; the inner dict
      is None where the schedule refuses the config (2bw with M < 2(S-1)).
      `none` has one stash entry, 'inputs' (it has no stages).
    work: {stash: [FLOPs of one steady-state tick (a forward and a backward
      of one microbatch) of stage s, s = 0..S-1]}, counted from the stage's
      own program (`jaxpipe.pipeline._cost`); {} without stages.
    bubble: {schedule: steady-state idle share, or None}.
    warnings: one line each.
    traffic: bytes one device sends in a steady tick of the config's
      schedule, by kind ('point_to_point', 'head', 'embedding':
      `Engine.traffic`); {} without stages.
    vocab_parallel: whether the embedding and head are split over the
      stages (`pipeline.head`).
    checkpoint: {schedule: {stash: (bytes a checkpoint's state holds, bytes
      of the whole state)}}, over the whole mesh (`Schedule.checkpointed`:
      2bw's in-flight arrays are recomputed at resume, not saved); None
      where the schedule refuses the config.
    facts: `jaxpipe.pipeline.facts` of the config's schedule (ticks, bubble,
      stash slots, transfers, ...), as a dict; None where it refuses.
  """
  cfg: config_lib.Config
  num_params: int
  stage_params: int
  bytes: dict[str, dict[str, Optional[dict[str, int]]]]
  work: dict[str, list[float]]
  bubble: dict[str, Optional[float]]
  warnings: list[str]
  traffic: dict[str, float] = dataclasses.field(default_factory=dict)
  vocab_parallel: bool = True
  checkpoint: dict[str, dict[str, Optional[tuple[int, int]]]] = dataclasses.field(
      default_factory=dict)
  facts: Optional[dict[str, Any]] = None

  def total(self, schedule: str, stash: Optional[str] = None) -> Optional[int]:
    """Bytes per device of a schedule (with the config's stash choice by default).

    The ticks' working sets and the update's temporaries are not alive at
    the same time: the larger of the two counts.
    """
    stash = stash or (self.cfg.pipeline.stash if schedule != "none" else "inputs")
    row = self.bytes[schedule].get(stash if schedule != "none" else "inputs")
    if row is None:
      return None
    return sum(v for k, v in row.items() if k not in ("ticks", "update")) + max(
        row["ticks"], row["update"])

  def balance(self, stash: Optional[str] = None) -> Optional[float]:
    """The slowest stage's work per tick over the mean stage's (1.0 is even)."""
    work = self.work.get(stash or self.cfg.pipeline.stash)
    if not work:
      return None
    return max(work) / (sum(work) / len(work))


def _tick_costs(fns, plan_obj, blocks, shared, tokens, stash: str) -> list[float]:
  """FLOPs of the busiest tick of every stage's own program (see `Plan.work`)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import flops as program_flops, stage_tick  # pylint: disable=g-import-not-at-top
  if plan_obj.split_backward:
    return _split_tick_costs(fns, plan_obj, blocks, shared, tokens, stash)
  busy = [int((plan_obj.fwd[t] >= 0).sum() + (plan_obj.bwd[t] >= 0).sum())
          for t in range(plan_obj.num_ticks)]
  tick = int(np.argmax(busy))
  out = []
  for s in range(plan_obj.num_stages):
    fn, args = stage_tick(fns, plan_obj, s, blocks, shared, tokens, stash=stash, tick=tick)
    out.append(program_flops(fn, *args)["total"])
  if not plan_obj.fwd[tick].min() >= 0 or not plan_obj.bwd[tick].min() >= 0:
    # gpipe's ticks hold a forward or a backward: add the backward tick's work.
    t_b = int(np.argmax([int((plan_obj.bwd[t] >= 0).sum()) for t in range(plan_obj.num_ticks)]))
    for s in range(plan_obj.num_stages):
      fn, args = stage_tick(fns, plan_obj, s, blocks, shared, tokens, stash=stash, tick=t_b)
      out[s] += program_flops(fn, *args)["total"]
  return out


def _split_tick_costs(fns, plan_obj, blocks, shared, tokens, stash: str) -> list[float]:
  """zb1: per stage, the FLOPs of one microbatch's F, head, B and W.

  A zb1 tick's program holds each phase under a cond and `flops` counts a
  cond's costlier branch: a one-tick plan in which every stage runs F, B
  and W of one microbatch (which no real tick does, but the program is the
  same) counts each phase once, the head included, as 1f1b's steady tick does.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import flops as program_flops, stage_tick  # pylint: disable=g-import-not-at-top
  cells = np.zeros((1, plan_obj.num_stages), np.int32)
  rows = np.zeros((1,), np.int32)
  every = dataclasses.replace(
      plan_obj, **{k: cells for k in ("fwd", "bwd", "wgt", "fwd_version", "bwd_version", "acc",
                                      "fwd_slot", "bwd_slot", "bwd_wslot", "wgt_slot",
                                      "fwd_chunk", "bwd_chunk")},
      **{k: rows for k in ("embed_version", "head_version", "head_acc", "embed_grad_version",
                           "embed_acc")})
  out = []
  for s in range(plan_obj.num_stages):
    fn, args = stage_tick(fns, every, s, blocks, shared, tokens, stash=stash, tick=0)
    out.append(program_flops(fn, *args)["total"])
  return out


def plan(cfg: config_lib.Config, *, device_gib: float = 80.0, max_bubble: float = 0.25,
         work: bool = True) -> Plan:
  """Computes per-device memory, per-stage work and bubbles for `cfg` (no compilation).

  The model, optimizer, mesh and schedules are built exactly as
  `jaxpipe.trainer.make_run` builds them, without opening the token data;
  every shape comes from `jax.eval_shape`. The memory model, and how it
  compares with XLA's analysis of the compiled step, is in docs/benchmark.md.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import make_mesh, make_schedule, min_microbatches, step_plan  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import Engine, pad_vocab, padded_vocab, residual_shapes  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import SplitStage  # pylint: disable=g-import-not-at-top

  cfg = resolve_vocab(cfg)
  s_, d_, m = cfg.pipeline.stages, cfg.mesh.data, cfg.pipeline.microbatches
  if s_ * d_ > jax.device_count():
    raise ConfigError(f"planning pipeline.stages x mesh.data = {s_} x {d_} needs {s_ * d_} "
                      f"devices for the shardings but JAX has {jax.device_count()}; run the "
                      "planner in a fresh process (it emulates them)")
  model, fns, optimizer = trainer.components(cfg)
  params = jax.eval_shape(model.init, jax.random.key(0))
  batch_shape = (m, cfg.data.batch_size // m, cfg.data.seq_len)
  rows = batch_shape[1] // d_  # sequences of one microbatch on one device
  num_params = sum(int(x.size) for x in jax.tree.leaves(params))
  blocks, shared = params["blocks"], {k: v for k, v in params.items() if k != "blocks"}
  vocab_axes = jax.tree.leaves(fns.vocab_axes, is_leaf=lambda a: a is None)
  tokens = jax.ShapeDtypeStruct((rows, cfg.data.seq_len), jnp.int32)

  expert_axes = jax.tree.leaves(fns.expert_axes(blocks), is_leaf=lambda a: a is None)

  def stage_shapes(num_stages: int):
    """Per-device shapes: L/S blocks, the (padded) vocabulary over S (experts whole)."""
    vocab = padded_vocab(cfg.model.vocab_size, num_stages)
    sh = jax.eval_shape(lambda t: pad_vocab(t, fns.vocab_axes, vocab), shared)
    local = jax.tree.map(
        lambda x, a: x if a is None else jax.ShapeDtypeStruct(
            x.shape[:a] + (x.shape[a] // num_stages,) + x.shape[a + 1:], x.dtype),
        sh, fns.vocab_axes, is_leaf=lambda a: a is None)
    blk = jax.tree.map(lambda v: jax.ShapeDtypeStruct((v.shape[0] // num_stages,) + v.shape[1:],
                                                      v.dtype), blocks)
    return blk, local, sh, vocab

  f32 = lambda tree: sum(int(x.size) * 4 for x in jax.tree.leaves(tree))

  out: dict[str, dict[str, Optional[dict[str, int]]]] = {}
  checkpoint: dict[str, dict[str, Optional[tuple[int, int]]]] = {}
  bubble: dict[str, Optional[float]] = {}
  warnings: list[str] = []
  stage_params = 0
  for name in SCHEDULES:
    pipelined = name != "none"
    v = virtual_stages(cfg, name)
    refused = _refuses(cfg, name)
    bubble[name] = None if refused else steady_bubble(name, s_, m, v)
    out[name], checkpoint[name] = {}, {}
    stashes = STASHES if pipelined else ("inputs",)
    if refused:
      out[name] = checkpoint[name] = {st: None for st in stashes}
      continue
    num = s_ if pipelined else 1
    whole, local, _, _ = stage_shapes(num)
    # With expert parallelism a device holds E/D of each block's experts but
    # routes as many token slots through them as it would through all E, so
    # its activations and residuals are those of the whole-expert stage.
    split = config_lib.experts_split(name, d_, cfg.model.moe.num_experts,
                                     cfg.mesh.expert_parallel)
    blk = jax.tree.unflatten(jax.tree.structure(whole), [
        x if a is None or not split else jax.ShapeDtypeStruct(
            x.shape[:a] + (x.shape[a] // d_,) + x.shape[a + 1:], x.dtype)
        for x, a in zip(jax.tree.leaves(whole), expert_axes)])
    x_like = jax.eval_shape(fns.embed, local, tokens)
    act = _bytes(x_like)
    one_version = f32(blk) + f32(local)         # a float32 copy of one version's shard
    if pipelined:
      stage_params = sum(int(x.size) for x in jax.tree.leaves((blk, local)))
    prepared = jax.eval_shape(fns.prepare, whole)
    # Interleaved's stash slot and backward hold one chunk: 1/v of the stage.
    prepared = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // v,) + x.shape[1:],
                                                           x.dtype), prepared)
    recompute = _bytes(residual_shapes(fns.stage, prepared, x_like))
    # The head's working set: float32 logits of this device's vocabulary
    # slice, their exponentials and their gradient, for the tokens the head
    # computes at once (a microbatch, or `model.loss_chunk` of them), and the
    # output layer's weight gradient (the embedding's is a scatter into its
    # accumulator).
    vocab_local = max([x.shape[a] for x, a in zip(jax.tree.leaves(local), vocab_axes)
                       if a is not None] or [cfg.model.vocab_size])
    head_tokens = rows * cfg.data.seq_len
    if cfg.model.loss_chunk:
      head_tokens = min(head_tokens, cfg.model.loss_chunk)
    head = 3 * head_tokens * vocab_local * 4 + max(
        [int(x.size) * 4 for x, a in zip(jax.tree.leaves(local), vocab_axes) if a is not None]
        or [0])
    for stash in stashes:
      mesh = make_mesh(num, d_)
      sched = make_schedule(name, fns, optimizer, mesh, m, stash=stash, virtual_stages=v,
                            shard_optimizer=cfg.mesh.shard_optimizer,
                            expert_parallel=cfg.mesh.expert_parallel,
                            vocab_parallel=config_lib.vocab_parallel(
                                cfg.model, dataclasses.replace(cfg.pipeline, stages=num)))
      state = jax.eval_shape(lambda p, sched=sched: sched.init(p, batch_shape), params)
      nbytes = _device_bytes(state, sched.state_shardings(state))
      checkpoint[name][stash] = (_bytes(sched.checkpointed(state)), _bytes(state))
      row = {k: 0 for k, _ in ROWS}
      for field in type(state).KINDS:
        value = sum(jax.tree.leaves(getattr(nbytes, field)))
        kind = type(state).KINDS[field]
        if kind in ("params", "versions"):
          row["weights"] += value
        elif kind == "opt":
          row.update(_split_opt_state(getattr(nbytes, field)))
        elif kind == "inflight":
          row["inflight"] += value
      row["batch"] = 2 * _bytes(jax.ShapeDtypeStruct(batch_shape, jnp.int32)) // d_
      # Inside the step. Gradients are summed in float32, one accumulator
      # per batch in flight (2bw carries batch k-1's in its state).
      row["grads"] = one_version
      entry = (recompute if stash == "residuals" else act) + 4
      if pipelined:
        p = step_plan(name, s_, m, v)
        slots = sched.engine.num_slots
        if name != "2bw":
          row["stash"] = slots * (entry + (act if p.head_stash else 0))
        if p.split_backward:
          # zb1's second ring (and its scratch slot): what B keeps for W, per
          # weight use its input and its output cotangent (`SplitStage`).
          w_entry = SplitStage(fns.stage).w_stash_shapes(prepared, x_like)[1]
          row["stash"] += (p.w_slots + 1) * _bytes(w_entry)
        # The step runs a loop per run of ticks of one kind. Measured against
        # XLA's buffer assignment (docs/benchmark.md): forward-only loops have
        # a working set of their own; loops with a backward share one when it
        # reads residuals, and each keep their own when it recomputes.
        classes: dict[Any, int] = {}
        for kind, _, _ in p.segments():
          # The forward's stash entry is written before the backward starts:
          # a tick's working set is the larger of the two, plus the head's.
          fwd_ws = entry + 2 * act if kind.fwd else 0
          # (a chunk's weight gradient and its copy of the chunk's weights with v > 1)
          bwd_ws = ((entry if stash == "residuals" else recompute + act) + f32(blk) // v
                    + (_bytes(blk) // v if v > 1 else 0) + 2 * act if kind.bwd else 0)
          ws = max(fwd_ws, bwd_ws) + (head if kind.head_version is not None else 0)
          key = kind.bwd if stash == "residuals" or not kind.bwd else (kind.fwd, kind.bwd)
          classes[key] = max(classes.get(key, 0), ws)
        row["ticks"] = sum(classes.values())
        if name == "pipedream":   # the stage's own version and the shared ones, picked
          row["copies"] = _bytes(blk) + 2 * _bytes(local)
        if name == "2bw":         # v[k]'s blocks become `prev` as v[k+1] is written
          row["copies"] = _bytes(blk)
      else:
        row["ticks"] = recompute + f32(blk) + head + 2 * act
      # The optimizer's update of the summed gradient (the new moments and
      # weights are written over the donated ones).
      row["update"] = one_version
      out[name][stash] = row

  work_per_stage: dict[str, list[float]] = {}
  traffic: dict[str, float] = {}
  vp = config_lib.vocab_parallel(cfg.model, cfg.pipeline)
  if s_ > 1 and not _refuses(cfg, cfg.pipeline.schedule):
    name = cfg.pipeline.schedule if cfg.pipeline.schedule != "none" else "1f1b"
    v = virtual_stages(cfg, name)
    # The stage functions as the schedule gives them to its engine.
    mode_fns = fns if vp else fns._replace(vocab_axes=jax.tree.map(
        lambda _: None, fns.vocab_axes, is_leaf=lambda a: a is None))
    sh_mode = stage_shapes(s_)[2] if vp else shared
    engine = Engine(mode_fns, step_plan(name, s_, m, v), stash=cfg.pipeline.stash)
    traffic = engine.traffic(_bytes(jax.eval_shape(fns.embed, shared, tokens)),
                             rows * cfg.data.seq_len)
    if work:
      for stash in STASHES:
        work_per_stage[stash] = _tick_costs(mode_fns, step_plan(name, s_, m, v), blocks,
                                            sh_mode, tokens, stash)

  # Warnings: what the user should change before launching.
  need = min_microbatches("2bw", s_)
  if m < need:
    warnings.append(f"2bw needs pipeline.microbatches >= 2(S-1) = {need} for S={s_} stages "
                    f"(got M={m}); raise M to use it")
  for name in ("gpipe", "1f1b", "pipedream", "interleaved"):
    b = bubble[name]
    if s_ > 1 and b is not None and b > max_bubble and name != "interleaved":
      # bubble = (S-1) / (M + S-1) <= x  <=>  M >= (S-1)(1-x)/x
      m_ok = -(-int(round((s_ - 1) * (1 - max_bubble) * 1000)) // int(round(max_bubble * 1000)))
      warnings.append(f"{name} idles {b:.0%} of every step at S={s_}, M={m} (above "
                      f"{max_bubble:.0%}); M >= {m_ok} brings it to {max_bubble:.0%} or less")
    elif s_ > 1 and b is not None and b > max_bubble:
      # (S-1) / (vM + S-1) <= x  <=>  M >= (S-1)(1-x) / (x v), a multiple of S
      v = virtual_stages(cfg, name)
      m_ok = -(-int(round((s_ - 1) * (1 - max_bubble) * 1000)) // int(round(max_bubble * v * 1000)))
      m_ok = -(-m_ok // s_) * s_
      warnings.append(f"{name} (v={v}) idles {b:.0%} of every step at S={s_}, M={m} (above "
                      f"{max_bubble:.0%}); M >= {m_ok} brings it to {max_bubble:.0%} or less")
  limit = device_gib * 2 ** 30
  own = None
  if not _refuses(cfg, cfg.pipeline.schedule):
    from jaxpipe.pipeline import facts  # pylint: disable=g-import-not-at-top
    own = dataclasses.asdict(facts(cfg.pipeline.schedule, s_, m,
                                   virtual_stages(cfg, cfg.pipeline.schedule)))
  result = Plan(cfg, num_params, int(stage_params), out, work_per_stage, bubble, warnings,
                traffic, vp, checkpoint, own)
  for name in SCHEDULES:
    total = result.total(name)
    if total is not None and total > limit:
      mark = " (the config's schedule)" if name == cfg.pipeline.schedule else ""
      stash = f", stash {cfg.pipeline.stash}" if name != "none" else ""
      warnings.append(f"{name}{mark} needs {total / 2 ** 30:.1f} GiB per device{stash}, more "
                      f"than --device-gib {device_gib:g}")
  balance = result.balance()
  if balance is not None and balance > 1.1:
    warnings.append(f"the slowest stage does {balance:.2f}x the mean stage's work per tick")
  return result


def human(n: Optional[float]) -> str:
  """Bytes in B/KiB/MiB/GiB with three significant digits."""
  if n is None:
    return "-"
  for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if n >= size:
      return f"{n / size:.3g} {unit}"
  return f"{int(n)} B"


def flops(n: float) -> str:
  """FLOPs in G/T/P with three significant digits."""
  for unit, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
    if n >= size:
      return f"{n / size:.3g}{unit}"
  return f"{n:.3g}"


def compiled_memory(cfg: config_lib.Config, schedule: str, stash: str) -> dict[str, int]:
  """XLA's memory analysis of the training step compiled ahead of time (nothing allocated).

  The step is lowered with abstract inputs placed in the schedule's shardings
  on the emulated devices and compiled; returns per-device bytes:
  argument, output, alias, temp, and resident = argument + output - alias + temp.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import make_mesh, make_schedule  # pylint: disable=g-import-not-at-top
  cfg = resolve_vocab(cfg)
  model, fns, optimizer = trainer.components(cfg)
  m = cfg.pipeline.microbatches
  stages = cfg.pipeline.stages if schedule != "none" else 1
  sched = make_schedule(schedule, fns, optimizer, make_mesh(stages, cfg.mesh.data), m,
                        stash=stash, virtual_stages=virtual_stages(cfg, schedule),
                        shard_optimizer=cfg.mesh.shard_optimizer,
                        expert_parallel=cfg.mesh.expert_parallel,
                        vocab_parallel=config_lib.vocab_parallel(cfg.model, cfg.pipeline))
  batch_shape = (m, cfg.data.batch_size // m, cfg.data.seq_len)
  params = jax.eval_shape(model.init, jax.random.key(0))
  state = jax.eval_shape(lambda p: sched.init(p, batch_shape), params)
  state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                       state, sched.state_shardings(state))
  batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=sched.batch_sharding())
  stats = sched.lower_step(state, batch, batch).compile().memory_analysis()
  row = {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
         "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes}
  row["resident"] = row["argument"] + row["output"] - row["alias"] + row["temp"]
  return row


def format_plan(p: Plan, device_gib: float) -> str:
  """The planner's report: header, memory table, work per stage, notes and warnings."""
  cfg = p.cfg
  s_, d_, m = cfg.pipeline.stages, cfg.mesh.data, cfg.pipeline.microbatches
  rows_per_mb = cfg.data.batch_size // m // d_
  lines = [
      f"plan: {cfg.model.n_layers} blocks of width {cfg.model.dim}, vocab {cfg.model.vocab_size}, "
      f"{p.num_params / 1e6:.1f}M parameters ({cfg.model.param_dtype}, compute "
      f"{cfg.model.compute_dtype}, remat {cfg.model.remat})",
      f"mesh: S={s_} stages x D={d_} data; M={m} microbatches of {rows_per_mb} x "
      f"{cfg.data.seq_len} tokens per device; optimizer {cfg.optimizer.name}"
      + (" + error feedback" if cfg.optimizer.error_feedback else "")
      + (f" + delay {cfg.optimizer.delay}" if cfg.optimizer.delay else ""),
      f"a pipeline device holds {p.stage_params / 1e6:.2f}M parameters per weight version "
      f"({cfg.model.n_layers // max(s_, 1)} blocks"
      # Every pipelined schedule splits them alike; "2bw" stands for any.
      + (f" with 1/{d_} of their experts" if config_lib.experts_split(
          "2bw", d_, cfg.model.moe.num_experts, cfg.mesh.expert_parallel) else "")
      + f", 1/{s_} of the vocabulary rows and columns)",
      "",
  ]
  cols = [("none", "inputs")] + [(n, st) for n in SCHEDULES[1:] for st in STASHES]
  mark = lambda n, st: "*" if (n == cfg.pipeline.schedule and
                                (n == "none" or st == cfg.pipeline.stash)) else ""
  head = ["per device"] + [("none" if n == "none" else f"{n}/{st[:3]}") + mark(n, st)
                           for n, st in cols]
  table = [head]
  for key, label in ROWS:
    table.append([label] + [human(p.bytes[n][st][key]) if p.bytes[n][st] is not None else "-"
                            for n, st in cols])
  table.append(["total"] + [human(p.total(n, st)) for n, st in cols])
  table.append(["fits --device-gib " + f"{device_gib:g}"] + [
      "-" if p.total(n, st) is None else ("yes" if p.total(n, st) <= device_gib * 2 ** 30
                                          else "NO") for n, st in cols])
  table.append(["steady-state bubble"] + [
      "n/a" if p.bubble[n] is None else f"{p.bubble[n]:.1%}" for n, _ in cols])
  widths = [max(len(r[i]) for r in table) for i in range(len(head))]
  for i, r in enumerate(table):
    lines.append("  ".join(c.ljust(widths[0]) if j == 0 else c.rjust(widths[j])
                           for j, c in enumerate(r)))
    if i == 0:
      lines.append("  ".join("-" * w for w in widths))
  f = p.facts
  if f is not None and f["ticks"]:
    chunked = f" (v={f['virtual_stages']} chunks per device)" if f["virtual_stages"] > 1 else ""
    lines += ["", f"{cfg.pipeline.schedule}{chunked}: {f['ticks']} ticks per step, a step lasts "
              f"{f['step_cost'] / 3:g} forward+backward pairs of a stage, bubble "
              f"{f['bubble']:.1%}, {f['stash_slots']} stash slots per device, "
              f"{f['transfers']} activations (and as many cotangents) sent between devices "
              "per step"]
  saved = p.checkpoint.get(cfg.pipeline.schedule, {}).get(
      cfg.pipeline.stash if cfg.pipeline.schedule != "none" else "inputs")
  if saved is not None:
    lines += ["", f"checkpoint ({cfg.pipeline.schedule}, whole mesh): {human(saved[0])} of a "
              f"{human(saved[1])} state"
              + (f"; the {human(saved[1] - saved[0])} in flight is recomputed at resume"
                 if saved[1] > saved[0] else "")]
  if p.work:
    name = cfg.pipeline.schedule if cfg.pipeline.schedule != "none" else "1f1b"
    what = ("one chunk's forward and backward of a microbatch, the head included"
            if name == "interleaved" else
            "one microbatch's F, B and W, the head included" if name == "zb1" else
            "one microbatch's forward and backward")
    lines += ["", f"work per tick ({what}), {name}, FLOPs per stage:"]
    for stash, w in p.work.items():
      lines.append(f"  stash {stash:9s} " + "  ".join(f"s{i}={flops(x)}" for i, x in
                                                    enumerate(w))
                   + f"   slowest / mean = {p.balance(stash):.3f}")
  if p.traffic:
    name = cfg.pipeline.schedule if cfg.pipeline.schedule != "none" else "1f1b"
    where = ("split over the stages by vocabulary" if p.vocab_parallel else
             "whole on every stage, used on the first and last")
    t = p.traffic
    lines += ["", f"traffic per device and tick, {name} (bytes sent; embedding and head {where}, "
              f"pipeline.head={cfg.pipeline.head}):",
              f"  point to point {human(t['point_to_point'])}, head collectives "
              f"{human(t['head'])}, embedding (once per step, per tick) {human(t['embedding'])}; "
              f"total {human(sum(t.values()))}"]
  lines += [
      "",
      "* the config's schedule and stash choice (inp = pipeline.stash=inputs, res = residuals).",
      "`none` is the whole model on one device of the data axis, for comparison.",
      "weights, optimizer, in flight: the schedule's state as placed on one device (the",
      "checkpointed pytrees). Inside the step: float32 gradient sums; the flushed schedules'",
      "stash ring (slots x a stage input, or x the stage's vjp residuals); one working set per",
      "loop of ticks of one kind (a backward's recompute or residual read, its weight",
      "gradient, the head's float32 logits of the device's vocabulary slice); the reduced",
      "gradient and the optimizer update; pipedream's and 2bw's version copies.",
      f"interleaved: v={virtual_stages(cfg, 'interleaved')} chunks per device (its slots and "
      "working sets hold a chunk's);"
      " `-` where a schedule refuses S, M or the layers.",
      "`tools/planner.py --compile` compiles the config's step and prints XLA's own numbers.",
  ]
  if p.warnings:
    lines.append("")
    lines += [f"warning: {w}" for w in p.warnings]
  return "\n".join(lines)


def plan_json(p: Plan, compiled: Optional[dict[str, int]]) -> dict[str, Any]:
  """The plan as one JSON-ready dict.

  At the top level, for the config's own schedule and stash: `estimate_gib`
  (the planner's total per device) and `xla_resident_gib` (XLA's resident
  bytes of the compiled step, None without --compile), with `xla` (XLA's
  byte counts) beside them; under `estimates`, the planner's total for every
  schedule and stash choice (None where a schedule cannot run the config);
  `checkpoint_bytes`, the config's checkpoint and whole state ({saved, state}).
  """
  cfg = p.cfg
  gib = lambda n: None if n is None else n / 2 ** 30
  out = {
      "config": {"schedule": cfg.pipeline.schedule, "stash": cfg.pipeline.stash,
                 "stages": cfg.pipeline.stages, "data": cfg.mesh.data,
                 "microbatches": cfg.pipeline.microbatches},
      "estimate_gib": gib(p.total(cfg.pipeline.schedule)),
      "xla_resident_gib": gib(compiled["resident"]) if compiled else None,
      "xla": compiled,
      "estimates": {n: {st: gib(p.total(n, st)) for st in (STASHES if n != "none" else
                                                            ("inputs",))}
                    for n in SCHEDULES},
      "traffic_bytes_per_tick": p.traffic,
      "facts": p.facts,
      "vocab_parallel": p.vocab_parallel,
      "checkpoint_bytes": dict(zip(("saved", "state"), p.checkpoint.get(
          cfg.pipeline.schedule, {}).get(cfg.pipeline.stash if cfg.pipeline.schedule != "none"
                                          else "inputs") or (None, None))),
  }
  return out


def main(argv: Optional[list[str]] = None) -> int:
  """Loads the config, emulates the mesh's devices, prints the plan."""
  parser = Parser(prog="planner", description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True, help="YAML config file (see configs/)")
  parser.add_argument("--device-gib", type=float, default=80.0,
                      help="memory of one device in GiB (default 80)")
  parser.add_argument("--max-bubble", type=float, default=0.25,
                      help="warn when a synchronous schedule idles more than this (default 0.25)")
  parser.add_argument("--compile", action="store_true",
                      help="also compile the config's step and print XLA's memory per device")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON object instead of the report (with --compile: "
                           "xla_resident_gib beside estimate_gib)")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. pipeline.microbatches=8")
  args = parser.parse_args(argv)
  try:
    if args.device_gib <= 0:
      raise ConfigError(f"--device-gib must be > 0, got {args.device_gib:g}")
    if not 0 < args.max_bubble < 1:
      raise ConfigError(f"--max-bubble must be in (0, 1), got {args.max_bubble:g}")
    cfg = config_lib.load(args.config, args.overrides)
    # Planning needs shapes and shardings, not accelerators: plan on the host
    # (unless told otherwise), whose devices can be emulated in any number.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # The shardings need the mesh's devices: emulate them before JAX starts.
    launch.prepare_devices(cfg)
    result = plan(cfg, device_gib=args.device_gib, max_bubble=args.max_bubble)
    compiled = None
    if args.compile:
      compiled = compiled_memory(result.cfg, cfg.pipeline.schedule, cfg.pipeline.stash)
  except InputError as e:
    print(f"planner: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(plan_json(result, compiled), sort_keys=True))
    return 0
  print(format_plan(result, args.device_gib))
  if compiled is not None:
    est = result.total(cfg.pipeline.schedule)
    print(f"\nXLA, {cfg.pipeline.schedule} compiled for this mesh: resident "
          f"{human(compiled['resident'])} per device (arguments {human(compiled['argument'])}, "
          f"temporaries {human(compiled['temp'])}); the estimate above is "
          f"{human(est)} ({est / compiled['resident'] - 1:+.0%}).")
  return 0


if __name__ == "__main__":
  sys.exit(main())
