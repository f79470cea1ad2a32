"""Training schedules behind one interface: none, gpipe, 1f1b, 2bw, pipedream.

A `Schedule` owns a mesh, the model's `StageFns` and an optax optimizer. Its
state is one pytree of arrays (what a checkpoint saves): parameters (with a
leading version axis where several weight versions are alive), optimizer state,
a step counter and, for 2bw, everything in flight between steps. `step` is one
jitted function per schedule; `eval_loss` is a forward-only pass.

Parameters are a dict whose 'blocks' entry is stacked along a leading layer
axis; on a pipeline mesh that axis is sharded over 'stage' (each stage holds
L/S consecutive blocks), and every other entry ('shared': embedding, head) is
replicated. The optimizer runs after the pipeline, in the same jit, on these
stage-sharded arrays: element-wise rules and Muon's per-matrix
orthogonalisation stay on the stage that owns the weights.

Loss reporting: `step` returns `metrics['loss']`, the mean training loss of
batch `metrics['loss_step']` at the weights that batch ran on. For 2bw a
batch's last microbatches reach the last stage during the next step, so step k
reports batch k-1 (`loss_lag = 1`) and `pending_loss` gives the last batch's.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpipe.pipeline import _engine
from jaxpipe.pipeline._engine import DATA, STAGE, StageFns, TickCarry
from jaxpipe.pipeline._timetable import step_plan, min_microbatches

Tree = Any
State = dict

__all__ = ["Schedule", "make_schedule", "make_mesh", "split_params", "merge_params",
           "SCHEDULE_NAMES"]

SCHEDULE_NAMES = ("none", "gpipe", "1f1b", "2bw", "pipedream")


def make_mesh(num_stages: int, num_data: int, devices=None) -> Mesh:
  """A ('stage', 'data') mesh of the first S*D devices, with Auto axes."""
  devices = list(jax.devices() if devices is None else devices)
  need = num_stages * num_data
  if need > len(devices):
    raise ValueError(f"the mesh needs stages x data = {num_stages} x {num_data} = {need} "
                     f"devices, but only {len(devices)} are available")
  grid = np.array(devices[:need], dtype=object).reshape(num_stages, num_data)
  return Mesh(grid, (STAGE, DATA), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def split_params(params: Tree) -> tuple[Tree, Tree]:
  """(blocks, shared): params['blocks'] and a dict of every other entry."""
  return params["blocks"], {k: v for k, v in params.items() if k != "blocks"}


def merge_params(blocks: Tree, shared: Tree) -> Tree:
  """Inverse of `split_params`."""
  return {**shared, "blocks": blocks}


def _full_loss(fns: StageFns):
  def loss(params, tokens, targets):
    blocks, shared = split_params(params)
    x, aux = fns.stage(blocks, fns.embed(shared, tokens))
    return fns.head(shared, x, targets) + aux
  return loss


def _pick(tree: Tree, index) -> Tree:
  return jax.tree.map(lambda v: v[index], tree)


def _local(tree: Tree) -> Tree:
  return jax.tree.map(lambda x: x[0, 0], tree)


def _per_device(tree: Tree) -> Tree:
  return jax.tree.map(lambda x: x[None, None], tree)


def _all_finite(tree: Tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


class Schedule:
  """Base class: shardings, the optimizer step with its NaN guard, and jitting."""

  name = "base"
  loss_lag = 0
  pipelined = True

  def __init__(self, fns: StageFns, optimizer: optax.GradientTransformation, mesh: Mesh,
               num_microbatches: int, *, remat: bool = True):
    self.fns, self.opt, self.mesh = fns, optimizer, mesh
    self.num_stages = mesh.shape[STAGE]
    self.num_data = mesh.shape[DATA]
    self.num_microbatches = num_microbatches
    self.remat = remat
    if not self.pipelined and self.num_stages != 1:
      raise ValueError(f"schedule '{self.name}' runs without stages; got a mesh of "
                       f"{self.num_stages} stages")
    need = min_microbatches(self.name, self.num_stages) if self.pipelined else 1
    if num_microbatches < need:
      raise ValueError(f"schedule {self.name} with {self.num_stages} stages needs at least "
                       f"{need} microbatches per step, got {num_microbatches}")
    self._jit_step = None
    self._jit_eval = None

  # --- shardings -------------------------------------------------------------

  def _spec(self, *axes) -> NamedSharding:
    return NamedSharding(self.mesh, P(*axes))

  def param_shardings(self, params: Tree, *, version_axis: bool = False) -> Tree:
    """Blocks sharded over 'stage' on their layer axis, everything else replicated."""
    lead = (None,) if version_axis else ()
    blocks, shared = split_params(params)
    block_spec = self._spec(*lead, STAGE) if self.pipelined else self._spec()
    return merge_params(jax.tree.map(lambda _: block_spec, blocks),
                        jax.tree.map(lambda _: self._spec(), shared))

  def opt_shardings(self, params: Tree, opt_state: Tree) -> Tree:
    """Shardings of the optimizer state: each parameter-shaped copy follows its parameter."""
    specs = self.param_shardings(params)
    masked = lambda x: isinstance(x, optax.MaskedNode)
    # Partitioned optimizers hold MaskedNode placeholders where a group does
    # not apply; they stay placeholders.
    return optax.tree_map_params(
        self.opt, lambda x, spec: x if masked(x) else spec, opt_state, specs,
        transform_non_params=lambda _: self._spec(), is_leaf=masked)

  def replicated(self) -> NamedSharding:
    """A sharding that keeps a full copy on every device of the mesh."""
    return self._spec()

  def batch_sharding(self) -> NamedSharding:
    """Sharding of a [M, B/M, seq] token batch: rows split over 'data'."""
    return self._spec(None, DATA)

  # --- optimizer ---------------------------------------------------------------

  def _update(self, params, opt_state, grads, allowed):
    """Applies the optimizer when `allowed` and every gradient is finite."""
    finite = _all_finite(grads)

    def apply(_):
      updates, new_state = self.opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), new_state

    params, opt_state = lax.cond(allowed & finite, apply, lambda _: (params, opt_state), None)
    return params, opt_state, finite

  def _grad_metrics(self, grads, loss, loss_step, finite):
    blocks, shared = split_params(grads)
    layer_ok = jnp.stack([jnp.all(jnp.isfinite(x).reshape(x.shape[0], -1), axis=1)
                          for x in jax.tree.leaves(blocks)]).all(axis=0)  # [L]
    stage_ok = layer_ok.reshape(self.num_stages, -1).all(axis=1)          # [S]
    return {"loss": loss, "loss_step": loss_step, "grad_norm": optax.tree.norm(grads),
            "finite": finite & jnp.isfinite(loss), "stage_finite": stage_ok,
            "shared_finite": _all_finite(shared)}

  # --- interface ---------------------------------------------------------------

  def init(self, params: Tree, batch_shape: tuple[int, int, int],
           token_dtype=jnp.int32) -> State:
    """Places `params` on the mesh and builds the initial training state.

    One jitted function makes the whole state directly in its shardings.

    Args:
      params: the model's parameters ('blocks' stacked on a leading axis).
      batch_shape: (M, B/M, seq) of the global batches `step` will receive.
      token_dtype: dtype of the token batches.
    """
    fn = functools.partial(self._init_fn, batch_shape=tuple(batch_shape),
                           token_dtype=token_dtype)
    abstract = jax.eval_shape(fn, params)
    return jax.jit(fn, out_shardings=self.state_shardings(abstract))(params)

  def _init_fn(self, params, *, batch_shape, token_dtype) -> State:
    del batch_shape, token_dtype
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": self.opt.init(params)}

  def state_shardings(self, state: State) -> Tree:
    """Shardings of every entry of a state (arrays or `jax.eval_shape` structs)."""
    out = {}
    for key, value in state.items():
      if key == "params":
        out[key] = self.param_shardings(value)
      elif key == "versions":
        out[key] = self.param_shardings(value, version_axis=True)
      elif key == "opt_state":
        params = state["params"] if "params" in state else state["versions"]  # structure only
        out[key] = self.opt_shardings(params, value)
      elif key in ("prev_tokens", "prev_targets"):
        out[key] = self.batch_sharding()
      elif key == "step":
        out[key] = self._spec()
      else:  # in-flight per-device buffers, [stage, data, ...]
        out[key] = jax.tree.map(lambda _: self._spec(STAGE, DATA), value)
    return out

  def params(self, state: State) -> Tree:
    """The newest weights (those the next batch runs on), natural shapes."""
    return state["params"]

  def _step_fn(self, state: State, tokens, targets):
    raise NotImplementedError

  def _eval_fn(self, params: Tree, tokens, targets):
    raise NotImplementedError

  def _jitted_step(self, state: State):
    if self._jit_step is None:
      shardings = self.state_shardings(state)
      # Metrics replicated everywhere, so every process can read them.
      self._jit_step = jax.jit(self._step_fn, donate_argnums=(0,),
                               out_shardings=(shardings, self._spec()))
    return self._jit_step

  def step(self, state: State, tokens: jax.Array, targets: jax.Array):
    """One training step on a [M, B/M, seq] batch; returns (state, metrics)."""
    return self._jitted_step(state)(state, tokens, targets)

  def lower_step(self, state: State, tokens, targets):
    """The lowered (not yet compiled) step, for HLO inspection and compile timing."""
    return self._jitted_step(state).lower(state, tokens, targets)

  def eval_loss(self, state: State, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean loss of a [M, B/M, seq] batch at the newest weights (no update)."""
    if self._jit_eval is None:
      self._jit_eval = jax.jit(self._eval_fn, out_shardings=self._spec())
    return self._jit_eval(self.params(state), tokens, targets)

  def pending_loss(self, state: State) -> Optional[jax.Array]:
    """Loss of the batch whose report is still in flight (2bw), else None."""
    return None


