"""Plans a pipeline run before launch: memory per device, work per stage, bubbles.

  python tools/planner.py --config configs/smollm-360m.yaml   (installed: jaxpipe-plan ...)
  python tools/planner.py --config configs/smollm-360m.yaml pipeline.microbatches=4 \
      --device-gib 24
  python tools/planner.py --config configs/tiny.yaml pipeline.schedule=2bw \
      pipeline.stages=2 --compile
  python tools/planner.py --config configs/smollm-135m.yaml --gpu h100 [--nodes N] [--json]

Nothing runs and, without --compile, nothing compiles: every shape comes from
`jax.eval_shape` of the model's init, the optimizer's init and each schedule's
`init` (the same pytrees that training and checkpoints hold), placed with the
schedule's own shardings, so the numbers are the bytes that one device holds.
What lives only inside a step (gradient sums, the flushed schedules' stash,
the step's embedding, one tick's working set, the update) is counted by each
schedule itself, as named terms, from the plan it executes and the shapes of
the model's stage functions (`jaxpipe.pipeline.memory_terms`);
docs/accelerators.md and docs/benchmark.md compare the total with XLA's
analysis of the compiled step (`--compile` prints both and the difference).
The models are the pipeline's (`jaxpipe.pipeline.schedule_memory`,
`stage_work`, `tick_traffic`, `steady_bubble`, gathered in an `Estimate`):
this command builds their inputs from the config and prints what they say.

For the config's S stages, D data replicas and M microbatches it prints a
table with a column per schedule and stash choice (`none` is the whole model
on one device of the data axis, for comparison) and a row per kind of
memory; the work per tick of every stage (FLOPs of the stage's own tick
program, for both stash choices) and how far the slowest stage is above the
mean; the steady-state bubble of each schedule from the engine's plan; and
warnings: M too small for 2bw (it needs M >= 2(S-1)), a synchronous schedule
idling more than --max-bubble of every step, a total above --device-gib,
stages more than 10% apart. --compile also compiles the config's step ahead
of time on the emulated devices and prints XLA's memory per device. --gpu
KIND compiles it for NVIDIA GPUs of that kind over --nodes N nodes with
XLA's GPU compiler (jaxlib's CUDA plugin, the cuda extra; no GPU is used)
and prints what the GPU program holds and a projected step
(`jaxpipe.gpu`; with --json under `gpu`).

A bad config exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
from typing import TYPE_CHECKING, Any, Optional

from jaxpipe import accel
from jaxpipe import config as config_lib
from jaxpipe import launch
from jaxpipe.cli import Parser
from jaxpipe.errors import ConfigError, InputError
from jaxpipe.pipeline import SCHEDULE_NAMES, STASH_MODES

if TYPE_CHECKING:  # its module loads JAX, which main() configures first
  from jaxpipe.pipeline import Estimate

SCHEDULES, STASHES = SCHEDULE_NAMES, STASH_MODES
# Interleaved's chunks per device in the table when the config's schedule is
# another one (whose pipeline.virtual_stages is 1).
VIRTUAL_STAGES = 2

# Rows of the table, in order: (key of a `MemoryTerm`, label), grouped by when
# they are alive (`jaxpipe.pipeline.PHASES`).
ROWS = (
    ("weights", "weights (x versions)"),
    ("opt", "optimizer state"),
    ("ef", "error-feedback buffer"),
    ("delay", "delay buffer"),
    ("inflight", "2bw in flight (stash, partial grads)"),
    ("batch", "token batches"),
    ("grads", "gradient accumulators (f32)"),
    ("stash", "stash ring (gpipe, zb1: in the state)"),
    ("embed", "step embedding (x0, cotangents)"),
    ("copies", "weight copies (compute dtype, versions)"),
    ("head", "tick: head logits (f32 x2), out grad"),
    ("read", "tick: stash read or recompute"),
    ("widened", "tick: f32 copy of a bf16 read"),
    ("wgrad", "tick: weight grad (+ f32 cast), activations"),
    ("chunk", "tick: a chunk's weights (v > 1)"),
    ("loops", "tick: other loops' working sets"),
    ("update", "reduced grads + update"),
)


def virtual_stages(cfg: config_lib.Config, schedule: str) -> int:
  """v for `schedule` in the plan: the config's for interleaved, else VIRTUAL_STAGES; 1 for the rest."""
  if schedule != "interleaved":
    return 1
  p = cfg.pipeline
  return p.virtual_stages if p.schedule == "interleaved" else VIRTUAL_STAGES


