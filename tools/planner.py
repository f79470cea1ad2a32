#!/usr/bin/env python3
"""Plans a pipeline run before launch: memory per device and bubble of every schedule.

  python tools/planner.py --config configs/smollm-360m.yaml
  python tools/planner.py --config configs/smollm-360m.yaml pipeline.microbatches=4 \
      --device-gib 24

Nothing runs and nothing compiles: every shape comes from `jax.eval_shape` of
the model's init, the optimizer's init and each schedule's `init` (the same
pytrees that training and checkpoints hold), placed with the schedule's own
shardings, so the numbers are the bytes that one device holds. Activations
that live only inside a step (the stash of the flushed schedules, the
backward's residuals) come from `jax.eval_shape` of `jax.vjp` of the model's
stage functions on one microbatch.

For the config's S stages, D data replicas and M microbatches it prints a
table with a column per schedule (`none` is the whole model on one device of
the data axis, for comparison) and a row per kind of memory, the steady-state
bubble of each schedule from the engine's timetable, and warnings: M too small
for 2bw (it needs M >= 2(S-1)), a synchronous schedule idling more than
--max-bubble of every step, a total above --device-gib.

A bad config exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpipe import config as config_lib  # noqa: E402
from jaxpipe import launch  # noqa: E402
from jaxpipe.errors import ConfigError, InputError  # noqa: E402

SCHEDULES = ("none", "gpipe", "1f1b", "2bw", "pipedream")

# Rows of the table, in order: (key, label).
ROWS = (
    ("weights", "weights (x versions)"),
    ("grads", "gradient accumulators"),
    ("opt", "optimizer state"),
    ("ef", "error-feedback buffer"),
    ("delay", "delay buffer"),
    ("stash", "stashed stage inputs"),
    ("work", "backward residuals"),
    ("head", "head logits + softmax"),
    ("batch", "token batches"),
)


def weight_versions(schedule: str, num_stages: int) -> int:
  """Weight versions a schedule keeps per stage: 2 for 2bw, S for pipedream, else 1."""
  return {"2bw": 2, "pipedream": num_stages}.get(schedule, 1)


def grad_accumulators(schedule: str) -> int:
  """Parameter-sized gradient sums alive during a step.

  2bw finishes batch k-1's gradient while it starts batch k's, so two; the
  others sum one step's gradient.
  """
  return 2 if schedule == "2bw" else 1


def stash_slots(schedule: str, num_stages: int, num_microbatches: int) -> int:
  """Stage inputs of one microbatch that a device holds for its backwards.

  2bw, 1f1b and pipedream run the same lockstep tick engine: a ring of
  2(S-1)+1 slots (an input on stage s lives 2(S-1-s) ticks; one ring size
  serves every stage) plus the activation and the cotangent in transit.
  gpipe saves each forward tick's input for the rematerialised backward:
  M+S-1 of them, plus the carry in transit. `none` has no stage boundary:
  its activations are all in the working set.
  """
  s_, m = num_stages, num_microbatches
  if schedule in ("2bw", "1f1b", "pipedream"):
    return 2 * (s_ - 1) + 1 + 2
  if schedule == "gpipe":
    return m + s_ - 1 + 1
  return 0


def steady_bubble(schedule: str, num_stages: int, num_microbatches: int) -> Optional[float]:
  """Idle share of a steady-state step, counted from the engine's timetable (None: invalid)."""
  from jaxpipe.pipeline import min_microbatches, timetable  # pylint: disable=g-import-not-at-top
  if schedule == "none":
    return 0.0
  if num_microbatches < min_microbatches(schedule, num_stages):
    return None
  return timetable(schedule, num_stages, num_microbatches, 2).idle_fraction(1)


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
      data = data_lib.open_tokens(cfg.data.path)
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


def residual_bytes(fn: Callable, weights: Any, make_x: Callable[[int], Any], rows: int,
                   extra: Callable[[int], tuple] = lambda b: ()) -> int:
  """Bytes of the residuals `jax.vjp(fn)` saves for a microbatch of `rows` rows.

  `jax.eval_shape` of the vjp gives the residuals as a pytree, weights
  included (the backward needs them to pull cotangents back). Activations
  grow with the rows and weights do not, so the difference between two and
  one row, times `rows`, is the activations alone.
  """
  import jax  # pylint: disable=g-import-not-at-top

  def total(b: int) -> int:
    res = jax.eval_shape(lambda w, x, *e: jax.vjp(lambda w, x: fn(w, x, *e), w, x)[1],
                         weights, make_x(b), *extra(b))
    return _bytes(res)

  return (total(2) - total(1)) * rows