class NoPipeline(Schedule):
  """schedule=none: the whole model on each device, data parallel over 'data'.

  The microbatches are gradient accumulation: the step's gradient is the mean
  of the microbatches' gradients, so it equals the full batch's.
  """

  name = "none"
  pipelined = False

  def _grads(self, params, tokens, targets):
    loss_fn = _full_loss(self.fns)

    def micro(carry, batch):
      g_sum, l_sum = carry
      loss, g = jax.value_and_grad(loss_fn)(params, *batch)
      return (jax.tree.map(jnp.add, g_sum, g), l_sum + loss), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (g, loss), _ = lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), (tokens, targets))
    m = tokens.shape[0]
    return jax.tree.map(lambda x: x / m, g), loss / m

  def _step_fn(self, state, tokens, targets):
    grads, loss = self._grads(state["params"], tokens, targets)
    params, opt_state, finite = self._update(state["params"], state["opt_state"], grads,
                                             jnp.array(True))
    metrics = self._grad_metrics(grads, loss, state["step"], finite)
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

  def _eval_fn(self, params, tokens, targets):
    loss_fn = _full_loss(self.fns)
    losses = lax.map(lambda b: loss_fn(params, *b), (tokens, targets))
    return jnp.mean(losses)


class _Pipelined(Schedule):
  """Shared machinery of the pipelined schedules (shard_map programs)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.plan = step_plan(self.name, self.num_stages, self.num_microbatches)
    self.eval_plan = step_plan("gpipe", self.num_stages, self.num_microbatches)

  def _shard_map(self, fn, in_specs, out_specs):
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=True)

  def _block_specs(self, tree, lead=()):
    return jax.tree.map(lambda _: P(*lead, STAGE), tree)

  def _rep_specs(self, tree):
    return jax.tree.map(lambda _: P(), tree)

  def _act_like(self, shared, tokens_local_mb) -> jax.ShapeDtypeStruct:
    return jax.eval_shape(self.fns.embed, shared, tokens_local_mb)

  def _local_mb(self, tokens) -> jax.ShapeDtypeStruct:
    m, b, t = tokens.shape
    return jax.ShapeDtypeStruct((b // self.num_data, t), tokens.dtype)

  def _reduce(self, g_blocks, g_shared, loss):
    """Sums a step's per-device gradient and loss sums into batch means."""
    n = self.num_microbatches * self.num_data
    g_blocks = jax.tree.map(lambda g: lax.psum(g, DATA) / n, g_blocks)
    g_shared = jax.tree.map(lambda g: lax.psum(g, (STAGE, DATA)) / n, g_shared)
    return g_blocks, g_shared, lax.psum(loss, (STAGE, DATA)) / n

  def _forward_only(self, blocks, shared, tokens, targets):
    """Mean loss by GPipe's forward ticks, as a shard_map over the mesh."""
    x_like = self._act_like(shared, self._local_mb(tokens))

    def body(blocks, shared, tokens, targets):
      x0 = _engine.fresh(jnp.zeros(x_like.shape, x_like.dtype))
      total = _engine.forward_loss(self.fns, self.eval_plan, blocks, shared, tokens, targets,
                                   x0, remat=False)
      return lax.psum(total, (STAGE, DATA)) / (self.num_microbatches * self.num_data)

    fn = self._shard_map(body, (self._block_specs(blocks), self._rep_specs(shared),
                                P(None, DATA), P(None, DATA)), P())
    return fn(blocks, shared, tokens, targets)

  def _eval_fn(self, params, tokens, targets):
    blocks, shared = split_params(params)
    return self._forward_only(blocks, shared, tokens, targets)

  def _flush_grads(self, versions, version_of, tokens, targets):
    """Runs one flushed step of tick plan (1f1b, pipedream): mean grads and loss.

    `versions` is (blocks, shared) with a leading version axis;
    `version_of(stage)` picks the version a stage runs.
    """
    plan = self.plan
    ring = 2 * (self.num_stages - 1) + 1
    x_like = self._act_like(_pick(versions[1], 0), self._local_mb(tokens))

    def body(blocks_v, shared_v, tokens, targets):
      versions = (_engine.varying(blocks_v, (DATA,)), _engine.varying(shared_v, (STAGE, DATA)))
      x0 = jnp.zeros(x_like.shape, x_like.dtype)
      acc = jax.tree.map(lambda v: jnp.zeros((1,) + v.shape[1:], v.dtype), versions)
      carry = _engine.fresh(TickCarry(x0, x0, jnp.zeros((ring,) + x0.shape, x0.dtype), acc,
                                      jnp.zeros((1,), jnp.float32)))
      stage_version = version_of(lax.axis_index(STAGE))
      window = (jnp.concatenate([tokens, tokens]), jnp.concatenate([targets, targets]))
      carry = _engine.tick_loop(
          self.fns, plan, versions, *window, carry,
          version_of=lambda i: stage_version, valid_of=lambda i: i >= 0,
          acc_of=lambda i: 0, slot_of=lambda i: i % ring)
      return self._reduce(_pick(carry.acc[0], 0), _pick(carry.acc[1], 0), carry.loss[0])

    blocks_v, shared_v = versions
    fn = self._shard_map(
        body, (self._block_specs(blocks_v, (None,)), self._rep_specs(shared_v),
               P(None, DATA), P(None, DATA)),
        (self._block_specs(_pick(blocks_v, 0)), self._rep_specs(shared_v), P()))
    g_blocks, g_shared, loss = fn(blocks_v, shared_v, tokens, targets)
    return merge_params(g_blocks, g_shared), loss