def _refuses(cfg: config_lib.Config, schedule: str) -> bool:
  """Whether `schedule` cannot run the config's S, M (and layers, for interleaved's chunks)."""
  from jaxpipe.pipeline import cannot_run  # pylint: disable=g-import-not-at-top
  p = cfg.pipeline
  return cannot_run(schedule, p.stages, p.microbatches, virtual_stages(cfg, schedule),
                    cfg.model.n_layers)


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
class _Parts:
  """What every part of a plan reads: the resolved config and the model's abstract pieces."""
  cfg: config_lib.Config
  fns: Any
  optimizer: Any
  params: Any
  batch_shape: tuple[int, int, int]


def _parts(cfg: config_lib.Config) -> _Parts:
  """The model, optimizer and abstract parameters exactly as `trainer.make_run` makes them."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  cfg = resolve_vocab(cfg)
  s_, d_ = cfg.pipeline.stages, cfg.mesh.data
  if s_ * d_ > jax.device_count():
    raise ConfigError(f"planning pipeline.stages x mesh.data = {s_} x {d_} needs {s_ * d_} "
                      f"devices for the shardings but JAX has {jax.device_count()}; run the "
                      "planner in a fresh process (it emulates them)")
  model, fns, optimizer = trainer.components(cfg)
  params = jax.eval_shape(model.init, jax.random.key(0))
  m = cfg.pipeline.microbatches
  return _Parts(cfg, fns, optimizer, params, (m, cfg.data.batch_size // m, cfg.data.seq_len))


def _as_schedule(cfg: config_lib.Config, name: str, stash: str) -> config_lib.Config:
  """`cfg` as it would run schedule `name` with `stash`: `none` on one stage, the plan's v."""
  num = cfg.pipeline.stages if name != "none" else 1
  return dataclasses.replace(cfg, pipeline=dataclasses.replace(
      cfg.pipeline, schedule=name, stages=num, stash=stash,
      virtual_stages=virtual_stages(cfg, name)))


def _make(parts: _Parts, name: str, stash: str):
  """The schedule `name` as training builds it (`none` on one stage)."""
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import make_mesh  # pylint: disable=g-import-not-at-top
  cfg = _as_schedule(parts.cfg, name, stash)
  return trainer.schedule_from_config(cfg, parts.fns, parts.optimizer,
                                      make_mesh(cfg.pipeline.stages, cfg.mesh.data))


def _memory(parts: _Parts) -> tuple[dict, dict, int]:
  """(terms, checkpoint, stage_params): every schedule's memory per device, each counted
  by the schedule itself (`jaxpipe.pipeline.schedule_memory`) from the plan it executes."""
  from jaxpipe.pipeline import schedule_memory  # pylint: disable=g-import-not-at-top
  terms: dict[str, dict[str, Optional[list]]] = {}
  checkpoint: dict[str, dict[str, Optional[tuple[int, int]]]] = {}
  stage_params = 0
  for name in SCHEDULES:
    stashes = STASHES if name != "none" else ("inputs",)
    terms[name] = {st: None for st in stashes}
    checkpoint[name] = {st: None for st in stashes}
    if _refuses(parts.cfg, name):
      continue
    for stash in stashes:
      mem = schedule_memory(_make(parts, name, stash), parts.params, parts.batch_shape,
                            opt_parts=_split_opt_state)
      terms[name][stash], checkpoint[name][stash] = mem.terms, mem.checkpoint
      if mem.stage_params is not None:
        stage_params = mem.stage_params
  return terms, checkpoint, stage_params