@dataclasses.dataclass
class Plan:
  """Per-device memory of every schedule for one config, and its warnings.

  Attributes:
    cfg: the resolved config.
    num_params: parameters of the whole model.
    stage_params: parameters one pipeline device holds per weight version
      (its L/S blocks plus the replicated embedding, norm and head).
    bytes: {schedule: {row key: bytes per device}}; None where the schedule
      refuses the config (2bw with M < 2(S-1)).
    bubble: {schedule: steady-state idle share, or None}.
    warnings: one line each.
  """
  cfg: config_lib.Config
  num_params: int
  stage_params: int
  bytes: dict[str, Optional[dict[str, int]]]
  bubble: dict[str, Optional[float]]
  warnings: list[str]

  def total(self, schedule: str) -> Optional[int]:
    """Bytes per device of a schedule, all rows summed."""
    row = self.bytes[schedule]
    return None if row is None else sum(row.values())


def plan(cfg: config_lib.Config, *, device_gib: float = 80.0, max_bubble: float = 0.25) -> Plan:
  """Computes per-device memory and bubbles of every schedule for `cfg` (no compilation).

  The model, optimizer, mesh and schedules are built exactly as
  `jaxpipe.trainer.build` builds them, without opening the token data.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxpipe import model as model_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  from jaxpipe.pipeline import make_mesh, make_schedule, min_microbatches  # pylint: disable=g-import-not-at-top

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

  # Activations of one microbatch, from the model's own functions.
  blocks, shared = params["blocks"], {k: v for k, v in params.items() if k != "blocks"}
  tok = lambda b: jax.ShapeDtypeStruct((b, cfg.data.seq_len), jnp.int32)
  x_like = lambda b: jax.eval_shape(fns.embed, shared, tok(b))
  stage_input = _bytes(x_like(rows))

  def blocks_of(n: int):
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct((n,) + v.shape[1:], v.dtype), blocks)

  def stage_fn(model_fns):
    return lambda w, x: model_fns.apply_blocks(w, x)[0]

  head = residual_bytes(lambda w, x, t: fns.head(w, x, t), shared, x_like, rows,
                        extra=lambda b: (tok(b),))
  inner = 0
  if cfg.model.remat != "none":
    # With remat the blocks save less (their inputs, or the matmul outputs),
    # and the backward recomputes one block at a time: add what one block
    # saves without remat beyond what it saves with it.
    plain = model_lib.build(dataclasses.replace(cfg.model, remat="none"))
    inner = max(0, residual_bytes(stage_fn(plain), blocks_of(1), x_like, rows)
                - residual_bytes(stage_fn(model), blocks_of(1), x_like, rows))

  def working_set(n_layers: int) -> int:
    return residual_bytes(stage_fn(model), blocks_of(n_layers), x_like, rows) + inner

  out: dict[str, Optional[dict[str, int]]] = {}
  bubble: dict[str, Optional[float]] = {}
  warnings: list[str] = []
  stage_params = 0
  for name in SCHEDULES:
    pipelined = name != "none"
    bubble[name] = steady_bubble(name, s_, m)
    if pipelined and m < min_microbatches(name, s_):
      out[name] = None
      continue
    mesh = make_mesh(s_ if pipelined else 1, d_)
    sched = make_schedule(name, fns, optimizer, mesh, m)
    state = jax.eval_shape(lambda p, sched=sched: sched.init(p, batch_shape), params)
    # The schedule's own placement rules (pytrees as in checkpoints).
    nbytes = _device_bytes(state, sched.state_shardings(state))
    key = "versions" if "versions" in state else "params"
    weights = sum(jax.tree.leaves(nbytes[key]))
    one_version = weights // weight_versions(name, s_)
    if pipelined:
      stage_params = _bytes(params["blocks"]) // s_ + _bytes(shared)
      stage_params //= jnp.dtype(model_lib.dtype_of(cfg.model.param_dtype)).itemsize
    row = {"weights": weights, "grads": grad_accumulators(name) * one_version}
    row.update(_split_opt_state(nbytes["opt_state"]))
    if "stash" in state:  # 2bw carries its stash and transit buffers between steps
      row["stash"] = sum(nbytes[k] for k in ("stash", "fwd_buf", "bwd_buf"))
    else:
      row["stash"] = stash_slots(name, s_, m) * stage_input
    n_layers = cfg.model.n_layers // (s_ if pipelined else 1)
    row["work"] = working_set(n_layers)
    # SPMD compiles one program for every stage: the head's buffers are
    # reserved on each device, though only the last stage fills them.
    row["head"] = head
    batch = 2 * _bytes(jax.ShapeDtypeStruct(batch_shape, jnp.int32)) // d_
    row["batch"] = batch + sum(nbytes.get(k, 0) for k in ("prev_tokens", "prev_targets"))
    out[name] = row

  # Warnings: what the user should change before launching.
  need = min_microbatches("2bw", s_)
  if m < need:
    warnings.append(f"2bw needs pipeline.microbatches >= 2(S-1) = {need} for S={s_} stages "
                    f"(got M={m}); raise M to use it")
  for name in ("gpipe", "1f1b", "pipedream"):
    b = bubble[name]
    if s_ > 1 and b is not None and b > max_bubble:
      k = {"gpipe": 1, "1f1b": 2, "pipedream": 2}[name]
      # bubble = k(S-1) / (M + k(S-1)) <= x  <=>  M >= k(S-1)(1-x)/x
      m_ok = -(-int(round(k * (s_ - 1) * (1 - max_bubble) * 1000)) // int(round(max_bubble * 1000)))
      warnings.append(f"{name} idles {b:.0%} of every step at S={s_}, M={m} (above "
                      f"{max_bubble:.0%}); M >= {m_ok} brings it to {max_bubble:.0%} or less")
  limit = device_gib * 2 ** 30
  for name in SCHEDULES:
    total = sum(out[name].values()) if out[name] is not None else None
    if total is not None and total > limit:
      mark = " (the config's schedule)" if name == cfg.pipeline.schedule else ""
      warnings.append(f"{name}{mark} needs {total / 2 ** 30:.1f} GiB per device, more than "
                      f"--device-gib {device_gib:g}")
  return Plan(cfg, num_params, int(stage_params), out, bubble, warnings)


def human(n: Optional[float]) -> str:
  """Bytes in B/KiB/MiB/GiB with three significant digits."""
  if n is None:
    return "-"
  for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if n >= size:
      return f"{n / size:.3g} {unit}"
  return f"{int(n)} B"


def format_plan(p: Plan, device_gib: float) -> str:
  """The planner's report: header, table, bubble row, notes and warnings."""
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
      f"({cfg.model.n_layers // max(s_, 1)} blocks + the replicated embedding/head)",
      "",
  ]
  names = list(SCHEDULES)
  head = ["per device"] + [n + ("*" if n == cfg.pipeline.schedule else "") for n in names]
  table = [head]
  vers = ["weight versions"] + [str(weight_versions(n, s_)) if n != "none" else "1"
                                for n in names]
  table.append(vers)
  for key, label in ROWS:
    table.append([label] + [human(p.bytes[n][key]) if p.bytes[n] is not None else "-"
                            for n in names])
  table.append(["total"] + [human(p.total(n)) for n in names])
  table.append(["fits --device-gib " + f"{device_gib:g}"] + [
      "-" if p.total(n) is None else ("yes" if p.total(n) <= device_gib * 2 ** 30 else "NO")
      for n in names])
  table.append(["steady-state bubble"] + [
      "n/a" if p.bubble[n] is None else f"{p.bubble[n]:.1%}" for n in names])
  widths = [max(len(r[i]) for r in table) for i in range(len(head))]
  for i, r in enumerate(table):
    lines.append("  ".join(c.ljust(widths[0]) if j == 0 else c.rjust(widths[j])
                           for j, c in enumerate(r)))
    if i == 0:
      lines.append("  ".join("-" * w for w in widths))
  lines += [
      "",
      "* the config's schedule. `none` is the whole model on one device (no stages), "
      "for comparison.",
      "weights: per-device shards of the schedule's state (blocks split over stages, "
      "embedding and head replicated), times the versions kept.",
      "stashed stage inputs: 2bw/1f1b/pipedream ring of 2(S-1)+1 plus 2 in transit; "
      "gpipe M+S-1 saved tick inputs plus 1 (remat).",
      "backward residuals: what one microbatch's backward through the device's blocks "
      "reads (with model.remat: what its policy saves, plus one block recomputed).",
      "head: residuals of the loss on one microbatch (float32 logits); one SPMD program "
      "runs on every stage, so each device reserves them.",
      "not counted: optimizer-update temporaries, XLA's fusion scratch; the benchmark "
      "reads those from the compiled step (tools/bench_pipeline.py).",
  ]
  if p.warnings:
    lines.append("")
    lines += [f"warning: {w}" for w in p.warnings]
  return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
  """Reports a usage error as one line, like every other bad input."""

  def error(self, message: str) -> None:
    self.exit(2, f"{self.prog}: {message} (see --help)\n")


def main(argv: Optional[list[str]] = None) -> int:
  """Loads the config, emulates the mesh's devices, prints the plan."""
  parser = _Parser(prog="planner", description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True, help="YAML config file (see configs/)")
  parser.add_argument("--device-gib", type=float, default=80.0,
                      help="memory of one device in GiB (default 80)")
  parser.add_argument("--max-bubble", type=float, default=0.25,
                      help="warn when a synchronous schedule idles more than this (default 0.25)")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. pipeline.microbatches=8")
  args = parser.parse_args(argv)
  try:
    if args.device_gib <= 0:
      raise ConfigError(f"--device-gib must be > 0, got {args.device_gib:g}")
    if not 0 < args.max_bubble < 1:
      raise ConfigError(f"--max-bubble must be in (0, 1), got {args.max_bubble:g}")
    cfg = config_lib.load(args.config, args.overrides)
    # The shardings need the mesh's devices: emulate them before JAX starts.
    launch.prepare_devices(cfg)
    result = plan(cfg, device_gib=args.device_gib, max_bubble=args.max_bubble)
  except InputError as e:
    print(f"planner: {e}", file=sys.stderr)
    return 2
  print(format_plan(result, args.device_gib))
  return 0


if __name__ == "__main__":
  sys.exit(main())