class GPipe(_Pipelined):
  """GPipe: M+S-1 forward ticks, backward by `jax.grad`, with rematerialisation."""

  name = "gpipe"

  def _step_fn(self, state, tokens, targets):
    blocks, shared = split_params(state["params"])
    x_like = self._act_like(shared, self._local_mb(tokens))
    plan = self.plan

    def body(blocks, shared, tokens, targets):
      blocks, shared = _engine.varying(blocks, (DATA,)), _engine.varying(shared, (STAGE, DATA))
      x0 = _engine.fresh(jnp.zeros(x_like.shape, x_like.dtype))
      loss_fn = lambda b, s: _engine.forward_loss(self.fns, plan, b, s, tokens, targets, x0,
                                                  remat=self.remat)
      total, (gb, gs) = jax.value_and_grad(loss_fn, argnums=(0, 1))(blocks, shared)
      return self._reduce(gb, gs, total)

    fn = self._shard_map(body, (self._block_specs(blocks), self._rep_specs(shared),
                                P(None, DATA), P(None, DATA)),
                         (self._block_specs(blocks), self._rep_specs(shared), P()))
    g_blocks, g_shared, loss = fn(blocks, shared, tokens, targets)
    grads = merge_params(g_blocks, g_shared)
    params, opt_state, finite = self._update(state["params"], state["opt_state"], grads,
                                             jnp.array(True))
    metrics = self._grad_metrics(grads, loss, state["step"], finite)
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics


class OneFOneB(_Pipelined):
  """1F1B (PipeDream-Flush) in lockstep: M+2(S-1) ticks, one version, a flush per step."""

  name = "1f1b"

  def _step_fn(self, state, tokens, targets):
    blocks, shared = split_params(state["params"])
    versions = jax.tree.map(lambda x: x[None], (blocks, shared))
    grads, loss = self._flush_grads(versions, lambda s: 0, tokens, targets)
    params, opt_state, finite = self._update(state["params"], state["opt_state"], grads,
                                             jnp.array(True))
    metrics = self._grad_metrics(grads, loss, state["step"], finite)
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics


class PipeDream(_Pipelined):
  """Original PipeDream's weight stashing: stage s runs batch k on w_s[k-(S-1-s)].

  The batch-granular model of docs/schedules.md: every stage keeps its last
  S weight versions (a ring indexed by update count mod S); batch k's forward
  and backward on stage s use version max(0, k - d_s), d_s = S-1-s, and the
  gradient updates the newest version. Executed with 1F1B's flushed ticks, so
  its numerics are PipeDream's but its time per step is 1F1B's: it exists for
  the staleness comparison, not for speed.
  """

  name = "pipedream"

  def _init_fn(self, params, *, batch_shape, token_dtype):
    del batch_shape, token_dtype
    s = self.num_stages
    versions = jax.tree.map(lambda x: jnp.broadcast_to(x, (s,) + x.shape), params)
    return {"step": jnp.zeros((), jnp.int32), "versions": versions,
            "opt_state": self.opt.init(params)}

  def params(self, state):
    return _pick(state["versions"], state["step"] % self.num_stages)

  def _step_fn(self, state, tokens, targets):
    k, s_ = state["step"], self.num_stages
    versions = split_params(state["versions"])
    version_of = lambda s: jnp.maximum(0, k - (s_ - 1 - s)) % s_
    grads, loss = self._flush_grads(versions, version_of, tokens, targets)
    newest = _pick(state["versions"], k % s_)
    params, opt_state, finite = self._update(newest, state["opt_state"], grads, jnp.array(True))
    ring = jax.tree.map(lambda v, p: v.at[(k + 1) % s_].set(p), state["versions"], params)
    metrics = self._grad_metrics(grads, loss, k, finite)
    return {"step": k + 1, "versions": ring, "opt_state": opt_state}, metrics