def _work_and_traffic(parts: _Parts, work: bool) -> tuple[dict, dict, bool]:
  """(work per stage by stash, traffic per tick, vocab_parallel) of the config's schedule."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxpipe import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top
  cfg = parts.cfg
  s_, m = cfg.pipeline.stages, cfg.pipeline.microbatches
  vp = config_lib.vocab_parallel(cfg.model, cfg.pipeline)
  if not (s_ > 1 and not _refuses(cfg, cfg.pipeline.schedule)):
    return {}, {}, vp
  name = cfg.pipeline.schedule if cfg.pipeline.schedule != "none" else "1f1b"
  steps = pipeline_lib.step_plan(name, s_, m, virtual_stages(cfg, name))
  tokens = jax.ShapeDtypeStruct((parts.batch_shape[1] // cfg.mesh.data, cfg.data.seq_len),
                                jnp.int32)
  traffic = pipeline_lib.tick_traffic(parts.fns, parts.params, steps, tokens,
                                      stash=cfg.pipeline.stash, vocab_parallel=vp)
  work_per_stage = (pipeline_lib.stage_work(parts.fns, parts.params, steps, tokens,
                                             vocab_parallel=vp) if work else {})
  return work_per_stage, traffic, vp


def _warnings(p: Estimate, device_gib: float, max_bubble: float) -> list[str]:
  """What the user should change before launching, one line each."""
  from jaxpipe.pipeline import min_microbatches  # pylint: disable=g-import-not-at-top
  cfg = p.cfg
  s_, m = cfg.pipeline.stages, cfg.pipeline.microbatches
  out = []
  need = min_microbatches("2bw", s_)
  if m < need:
    out.append(f"2bw needs pipeline.microbatches >= 2(S-1) = {need} for S={s_} stages "
               f"(got M={m}); raise M to use it")
  for name in ("gpipe", "1f1b", "pipedream", "interleaved"):
    b = p.bubble[name]
    if not (s_ > 1 and b is not None and b > max_bubble):
      continue
    # bubble = (S-1) / (vM + S-1) <= x  <=>  M >= (S-1)(1-x) / (x v), v = 1 but for
    # interleaved, whose M is also a multiple of S.
    v = virtual_stages(cfg, name)
    m_ok = -(-int(round((s_ - 1) * (1 - max_bubble) * 1000)) // int(round(max_bubble * v * 1000)))
    if name == "interleaved":
      m_ok = -(-m_ok // s_) * s_
    what = f"{name} (v={v})" if name == "interleaved" else name
    out.append(f"{what} idles {b:.0%} of every step at S={s_}, M={m} (above "
               f"{max_bubble:.0%}); M >= {m_ok} brings it to {max_bubble:.0%} or less")
  for name in SCHEDULES:
    total = p.total(name)
    if total is not None and total > device_gib * 2 ** 30:
      mark = " (the config's schedule)" if name == cfg.pipeline.schedule else ""
      stash = f", stash {cfg.pipeline.stash}" if name != "none" else ""
      out.append(f"{name}{mark} needs {total / 2 ** 30:.1f} GiB per device{stash}, more "
                 f"than --device-gib {device_gib:g}")
  balance = p.balance()
  if balance is not None and balance > 1.1:
    out.append(f"the slowest stage does {balance:.2f}x the mean stage's work per tick")
  return out


def plan(cfg: config_lib.Config, *, device_gib: float = 80.0, max_bubble: float = 0.25,
         work: bool = True) -> Estimate:
  """Computes per-device memory, per-stage work and bubbles for `cfg` (no compilation).

  The model, optimizer, mesh and schedules are built exactly as
  `jaxpipe.trainer.make_run` builds them, without opening the token data;
  every shape comes from `jax.eval_shape`. Each schedule counts its own
  memory terms (`jaxpipe.pipeline.memory_terms`); docs/accelerators.md
  compares their total with XLA's analysis of the compiled step.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import Estimate, facts, steady_bubble  # pylint: disable=g-import-not-at-top
  parts = _parts(cfg)
  terms, checkpoint, stage_params = _memory(parts)
  work_per_stage, traffic, vp = _work_and_traffic(parts, work)
  cfg = parts.cfg
  s_, m = cfg.pipeline.stages, cfg.pipeline.microbatches
  bubble = {name: None if _refuses(cfg, name) else
            steady_bubble(name, s_, m, virtual_stages(cfg, name)) for name in SCHEDULES}
  own = None
  if not _refuses(cfg, cfg.pipeline.schedule):
    own = dataclasses.asdict(facts(cfg.pipeline.schedule, s_, m,
                                   virtual_stages(cfg, cfg.pipeline.schedule)))
  num_params = sum(int(x.size) for x in jax.tree.leaves(parts.params))
  result = Estimate(schedule=cfg.pipeline.schedule, stash=cfg.pipeline.stash,
                    num_params=num_params, stage_params=int(stage_params), terms=terms,
                    work=work_per_stage, bubble=bubble, traffic=traffic, vocab_parallel=vp,
                    checkpoint=checkpoint, facts=own, cfg=cfg)
  result.warnings = _warnings(result, device_gib, max_bubble)
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
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import make_mesh  # pylint: disable=g-import-not-at-top
  cfg = resolve_vocab(cfg)
  model, fns, optimizer = trainer.components(cfg)
  run_as = _as_schedule(cfg, schedule, stash)
  sched = trainer.schedule_from_config(run_as, fns, optimizer,
                                       make_mesh(run_as.pipeline.stages, cfg.mesh.data))
  state, batch = trainer.abstract_step_inputs(cfg, model, sched)
  stats = sched.lower_step(state, batch, batch).compile().memory_analysis()
  row = {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
         "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes}
  row["resident"] = row["argument"] + row["output"] - row["alias"] + row["temp"]
  return row


def format_plan(p: Estimate, device_gib: float) -> str:
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
    table.append([label] + [human(p.bytes[n][st].get(key, 0)) if p.bytes[n][st] is not None
                            else "-" for n, st in cols])
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
      "weights, optimizer, in flight, batches: the schedule's state as placed on one device",
      "(the step's arguments). Inside the step, counted by each schedule from the plan it",
      "runs (jaxpipe.pipeline.memory_terms): float32 gradient sums (2bw: two); the",
      "flushed schedules' stash ring (their state with ScheduleOptions.rings_in_state);",
      "stage 0's embedded inputs and their cotangents; the",
      "compute-dtype and version copies of the weights. Then the larger of one tick's",
      "working set (tick rows: the head's float32 logits, the backward's stash read or",
      "recompute and its float32 copy where bfloat16, the weight gradient, the other tick",
      "loops' working sets) and the update's temporaries. total = all rows but those two",
      "groups + the larger of them.",
      f"interleaved: v={virtual_stages(cfg, 'interleaved')} chunks per device (its slots and "
      "working sets hold a chunk's;",
      "a tick adds the copy of the chunk's weights it slices). `-` where a schedule refuses",
      "S, M or the layers.",
      "`tools/planner.py --compile` compiles the config's step and prints XLA's own numbers.",
  ]
  if p.warnings:
    lines.append("")
    lines += [f"warning: {w}" for w in p.warnings]
  return "\n".join(lines)


