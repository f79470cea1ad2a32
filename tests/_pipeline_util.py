"""Shared pieces of the pipeline tests: a tiny model, fixed batches, cached runs.

Every distinct (schedule, mesh, microbatches, optimizer, stash, model) costs
an XLA compile of several seconds on a 2-core CPU, so each training run is
made once per test session (`run` is cached) and compared by as many tests
as need it.

The global batch is ROWS sequences per microbatch, whatever the mesh, so a
pipeline on S x D devices and the one-device reference see the very same
microbatches (a pipeline's data shard of a microbatch is ROWS / D rows).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import io_callback

from jaxpipe import model as model_lib
from jaxpipe import optim
from jaxpipe import trainer
from jaxpipe.config import ModelConfig
from jaxpipe.pipeline import StageFns, make_mesh, make_schedule

# Four blocks so that S = 4 gets one block per stage; float32 throughout.
CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2)
SEQ = 8
ROWS = 4   # sequences per microbatch: divisible by every data size below
STEPS = 5  # enough for pipedream's stage 0 (delay 3 at S = 4) to see an update

# Sane rates for a model this small: at AdamW lr 1e-2 it is unstable and Adam
# amplifies float32 rounding far above 1e-6. Muon's rate is for the hidden
# matrices; its AdamW part (embedding, head, norms) gets AdamW's rate.
ADAMW_LR, MUON_LR = 1e-3, 0.02
# Plain SGD (no momentum) for the bfloat16 comparison, whose update is linear
# in the gradient; at 0.5 each leaf moves well beyond its rounding in 5 steps.
SGD_LR = 0.5
# Adam's update lr * g / (|g| + eps) has slope lr / eps in a gradient entry
# that is zero up to rounding. With eps = 1e-8 that is 1e5: one such entry
# (of 12288 in an MLP kernel, at S=2, D=2, M=3) turned a 3e-11 difference in
# summation order into 2.6e-6 in the weights, half the tolerance. At 1e-6 the
# slope is 1e3, and the tolerance again measures the pipeline, not Adam.
ADAM_EPS = 1e-6


# What a forward keeps for its backward: the stage input (recomputed in the
# backward) or jax.vjp's residuals. The two take different code paths through
# the engine and must compute the same numbers.
STASHES = ["inputs", "residuals"]


def max_diff(a, b) -> float:
  """Largest absolute difference between two weight trees."""
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def shape_id(shape) -> str:
  """A readable test id for an (S, D, M) shape."""
  s, d, m = shape
  return f"S{s}-D{d}-M{m}"


class Run(NamedTuple):
  """One training run.

  Attributes:
    losses: [STEPS] mean loss of batch k at the weights batch k ran on.
    params: the newest weights after STEPS steps, as NumPy arrays (natural,
      unpadded shapes: `Schedule.params`).
    loss_steps: metrics['loss_step'] of each step, in order.
    hlo: the compiled step's HLO text.
    grad_norms: [STEPS] metrics['grad_norm'] by the batch it belongs to (the
      norm of the gradient before the optimizer, so before any clipping).
    state_params: the newest weights as the state holds them (vocabulary
      padded to a multiple of S), as NumPy arrays.
  """
  losses: np.ndarray
  params: Any
  loss_steps: tuple
  hlo: Optional[str]
  grad_norms: Optional[np.ndarray] = None
  state_params: Any = None


def config(**changes) -> ModelConfig:
  """CONFIG with some fields changed (tied embeddings, remat, bfloat16, vocabulary)."""
  return dataclasses.replace(CONFIG, **changes)


@functools.cache
def model(cfg: ModelConfig = CONFIG) -> model_lib.Model:
  """The tiny Llama-style model shared by every pipeline test (or a variant of it)."""
  return model_lib.make_model(cfg)


def stage_fns(cfg: ModelConfig = CONFIG) -> StageFns:
  """The model as the pipeline sees it."""
  return trainer.stage_fns(model(cfg))


@functools.cache
def initial_params(cfg: ModelConfig = CONFIG) -> Any:
  """The starting weights, as NumPy arrays (a schedule's `init` places them).

  Variants that change neither shapes nor float32 weights (remat, compute
  dtype) start from exactly CONFIG's weights.
  """
  # Jitted: run eagerly, flax's init compiles every small op on its own.
  return jax.device_get(jax.jit(model(cfg).init)(jax.random.key(0)))


@functools.cache
def batches(num_microbatches: int, vocab_size: int = CONFIG.vocab_size) -> tuple:
  """STEPS (tokens, targets) pairs of int32 [M, ROWS, SEQ], distinct arrays.

  Targets are the tokens shifted by one, as in language modelling, so a
  mix-up of the two (or of two batches) changes the loss.
  """
  rng = np.random.default_rng(1234 + num_microbatches)
  out = []
  for _ in range(STEPS):
    seq = rng.integers(0, vocab_size, (num_microbatches, ROWS, SEQ + 1)).astype(np.int32)
    out.append((np.ascontiguousarray(seq[..., :-1]), np.ascontiguousarray(seq[..., 1:])))
  return tuple(out)


def optimizer(name: str, *, ef: float = 0.0, delay: int = 0, ef_outside: bool = False,
              clip: float = 0.0) -> optax.GradientTransformation:
  """jaxpipe's AdamW, Muon, SOAP or plain SGD, optionally `delay(error_feedback(opt, ef), delay)`.

  That order is the project's: a 2BW pipeline calls its optimizer only once a
  delayed gradient exists, so the one-device equivalent of 2bw with the
  correction wraps the correction in the delay. `ef_outside` builds the other
  order, `error_feedback(delay(opt))`, for a negative control. `clip` > 0
  clips the gradient's global norm first, where `optim.make_optimizer` puts
  `optimizer.clip_norm`.
  """
  if name == "adamw":
    opt = optim.adamw(ADAMW_LR, eps=ADAM_EPS)
  elif name == "muon":
    opt = optim.muon(MUON_LR, adam_learning_rate=ADAMW_LR, eps=ADAM_EPS)
  elif name == "soap":
    # Refreshing the eigenbases every 2 calls puts a QR refresh inside STEPS.
    # Only sides of at most 16 are rotated (the k and v kernels' 16): a
    # longer side's factor has rank below its size at 64 tokens a step, and
    # the basis of its null space, which Adam's per-coordinate scaling then
    # depends on, is whatever rounding makes it.
    opt = optim.soap(ADAMW_LR, eps=ADAM_EPS, precondition_frequency=2, max_precond_dim=16)
  elif name == "sgd":
    opt = optim.sgd(SGD_LR, momentum=None)
  else:
    raise ValueError(name)
  if clip:
    opt = optax.chain(optax.clip_by_global_norm(clip), opt)
  if ef and not ef_outside:
    opt = optim.error_feedback(opt, ef)
  if delay:
    opt = optim.delay(opt, delay)
  if ef and ef_outside:
    opt = optim.error_feedback(opt, ef)
  return opt


def run(schedule: str, num_stages: int, num_data: int, num_microbatches: int, opt: str, *,
        ef: float = 0.0, delay: int = 0, ef_outside: bool = False, clip: float = 0.0,
        stash: str = "inputs", cfg: ModelConfig = CONFIG, shard_optimizer: bool = True,
        vocab_parallel: bool = True, virtual_stages: int = 1,
        overlap_sends: bool = False) -> Run:
  """Trains STEPS steps with a schedule; cached for the session.

  `stash` is the pipeline's ('inputs' or 'residuals'); `schedule=none` has no
  stash, so its runs are one cache entry whatever `stash` says. `cfg` is the
  model (CONFIG or a `config(...)` variant); its batches draw tokens from
  its vocabulary. `shard_optimizer` is the schedule's (ZeRO-1 over 'data');
  `vocab_parallel` too (False: the embedding and head whole, on the first and
  last stage); `virtual_stages` interleaved's chunks per device;
  `overlap_sends` the engine's placement of transfers for GPUs
  (`Engine(overlap=...)`), off as on any CPU mesh by default.
  """
  if schedule == "none":
    stash, vocab_parallel = "inputs", True
  return _run(schedule, num_stages, num_data, num_microbatches, opt, ef, delay, ef_outside,
              clip, stash, cfg, shard_optimizer, vocab_parallel, virtual_stages, overlap_sends)


@functools.cache
def _run(schedule, num_stages, num_data, num_microbatches, opt, ef, delay, ef_outside, clip,
         stash, cfg, shard_optimizer, vocab_parallel, virtual_stages=1,
         overlap_sends=False) -> Run:
  """`run`, with every argument explicit so that equal runs share one cache entry.

  The step is compiled once, through `lower_step` for its HLO; `step` then
  finds that executable in JAX's cache.

  Losses are collected by the batch they belong to (`metrics['loss_step']`),
  which undoes 2bw's one-step reporting lag; its last batch's loss comes
  from `pending_loss`.
  """
  m = num_microbatches
  sch = make_schedule(schedule, stage_fns(cfg),
                      optimizer(opt, ef=ef, delay=delay, ef_outside=ef_outside, clip=clip),
                      make_mesh(num_stages, num_data), m, stash=stash,
                      shard_optimizer=shard_optimizer, vocab_parallel=vocab_parallel,
                      virtual_stages=virtual_stages,
                      overlap_sends=overlap_sends if schedule != "none" else None)
  params = jax.tree.map(jnp.asarray, initial_params(cfg))
  state = sch.init(params, (m, ROWS, SEQ))
  losses, norms, loss_steps, hlo = {}, {}, [], None
  for tok, tgt in batches(m, cfg.vocab_size):
    tok = jax.device_put(tok, sch.batch_sharding())
    tgt = jax.device_put(tgt, sch.batch_sharding())
    if hlo is None:
      hlo = sch.lower_step(state, tok, tgt).compile().as_text()
    state, metrics = sch.step(state, tok, tgt)
    assert bool(metrics["ran"])
    step = int(metrics["loss_step"])
    loss_steps.append(step)
    if step >= 0:
      assert step not in losses
      losses[step] = float(metrics["loss"])
      norms[step] = float(metrics["grad_norm"])
  pending = sch.pending_loss(state)
  if pending is not None:
    losses[STEPS - 1] = float(pending)
  assert sorted(losses) == list(range(STEPS)), losses
  return Run(np.array([losses[k] for k in range(STEPS)]), jax.device_get(sch.params(state)),
             tuple(loss_steps), hlo, np.array([norms.get(k, np.nan) for k in range(STEPS)]),
             jax.device_get(sch.newest(state)))


# --- the pipedream reference -------------------------------------------------


@functools.cache
def _grad_fn():
  """Mean loss and gradient over a batch's microbatches, summed in order.

  The same accumulation as `schedule=none`: a scan over the microbatches,
  then one division by M.
  """
  loss_fn = model().loss

  def grads(params, tokens, targets):
    def micro(carry, batch):
      g_sum, l_sum = carry
      loss, g = jax.value_and_grad(loss_fn)(params, *batch)
      return (jax.tree.map(jnp.add, g_sum, g), l_sum + loss), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (g, loss), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), (tokens, targets))
    m = tokens.shape[0]
    return loss / m, jax.tree.map(lambda x: x / m, g)

  return jax.jit(grads)


def stale_point(history: list, k: int, delays: tuple, embed_head: tuple) -> Any:
  """The weights batch k runs on when stage s lags `delays[s]` updates.

  `history[j]` holds the weights after j updates (every stage updates once
  per step, so stage s's own history is its slice of it). Stage s owns
  blocks s*L/S .. (s+1)*L/S - 1; the embedding lags `embed_head[0]` updates
  and the final norm and head `embed_head[1]`.
  """
  per = CONFIG.n_layers // len(delays)
  version = lambda d: history[max(0, k - d)]
  blocks = jax.tree.map(
      lambda *vs: np.concatenate([v[i * per:(i + 1) * per] for i, v in enumerate(vs)]),
      *[version(d)["blocks"] for d in delays])
  return {"embed": version(embed_head[0])["embed"], "blocks": blocks,
          "head": version(embed_head[1])["head"]}


@functools.cache
def _update_fn(opt: str, **kwargs):
  """(optimizer, jitted (grads, opt_state, params) -> (params, opt_state))."""
  tx = optimizer(opt, **kwargs)

  def update(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return tx, jax.jit(update)


@functools.cache
def stale_reference(delays: tuple, num_microbatches: int, opt: str, *,
                    embed_head: Optional[tuple] = None, **opt_kwargs) -> Run:
  """One-device training where stage s's weights lag `delays[s]` updates.

  The batch-granular model of docs/schedules.md: batch k's loss and gradient are
  taken at `stale_point(history, k, ...)`, and one optimizer step applies
  that gradient to the newest weights. PipeDream is delays (S-1, ..., 1, 0);
  all zeros is synchronous training. The embedding belongs to stage 0 and the
  final norm and head to the last stage, so by default they lag as those
  stages do; `embed_head` overrides their delays (for negative controls).
  `opt_kwargs` go to `optimizer` (e.g. `delay=1`: with zero stage delays,
  the arithmetic of `schedule=none` with a delayed optimizer).
  """
  if embed_head is None:
    embed_head = (delays[0], delays[-1])
  tx, update = _update_fn(opt, **opt_kwargs)
  grad_fn = _grad_fn()
  history = [initial_params()]
  opt_state = jax.jit(tx.init)(history[0])
  losses = []
  for k, (tok, tgt) in enumerate(batches(num_microbatches)):
    loss, grads = grad_fn(stale_point(history, k, delays, embed_head), tok, tgt)
    params, opt_state = update(grads, opt_state, history[-1])
    history.append(jax.device_get(params))
    losses.append(float(loss))
  return Run(np.array(losses), history[-1], tuple(range(STEPS)), None)


# --- comparisons and HLO -----------------------------------------------------


# float32 rounding: losses are about 4.2, weights about 0.02 (matrices) and 1
# (norm scales), where one ulp is 1.2e-7.
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=0, atol=5e-6)


def assert_runs_match(got: Run, want: Run):
  """Same per-step losses and same final weights, to float32 rounding."""
  np.testing.assert_allclose(got.losses, want.losses, **LOSS_TOL, err_msg="per-step losses")
  flat_got = jax.tree_util.tree_flatten_with_path(got.params)[0]
  flat_want = jax.tree.leaves(want.params)
  assert jax.tree.structure(got.params) == jax.tree.structure(want.params)
  for (path, g), w in zip(flat_got, flat_want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), **PARAM_TOL,
                               err_msg=f"final weights at {jax.tree_util.keystr(path)}")


_SHAPE = re.compile(r"\b(?:f64|f32|bf16|f16|s32|s8|u32|u8|pred)\[([0-9,]*)\]")


def _opcode(op: str) -> re.Pattern:
  # `op(` or, for XLA's asynchronous form (GPU), `op-start(`.
  return re.compile(rf"\s{op}(?:-start)?\(")


def collectives(hlo: str, op: str) -> list[str]:
  """Lines of `hlo` that define an `op` collective, e.g. 'all-gather'."""
  pattern = _opcode(op)
  return [line.strip() for line in hlo.splitlines()
          if "=" in line and pattern.search(line.split("=", 1)[1])]


def result_shapes(line: str, op: str) -> list[tuple[int, ...]]:
  """Array shapes in the result type of an `op` instruction (a tuple gives several).

  The result type is what stands between '=' and the opcode; operands and
  attributes after it are ignored.
  """
  rhs = line.split("=", 1)[1]
  head = rhs[:_opcode(op).search(rhs).start()]
  return [tuple(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(head)]


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)="
                     r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


def computations(hlo: str) -> dict[str, list[str]]:
  """The instruction lines of each computation of an HLO module, by name."""
  comps, name = {}, None
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      name = header.group(1)
      comps[name] = []
    elif line.startswith("}"):
      name = None
    elif name is not None and line.strip():
      comps[name].append(line.strip())
  return comps


def loop_computations(hlo: str) -> set[str]:
  """Names of every computation that runs inside a while loop (the tick scan).

  Starts from the bodies and conditions of all `while` instructions and
  follows calls, fusions, reductions and conditional branches.
  """
  comps = computations(hlo)

  def callees(lines):
    out = []
    for line in lines:
      out += _CALLEE.findall(line)
      for group in _BRANCHES.findall(line):
        out += [x.strip().lstrip("%") for x in group.split(",") if x.strip()]
    return out

  todo = [c for lines in comps.values() for line in lines if re.search(r"\swhile\(", line)
          for c in _CALLEE.findall(line)]
  seen = set()
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    todo += callees(comps[name])
  return seen


def entry_parameter_shapes(hlo: str) -> list[tuple[int, ...]]:
  """Per-device shapes of the compiled module's inputs (its ENTRY parameters)."""
  shapes, inside = [], False
  for line in hlo.splitlines():
    if line.startswith("ENTRY"):
      inside = True
    elif inside and line.startswith("}"):
      break
    elif inside and _opcode("parameter").search(line.split("=", 1)[-1]):
      shapes += result_shapes(line, "parameter")
  return shapes


_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def replica_groups(line: str, num_devices: int) -> list[frozenset]:
  """The device groups of a collective's `replica_groups`, in any of XLA's spellings.

  Explicit `{{0,2},{1,3}}`; iota `[G,N]<=[dims]T(perm)`; the mesh form
  `mesh['axis_0'=4,'axis_1'=2] {'axis_0'}` (a group per value of the axes not
  named, devices numbered row-major over the mesh); `{}` is every device.
  An unknown spelling raises, so a check built on this cannot pass vacuously.
  """
  found = _EXPLICIT_GROUPS.search(line)
  if found:
    groups = re.findall(r"\{([0-9,]*)\}", found.group(1))
    if not groups:
      return [frozenset(range(num_devices))]
    return [frozenset(int(x) for x in g.split(",") if x) for g in groups]
  found = _IOTA_GROUPS.search(line)
  if found:
    n_groups, size = int(found.group(1)), int(found.group(2))
    dims = [int(x) for x in found.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if found.group(4):
      ids = ids.transpose([int(x) for x in found.group(4).split(",")])
    return [frozenset(row.tolist()) for row in ids.reshape(n_groups, size)]
  found = _MESH_GROUPS.search(line)
  if found:
    axes = re.findall(r"'(\w+)'=(\d+)", found.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    grouped = re.findall(r"'(\w+)'", found.group(2))
    ids = np.arange(int(np.prod(sizes))).reshape(sizes)
    order = [i for i, a in enumerate(names) if a not in grouped] + [names.index(a) for a in grouped]
    size = int(np.prod([sizes[names.index(a)] for a in grouped]))
    return [frozenset(row.tolist()) for row in ids.transpose(order).reshape(-1, size)]
  raise ValueError(f"no replica_groups this parser knows in: {line[:200]}")


def counting_stage(stage, log):
  """`stage` wrapped so that every call reports to `log` from the device.

  Each call appends (kind, stage, data replica, its input x) in program
  order (an ordered io_callback): kind 'F' for a forward (the primal), 'R'
  for the forward that jax.vjp re-runs in the backward (the custom_vjp's
  forward rule: the 'inputs' stash's recomputation) and 'B' for the pullback.
  """
  def report(kind, x):
    record = lambda s, d, x: log.append((kind, int(s), int(d), np.array(x)))
    io_callback(record, None, lax.axis_index("stage"), lax.axis_index("data"), x, ordered=True)

  @jax.custom_vjp
  def counted(blocks, x):
    report("F", x)
    return stage(blocks, x)

  def forward(blocks, x):
    report("R", x)
    return stage(blocks, x), (blocks, x)

  def backward(res, g):
    blocks, x = res
    report("B", x)
    return jax.vjp(stage, blocks, x)[1](g)

  counted.defvjp(forward, backward)
  return counted