class TwoBW(_Pipelined):
  """PipeDream-2BW: no flush, two weight versions, a constant one-step delay.

  Step k runs M ticks; at tick i stage s runs the forward of window
  microbatch M+i-s and the backward of M+i-2(S-1)+s (below M: batch k-1).
  Microbatches of batch k use v[k] (version slot k % 2), those of k-1 use
  v[k-1]. At the end of step k the gradient of batch k-1 is complete, and
  v[k+1] = v[k] + U(G[k-1]) overwrites slot (k+1) % 2. Step 0 has no finished
  batch: v[1] = v[0] and the optimizer is not called. The stash, the
  in-flight activations and cotangents, batch k's partial gradient and loss,
  and batch k's tokens stay in the state for step k+1.

  Final weights: after N steps the newest version is v[N], which equals N
  steps of one-device training with `jaxpipe.optim.delay(opt, 1)`; the last
  batch's gradient is in flight in both.
  """

  name = "2bw"
  loss_lag = 1

  def _init_fn(self, params, *, batch_shape, token_dtype):
    """Two copies of v[0], an empty pipeline, zero batches in the batch slots."""
    m, b, t = batch_shape
    blocks, shared = split_params(params)
    x = self._act_like(shared, jax.ShapeDtypeStruct((b // self.num_data, t), token_dtype))
    s_, d_ = self.num_stages, self.num_data
    ring = 2 * (s_ - 1) + 1
    zeros = lambda shape, dtype: jnp.zeros((s_, d_) + tuple(shape), dtype)
    return {
        "step": jnp.zeros((), jnp.int32),
        "versions": jax.tree.map(lambda v: jnp.broadcast_to(v, (2,) + v.shape), params),
        "opt_state": self.opt.init(params),
        "acc": merge_params(
            jax.tree.map(lambda v: zeros((v.shape[0] // s_,) + v.shape[1:], v.dtype), blocks),
            jax.tree.map(lambda v: zeros(v.shape, v.dtype), shared)),
        "loss": zeros((), jnp.float32),
        "stash": zeros((ring,) + x.shape, x.dtype),
        "fwd_buf": zeros(x.shape, x.dtype),
        "bwd_buf": zeros(x.shape, x.dtype),
        "prev_tokens": jnp.zeros((m, b, t), token_dtype),
        "prev_targets": jnp.zeros((m, b, t), token_dtype),
    }

  def params(self, state):
    return _pick(state["versions"], state["step"] % 2)

  def _step_fn(self, state, tokens, targets):
    k, m, s_ = state["step"], self.num_microbatches, self.num_stages
    ring = 2 * (s_ - 1) + 1
    plan = self.plan
    blocks_v, shared_v = split_params(state["versions"])
    acc_blocks, acc_shared = split_params(state["acc"])

    def body(blocks_v, shared_v, acc_blocks, acc_shared, loss, stash, fwd_buf, bwd_buf,
             prev_tok, prev_tgt, tok, tgt, k):
      versions = (_engine.varying(blocks_v, (DATA,)), _engine.varying(shared_v, (STAGE, DATA)))
      # Accumulator 0 is batch k-1 (carried in), 1 is batch k (starts empty).
      acc = jax.tree.map(lambda a: jnp.stack([a, jnp.zeros_like(a)]),
                         _local((acc_blocks, acc_shared)))
      carry = TickCarry(_local(fwd_buf), _local(bwd_buf), _local(stash), acc,
                        jnp.stack([_local(loss), jnp.zeros((), jnp.float32)]))
      cur = k % 2
      window = (jnp.concatenate([prev_tok, tok]), jnp.concatenate([prev_tgt, tgt]))
      carry = _engine.tick_loop(
          self.fns, plan, versions, *window, carry,
          version_of=lambda i: jnp.where(i >= m, cur, 1 - cur),
          valid_of=lambda i: (i >= m) | (k > 0),
          acc_of=lambda i: (i >= m).astype(jnp.int32),
          slot_of=lambda i: (k * m + i) % ring)
      g_blocks, g_shared, done = self._reduce(_pick(carry.acc[0], 0), _pick(carry.acc[1], 0),
                                              carry.loss[0])
      return (g_blocks, g_shared, done, *_per_device(
          (_pick(carry.acc[0], 1), _pick(carry.acc[1], 1), carry.loss[1], carry.stash,
           carry.fwd_buf, carry.bwd_buf)))

    dev = P(STAGE, DATA)
    dev_tree = lambda tree: jax.tree.map(lambda _: dev, tree)
    fn = self._shard_map(
        body,
        (self._block_specs(blocks_v, (None,)), self._rep_specs(shared_v), dev_tree(acc_blocks),
         dev_tree(acc_shared), dev, dev, dev, dev, P(None, DATA), P(None, DATA), P(None, DATA),
         P(None, DATA), P()),
        (self._block_specs(_pick(blocks_v, 0)), self._rep_specs(_pick(shared_v, 0)), P(),
         dev_tree(acc_blocks), dev_tree(acc_shared), dev, dev, dev, dev))
    (g_blocks, g_shared, loss_done, acc_b, acc_s, loss_part, stash, fwd_buf, bwd_buf) = fn(
        blocks_v, shared_v, acc_blocks, acc_shared, state["loss"], state["stash"],
        state["fwd_buf"], state["bwd_buf"], state["prev_tokens"], state["prev_targets"],
        tokens, targets, k)
    grads = merge_params(g_blocks, g_shared)
    current = _pick(state["versions"], k % 2)
    params, opt_state, finite = self._update(current, state["opt_state"], grads, k > 0)
    versions = jax.tree.map(lambda v, p: v.at[(k + 1) % 2].set(p), state["versions"], params)
    metrics = self._grad_metrics(grads, loss_done, k - 1, finite | (k == 0))
    new_state = {
        "step": k + 1, "versions": versions, "opt_state": opt_state,
        "acc": merge_params(acc_b, acc_s), "loss": loss_part, "stash": stash,
        "fwd_buf": fwd_buf, "bwd_buf": bwd_buf,
        # Copies: the state is donated to the next step, the caller's batch is not.
        "prev_tokens": jnp.copy(tokens), "prev_targets": jnp.copy(targets),
    }
    return new_state, metrics

  def pending_loss(self, state):
    """Loss of the last batch run (batch step-1) at the version it ran on."""
    k = int(state["step"])
    if k == 0:
      return None
    if self._jit_eval is None:
      self._jit_eval = jax.jit(self._eval_fn, out_shardings=self._spec())
    params = _pick(state["versions"], (k - 1) % 2)
    return self._jit_eval(params, state["prev_tokens"], state["prev_targets"])


_CLASSES = {"none": NoPipeline, "gpipe": GPipe, "1f1b": OneFOneB, "2bw": TwoBW,
            "pipedream": PipeDream}


def make_schedule(name: str, fns: StageFns, optimizer: optax.GradientTransformation,
                  mesh: Mesh, num_microbatches: int, **kwargs) -> Schedule:
  """Returns the schedule called `name` on `mesh` (see module docstring)."""
  if name not in _CLASSES:
    raise ValueError(f"unknown schedule '{name}'; choose from {', '.join(SCHEDULE_NAMES)}")
  return _CLASSES[name](fns, optimizer, mesh, num_microbatches, **kwargs)