def plan_json(p: Estimate, compiled: Optional[dict[str, int]]) -> dict[str, Any]:
  """The plan as one JSON-ready dict.

  At the top level, for the config's own schedule and stash: `estimate_gib`
  (the planner's total per device) and `xla_resident_gib` (XLA's resident
  bytes of the compiled step, None without --compile), with `xla` (XLA's
  byte counts), `difference_gib` (estimate - XLA) and `difference`
  (estimate / XLA - 1) beside them; `terms`, the config's schedule's named
  memory terms ({key, label, bytes, phase}); under `estimates`, the planner's total for every
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
      "difference_gib": (gib(p.total(cfg.pipeline.schedule) - compiled["resident"])
                         if compiled else None),
      "difference": (p.total(cfg.pipeline.schedule) / compiled["resident"] - 1
                     if compiled else None),
      "terms": [{"key": t.key, "label": t.label, "bytes": t.nbytes, "phase": t.phase}
                for t in p.terms[cfg.pipeline.schedule][
                    cfg.pipeline.stash if cfg.pipeline.schedule != "none" else "inputs"] or []],
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
  parser.add_argument("--gpu", metavar="KIND", default=None,
                      help="also compile the step for NVIDIA GPUs of this kind (h100, h100-pcie, "
                           "h200, a100, b200; needs the cuda extra) and print what the GPU "
                           "program holds and a projected step")
  parser.add_argument("--nodes", type=int, default=1,
                      help="with --gpu: nodes the mesh's GPUs are spread over (default 1)")
  parser.add_argument("--network-gbps", type=float, default=400.0,
                      help="with --gpu: Gb/s one GPU sends to another node (default 400)")
  parser.add_argument("--time-to-loss", action="store_true",
                      help="instead of the plan, the projected time to a target loss per "
                           "schedule and optimizer, from tools/time_to_loss.py's measurement")
  parser.add_argument("--ttl-json", default=None,
                      help="that measurement (default docs/data/time_to_loss.json); implies "
                           "--time-to-loss")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. pipeline.microbatches=8")
  args = parser.parse_args(argv)
  # Planning needs shapes and shardings, not accelerators: plan on the host
  # (unless told otherwise), whose devices can be emulated in any number. Set
  # before anything imports JAX, which reads it then (--gpu compiles for GPUs
  # through jaxlib's CUDA plugin without starting it as a backend).
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  try:
    if args.device_gib <= 0:
      raise ConfigError(f"--device-gib must be > 0, got {args.device_gib:g}")
    if not 0 < args.max_bubble < 1:
      raise ConfigError(f"--max-bubble must be in (0, 1), got {args.max_bubble:g}")
    _check_gpu_args(args)
    cfg = config_lib.load(args.config, args.overrides)
    if args.time_to_loss or args.ttl_json:
      from jaxpipe import time_to_loss  # pylint: disable=g-import-not-at-top
      ttl = time_to_loss.planner_projection(
          args.ttl_json or time_to_loss.default_json(), cfg.pipeline.stages,
          cfg.pipeline.microbatches, virtual_stages(cfg, "interleaved"), cfg.model.n_layers)
      print(json.dumps({"time_to_loss": ttl}, sort_keys=True) if args.json
            else time_to_loss.format_projection(ttl))
      return 0
    # XLA's default CPU order, which keeps more alive than the depth-first one
    # train.py sets on the CPU: the larger figure is the one to size by.
    os.environ["XLA_FLAGS"] = accel.merge_xla_flags(os.environ.get("XLA_FLAGS", ""),
                                                    accel.xla_default_order_flags())
    # The shardings need the mesh's devices: emulate them before JAX starts.
    launch.prepare_devices(cfg)
    result = plan(cfg, device_gib=args.device_gib, max_bubble=args.max_bubble)
    compiled = gpu_report = None
    if args.compile:
      compiled = compiled_memory(result.cfg, cfg.pipeline.schedule, cfg.pipeline.stash)
    if args.gpu:
      from jaxpipe import gpu as gpu_lib  # pylint: disable=g-import-not-at-top
      gpu_report = gpu_lib.report(gpu_lib.compile_step(result.cfg, args.gpu, nodes=args.nodes),
                                  network_gbps=args.network_gbps)
  except InputError as e:
    print(f"planner: {e}", file=sys.stderr)
    return 2
  if args.json:
    out = plan_json(result, compiled)
    if gpu_report is not None:
      out["gpu"] = gpu_report.as_json()
    print(json.dumps(out, sort_keys=True))
    return 0
  print(format_plan(result, args.device_gib))
  if compiled is not None:
    est = result.total(cfg.pipeline.schedule)
    print(f"\nXLA, {cfg.pipeline.schedule} compiled for this mesh: resident "
          f"{human(compiled['resident'])} per device (arguments {human(compiled['argument'])}, "
          f"temporaries {human(compiled['temp'])}); the estimate above is "
          f"{human(est)} ({est / compiled['resident'] - 1:+.0%}).")
  if gpu_report is not None:
    print("\n" + format_gpu(gpu_report, result.cfg))
  return 0


def _check_gpu_args(args) -> None:
  """Refuses --gpu, --nodes and --network-gbps that cannot work, before anything is built."""
  if args.gpu is None:
    if args.nodes != 1 or args.network_gbps != 400.0:
      raise ConfigError("--nodes and --network-gbps describe the GPUs of --gpu; add --gpu KIND")
    return
  from jaxpipe import gpu as gpu_lib  # pylint: disable=g-import-not-at-top
  try:
    gpu_lib.kind(args.gpu)
  except ValueError as e:
    raise ConfigError(f"--gpu: {e}") from None
  if args.nodes < 1:
    raise ConfigError(f"--nodes must be >= 1, got {args.nodes}")
  if args.network_gbps <= 0:
    raise ConfigError(f"--network-gbps must be > 0, got {args.network_gbps:g}")
  missing = gpu_lib.cuda_plugin_missing()
  if missing:
    raise ConfigError(missing)


def format_gpu(r: Any, cfg: config_lib.Config) -> str:
  """The GPU compile's report (`jaxpipe.gpu.GpuReport`) as the planner prints it."""
  mem, gib = r.memory, lambda n: f"{n / 2 ** 30:.2f} GiB"
  c = r.cost
  kernels = ", ".join(f"{k} x{n}" for k, n in sorted(r.attention["kernels"].items())) or "none"
  lines = [
      f"GPU compile: {cfg.pipeline.schedule} for {r.devices} x {r.device_kind} on {r.nodes} "
      f"node{'s' if r.nodes > 1 else ''} (mesh stage x data = {cfg.pipeline.stages} x "
      f"{cfg.mesh.data}, mesh.layout={cfg.mesh.layout}), XLA's GPU compiler, {r.compile_s:.0f} s",
      f"  memory per device: resident {gib(mem['resident'])} (arguments {gib(mem['argument'])}, "
      f"outputs {gib(mem['output'])}, aliased {gib(mem['alias'])}, temporaries "
      f"{gib(mem['temp'])}) of {gib(r.capacity_bytes)}; JAX's allocator takes "
      f"{gib(r.usable_bytes)}: {'fits' if r.fits else 'DOES NOT FIT'}",
      f"  attention: {r.attention['implementation']} (fused kernels compiled: {kernels})",
      "  matmuls per device and step: " + ", ".join(
          f"{flops(v)} FLOPs in {k}" for k, v in sorted(c.matmul_flops.items()))
      + f"; the model's useful work {flops(r.model_flops)}",
      "  collectives per device and step (bytes each device puts in, each time; hidden: the "
      "matmul FLOPs and kernel time",
      "  scheduled between an asynchronous one's start and done; exposed: what the stream "
      "waits for):",
  ]
  rows = [("kind", "phase", "count", "bytes", "async", "across nodes", "hidden", "exposed")]
  for t in r.transfers:
    rows.append((t.kind, t.phase + (" (loop)" if t.in_loop else ""), str(t.count),
                 human(t.bytes), "yes" if t.asynchronous else "no",
                 "yes" if t.across_nodes else "no",
                 f"{flops(t.hidden_flops)}, {t.hidden_s * 1e6:.0f} us" if t.asynchronous else "-",
                 f"{t.exposed_s * 1e6:.0f} us"))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  lines += ["    " + "  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
  lines += [
      f"  projected step: {r.projected_step_s * 1e3:.1f} ms, MFU {r.projected_mfu:.1%} "
      f"({c.exposed_s * 1e3:.2f} ms waiting for transfers), at {r.peak_tflops:g} TFLOP/s "
      f"dense bf16, {r.links['nvlink']:g} GB/s within a node, {r.links['network']:g} GB/s "
      "across",
      "  A projection, not a measurement (jaxpipe/gpu/_read.py states the model): each kernel "
      "at max(matmul FLOPs / peak,",
      "  bytes / memory bandwidth) plus a launch gap, loops times their trips, a conditional "
      "its slowest branch (a tick",
      "  lasts as long as its slowest stage), collectives at the link's bandwidth plus "
      "latency, the asynchronous ones",
      "  hidden behind the kernels scheduled between their start and done.",
  ]
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
