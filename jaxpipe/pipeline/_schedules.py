"""Training schedules behind one interface: none, gpipe, 1f1b, 2bw, pipedream, interleaved, zb1.

A `Schedule` owns a mesh, the model's `StageFns` and an optax optimizer. Its
state is a typed pytree (`SyncState`, `FlushedState`, `PipeDreamState`,
`TwoBWState`): the parameters (with their versions where several are alive),
the optimizer state, a step counter, the flushed schedules' stash rings
with `ScheduleOptions.rings_in_state` and, for 2bw, everything in flight between steps. Each
state class names the kind of each of its fields (`KINDS`), and the shardings
`jax.jit` places them with and the specs `shard_map` splits them by are both
derived from those kinds. `step` is one jitted function per schedule;
`eval_loss` a forward-only pass.

Parameters are a dict whose 'blocks' entry is stacked along a leading layer
axis; on a pipeline mesh that axis is sharded over 'stage' (each stage holds
L/S consecutive blocks). Every other entry ('shared': embedding, final norm,
output layer) is split over 'stage' along its vocabulary axis
(`StageFns.vocab_axes`; the vocabulary is padded to a multiple of S with
zeros) or, where it has none, replicated. The optimizer runs after the
pipeline, in the same jit, on these sharded arrays: element-wise rules and
Muon's per-matrix orthogonalisation stay on the stage that owns the weights.
`init` takes and `params` returns the natural (unpadded) parameter tree.

Interleaved 1F1B holds its blocks in a layer order of its own
(`Interleaved`), so that each device's slice of the stacked blocks is its v
chunks; `params` and checkpoint exports give the natural order.

Loss reporting: `step` returns `metrics['loss']`, the mean training loss of
batch `metrics['loss_step']` at the weights that batch ran on. For 2bw a
batch's last microbatches reach the last stage during the next step, so step k
reports batch k-1 (`loss_lag = 1`) and `pending_loss` gives the last batch's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxpipe.pipeline._base import Schedule
from jaxpipe.pipeline._engine import DATA, PHASE, STAGE, Engine, StageFns, TickCarry, acc_dtype
from jaxpipe.pipeline._names import SCHEDULE_NAMES
from jaxpipe.pipeline._options import ScheduleOptions
from jaxpipe.pipeline._states import (FlushedState, InFlight, PipeDreamState, SyncState, Tree,
                                     TwoBWState, local_block, merge_params, per_device,
                                     pick_version, split_params)
from jaxpipe.pipeline._timetable import layer_order, step_plan

__all__ = ["Interleaved", "make_schedule"]


def _full_loss(fns: StageFns):
  def loss(params, tokens, targets):
    blocks, shared = split_params(params)
    x, aux = fns.stage(blocks, fns.embed(shared, tokens))
    return fns.loss(shared, x, targets) + aux
  return loss


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
      return (jax.tree.map(lambda a, b: a + b.astype(a.dtype), g_sum, g), l_sum + loss), None

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, acc_dtype(x)), params)
    (g, loss), _ = lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), (tokens, targets))
    m = tokens.shape[0]
    return jax.tree.map(lambda x: x / m, g), loss / m

  def _step_fn(self, state, tokens, targets):
    at = state.params if self.predict is None else self.predict(state.params, state.opt_state)
    grads, loss = self._grads(at, tokens, targets)
    params, opt_state, finite = self._update(state.params, state.opt_state, grads,
                                             jnp.array(True))
    metrics = self._grad_metrics(grads, loss, state.step, finite)
    return SyncState(state.step + 1, params, opt_state), metrics

  def _eval_fn(self, params, tokens, targets):
    loss_fn = _full_loss(self.fns)
    losses = lax.map(lambda b: loss_fn(params, *b), (tokens, targets))
    return jnp.mean(losses)


class _Pipelined(Schedule):
  """Shared machinery of the pipelined schedules (shard_map programs)."""

  # Whether the state keeps the stash rings from step to step (`FlushedState`).
  keeps_rings = property(lambda self: False)

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.plan = step_plan(self.name, self.num_stages, self.num_microbatches,
                          self.virtual_stages)
    self.engine = Engine(self.fns, self.plan, stash=self.stash,
                         rings_in_state=self.keeps_rings, overlap=self.overlap_sends)

  def _shard_map(self, fn, in_specs, out_specs):
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=True)

  def _shared_local(self, shared: Tree) -> Tree:
    """Abstract per-stage shapes of a (padded) shared tree."""
    def one(x, a):
      shape = list(x.shape)
      if a is not None:
        shape[a] //= self.num_stages
      return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
    return jax.tree.map(one, shared, self.fns.vocab_axes, is_leaf=lambda a: a is None)

  def _act_like(self, shared: Tree, tokens) -> jax.ShapeDtypeStruct:
    """The per-device activation: what the embedding makes of a local microbatch."""
    m, b, t = tokens.shape
    local = jax.ShapeDtypeStruct((b // self.num_data, t), tokens.dtype)
    return jax.eval_shape(self.fns.embed, self._shared_local(shared), local)

  def _reduce(self, g_blocks, g_shared, loss):
    """Sums a step's per-device gradient and loss sums into batch means.

    An expert slice's gradient is whole on the replica that holds it: the
    backward of the token exchange brought every replica's share there.
    """
    with jax.named_scope(PHASE["grad_reduce"]):
      return self._reduce_sums(g_blocks, g_shared, loss)

  def _reduce_sums(self, g_blocks, g_shared, loss):
    n = self.num_microbatches * self.num_data
    g_blocks = jax.tree.map(lambda a, g: (g if a is not None else lax.psum(g, DATA)) / n,
                            self._split_experts(g_blocks), g_blocks,
                            is_leaf=lambda a: a is None)
    g_shared = jax.tree.map(
        lambda g, a: lax.psum(g, DATA if a is not None else (STAGE, DATA)) / n,
        g_shared, self.fns.vocab_axes, is_leaf=lambda a: a is None)
    return g_blocks, g_shared, lax.psum(loss, (STAGE, DATA)) / n

  def _eval_fn(self, params, tokens, targets):
    """Mean loss by GPipe's forward ticks, as a shard_map over the mesh."""
    blocks, shared = split_params(params)
    x_like = self._act_like(shared, tokens)

    def body(blocks, shared, tokens, targets):
      total = self.engine.evaluate(blocks, shared, tokens, targets, x_like)
      return lax.psum(total, (STAGE, DATA)) / (self.num_microbatches * self.num_data)

    specs = split_params(self.param_specs(params))
    fn = self._shard_map(body, (*specs, P(None, DATA), P(None, DATA)), P())
    return fn(blocks, shared, tokens, targets)

  def _flushed_grads(self, blocks, shared, tokens, targets, *, pick=None, rings=None):
    """One flushed step of the plan (gpipe, 1f1b, zb1, interleaved, pipedream): mean grads and loss.

    `blocks` and `shared` are parameter trees; with `pick`, rings with a
    leading version axis instead, and `pick(stage)` gives (the version of
    the stage's blocks, the shared versions the plan's indices choose from).
    Without it the one version is used as it is (no copy). With `rings`
    (`FlushedState.rings`) the ticks use those stash rings and the rings
    they leave come back as a third result; without, zeroed ones.
    """
    lead = () if pick is None else (None,)
    one = (lambda t: t) if pick is None else (lambda t: pick_version(t, 0))
    x_like = self._act_like(one(shared), tokens)

    def body(blocks, shared, tokens, targets, *kept):
      if pick is None:
        blocks_v, shared_v = (blocks,), (shared,)
      else:
        b, sh = pick(lax.axis_index(STAGE))
        blocks_v, shared_v = (pick_version(blocks, b),), tuple(pick_version(shared, i) for i in sh)
      carry = self.engine.empty_carry(blocks_v[0], shared_v[0], x_like,
                                      local_block(kept[0]) if kept else None)
      carry = self.engine.run(blocks_v, shared_v, tokens, targets, carry)
      (g_blocks, g_shared), = carry.accs
      out = self._reduce(g_blocks, g_shared, carry.losses[0])
      return (*out, per_device((carry.stash, carry.wstash))) if kept else out

    specs = self.param_specs(merge_params(blocks, shared), lead=lead)
    plain = self.param_specs(merge_params(one(blocks), one(shared)))
    batch = P(None, DATA)
    kept = () if rings is None else (rings,)
    fn = self._shard_map(body, (*split_params(specs), batch, batch) + (P(STAGE, DATA),) * len(kept),
                         (*split_params(plain), P()) + (P(STAGE, DATA),) * len(kept))
    g_blocks, g_shared, loss, *new_rings = fn(blocks, shared, tokens, targets, *kept)
    return (merge_params(g_blocks, g_shared), loss, *new_rings)

  def _empty_rings(self, params, batch_shape, token_dtype) -> Tree:
    """`FlushedState.rings` for padded `params`: every device's stash rings, zeroed."""
    blocks, shared = split_params(params)
    x_like = self._act_like(shared, jax.ShapeDtypeStruct(tuple(batch_shape), token_dtype))

    def empty(blocks, shared):
      return per_device(self.engine.empty_rings(blocks, x_like))

    fn = self._shard_map(empty, split_params(self.param_specs(params)), P(STAGE, DATA))
    return fn(blocks, shared)


class _OneVersion(_Pipelined):
  """gpipe, 1f1b, zb1 and interleaved: one weight version, a flush every step.

  With `ScheduleOptions.rings_in_state`, the stash rings stay in the state
  (`FlushedState`) from step to step; otherwise the state is a `SyncState`
  and a step makes its rings.
  """

  keeps_rings = property(lambda self: self.rings_in_state)

  def _init_fn(self, params, *, batch_shape, token_dtype):
    params = self._pad(params)
    return self._state(jnp.zeros((), jnp.int32), params, self.opt.init(params),
                       batch_shape, token_dtype)

  def _state(self, step, params, opt_state, batch_shape, token_dtype):
    if not self.keeps_rings:
      return SyncState(step, params, opt_state)
    return FlushedState(step, params, opt_state,
                        self._empty_rings(params, batch_shape, token_dtype))

  def _step_fn(self, state, tokens, targets):
    if not self.keeps_rings:
      grads, loss = self._flushed_grads(*split_params(state.params), tokens, targets)
    else:
      grads, loss, rings = self._flushed_grads(*split_params(state.params), tokens, targets,
                                               rings=state.rings)
    params, opt_state, finite = self._update(state.params, state.opt_state, grads,
                                             jnp.array(True))
    metrics = self._grad_metrics(grads, loss, state.step, finite)
    new = state._replace(step=state.step + 1, params=params, opt_state=opt_state)
    return (new._replace(rings=rings) if self.keeps_rings else new), metrics

  def saved_fields(self, state):
    """Everything but the stash rings (where the state has them): they hold
    nothing a later step reads."""
    keep = super().saved_fields(state)
    if not self.keeps_rings:
      return keep
    return keep._replace(rings=jax.tree.map(lambda _: False, keep.rings))


class GPipe(_OneVersion):
  """GPipe: M+S-1 forward ticks, then M+S-1 backward ticks in reverse order.

  With `stash='inputs'` the backward recomputes each stage from its stashed
  input (GPipe's rematerialisation); with 'residuals' the forward keeps the
  residuals of all M microbatches.
  """

  name = "gpipe"


class OneFOneB(_OneVersion):
  """1F1B (PipeDream-Flush): S-1 forward-only ticks, M ticks of both, S-1 backward-only."""

  name = "1f1b"


class ZeroBubbleH1(_OneVersion):
  """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): 1F1B with the backward split.

  Each stage's backward runs as B (the input's gradient, which the previous
  stage waits for) and W (the weights', which can wait), on 1F1B's
  M+2(S-1) ticks: F and B where 1F1B runs them, W moved into ticks in which
  the stage would idle or wait for a slower one (`_zbh1`). Under F = B = W
  a step of 3M+2S-3 units for M >= S: ZB-H1's 3M+S-1 at S=2. The split
  recomputes nothing (`_split`); W's stash holds, per weight use, its input
  and its output cotangent, for up to S+1 microbatches. One weight version,
  a flush every step: it trains exactly as `none` on the whole batch.
  """

  name = "zb1"


class Interleaved(_OneVersion):
  """Interleaved 1F1B (Megatron-LM's virtual pipeline stages): v chunks per device.

  The L blocks are split into S*v chunks of L/(S v) consecutive blocks;
  device s holds chunks s, s+S, ..., s+(v-1)S, so a microbatch goes round the
  ring of stages v times (stage S-1's output of chunk j is stage 0's input
  of chunk j+1). The ticks are Megatron's order in lockstep
  (`_builders._interleaved`), which needs M to be a multiple of S: a step
  of v(M+S)+S-2 ticks of 1/v of a stage's work each, a bubble of
  (S-1)/(vM+S-1) instead of 1f1b's (S-1)/(M+S-1), at the cost of v times the
  stage-to-stage transfers and a stash of up to (v+1)S-1 chunk inputs (or
  chunk residuals). One weight version, a flush every step: it trains
  exactly as `none` on the whole batch.

  Parameter layout. The state holds the stacked blocks in the layer order
  `layer_order(L, S, v)` (device-major: device s's chunks in order), so
  that sharding them over 'stage' like every schedule's gives each device a
  contiguous slice holding its chunks, and the optimizer state follows the
  same order (every optimizer here treats the stacked layer axis as a batch
  of independent matrices, so the order changes nothing it computes).
  `params` returns the natural order; `newest` and `eval_loss` use the
  state's. A checkpoint holds the state as it is (this order, for the S it
  was written with): `jaxpipe.runs.load_params` (export, generation) puts
  it back in the natural order from the run's config, and `resume` onto
  another stage count moves the blocks and their optimizer state from the
  saved order to this mesh's (`pipeline.virtual_stages` itself must match,
  as every key outside the layout keys must). The cost: one permutation of
  the blocks at `init` and at such a resume, none per step.
  """

  name = "interleaved"

  def _order(self, num_layers: int, num_stages: int) -> np.ndarray:
    return layer_order(num_layers, num_stages, self.virtual_stages)

  def _take_blocks(self, params: Tree, index: np.ndarray) -> Tree:
    blocks, shared = split_params(params)
    return merge_params(jax.tree.map(lambda x: jnp.take(x, index, axis=0), blocks), shared)

  def _init_fn(self, params, *, batch_shape, token_dtype):
    params = self._pad(params)
    num_layers = jax.tree.leaves(params["blocks"])[0].shape[0]
    params = self._take_blocks(params, self._order(num_layers, self.num_stages))
    return self._state(jnp.zeros((), jnp.int32), params, self.opt.init(params), batch_shape,
                       token_dtype)

  def params(self, state) -> Tree:
    """The newest weights in the natural layer order and shapes."""
    def natural(p):
      num_layers = jax.tree.leaves(p["blocks"])[0].shape[0]
      return self._unpad(self._take_blocks(
          p, np.argsort(self._order(num_layers, self.num_stages))))
    return jax.jit(natural)(self.newest(state))

  def _reorder(self, state: SyncState, index: np.ndarray) -> SyncState:
    """`state` with the stacked layer axis of the blocks, and of the optimizer
    state that follows them, taken in the order `index`."""
    num_layers = len(index)
    blocks, shared = split_params(state.params)
    marks = merge_params(jax.tree.map(lambda x: x.ndim, blocks),
                         jax.tree.map(lambda x: -1, shared))
    masked = lambda x: isinstance(x, optax.MaskedNode)

    def take(x, ndim):
      if masked(x) or ndim < 0 or x.size == 0:
        return x
      lead = x.ndim - ndim  # the delay's slots and the like stand before the layer axis
      if lead < 0 or x.shape[lead] != num_layers:
        return x
      return jnp.take(x, index, axis=lead)

    opt_state = optax.tree_map_params(self.opt, take, state.opt_state, marks,
                                      transform_non_params=lambda x: x, is_leaf=masked)
    return state._replace(params=self._take_blocks(state.params, index), opt_state=opt_state)

  def resume(self, restored, fresh, *, guarded=False, saved_stages=None):
    """Fits the vocabulary padding and, from another stage count, the layer order.

    A checkpoint written with S' stages holds the blocks (and their optimizer
    state) in `layer_order(L, S', v)`; here they are taken into this mesh's
    order, the same weights in another place.
    """
    state = super().resume(restored, fresh, guarded=guarded)
    if saved_stages is None or saved_stages == self.num_stages:
      return state
    num_layers = jax.tree.leaves(state.params["blocks"])[0].shape[0]
    index = np.argsort(self._order(num_layers, saved_stages))[
        self._order(num_layers, self.num_stages)]
    return jax.jit(lambda st: self._reorder(st, index),
                   out_shardings=self.state_shardings(fresh))(state)


class PipeDream(_Pipelined):
  """Original PipeDream's weight stashing: stage s runs batch k on w_s[k-(S-1-s)].

  The batch-granular model of docs/schedules.md: every stage keeps its last
  S weight versions (a ring indexed by update count mod S); batch k's forward
  and backward on stage s use version max(0, k - d_s), d_s = S-1-s, and the
  gradient updates the newest version. The embedding belongs to stage 0 and
  the head to the last stage, so their slices on every stage run at those
  stages' versions. Executed with 1F1B's flushed ticks, so its numerics are
  PipeDream's but its time per step is 1F1B's: it exists for the staleness
  comparison, not for speed.
  """

  name = "pipedream"

  def _init_fn(self, params, *, batch_shape, token_dtype):
    del batch_shape, token_dtype
    params = self._pad(params)
    s = self.num_stages
    versions = jax.tree.map(lambda x: jnp.broadcast_to(x, (s,) + x.shape), params)
    return PipeDreamState(jnp.zeros((), jnp.int32), versions, self.opt.init(params))

  def _params_of(self, state) -> Tree:
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), state.versions)

  def check_relayout(self, saved_stages, saved_data):
    """A changed stage count is refused: it changes how many versions exist and every delay."""
    del saved_data
    if saved_stages != self.num_stages:
      raise ValueError(
          f"pipedream keeps the last S weight versions and runs stage s S-1-s updates behind, "
          f"so a run saved with pipeline.stages={saved_stages} cannot continue with "
          f"{self.num_stages} (its delays would change mid-run); mesh.data can change")

  def newest(self, state) -> Tree:
    return pick_version(state.versions, state.step % self.num_stages)

  def _step_fn(self, state, tokens, targets):
    k, s_ = state.step, self.num_stages
    blocks_v, shared_v = split_params(state.versions)
    lagged = lambda d: jnp.maximum(0, k - d) % s_
    grads, loss = self._flushed_grads(
        blocks_v, shared_v, tokens, targets,
        pick=lambda s: (lagged(s_ - 1 - s), (lagged(s_ - 1), k % s_)))
    newest = pick_version(state.versions, k % s_)
    params, opt_state, finite = self._update(newest, state.opt_state, grads, jnp.array(True))
    ring = jax.tree.map(lambda v, p: v.at[(k + 1) % s_].set(p), state.versions, params)
    metrics = self._grad_metrics(grads, loss, k, finite)
    return PipeDreamState(k + 1, ring, opt_state), metrics


class TwoBW(_Pipelined):
  """PipeDream-2BW: no flush, two weight versions, a constant one-step delay.

  Step k runs M ticks; at tick i stage s runs the forward of window
  microbatch M+i-s and the backward of M+i-2(S-1)+s (below M: batch k-1).
  Microbatches of batch k use v[k] (`cur`), those of k-1 use v[k-1]
  (`prev`). At the end of step k the gradient of batch k-1 is complete, and
  v[k+1] = v[k] + U(G[k-1]) becomes `cur` while v[k] becomes `prev`. Step 0
  has no finished batch: v[1] = v[0] and the optimizer is not called. The
  stash, the in-flight activations and cotangents, batch k's partial
  gradient and loss, and batch k's tokens stay in the state for step k+1;
  a checkpoint keeps only the tokens, and `resume` recomputes the rest.

  Final weights: after N steps the newest version is v[N], which equals N
  steps of one-device training with `jaxpipe.optim.delay(opt, 1)`; the last
  batch's gradient is in flight in both.
  """

  name = "2bw"
  loss_lag = 1
  donation_order = ("step", "cur", "prev", "opt_state", "inflight")

  def _init_fn(self, params, *, batch_shape, token_dtype):
    """Two copies of v[0], an empty pipeline, zero batches in the batch slots."""
    m, b, t = batch_shape
    params = self._pad(params)
    blocks, shared = split_params(params)
    batch = jax.ShapeDtypeStruct((m, b, t), token_dtype)
    x_like = self._act_like(shared, batch)

    def empty(blocks, shared):
      c = self.engine.empty_carry(blocks, shared, x_like)
      (acc,) = c.accs[:1]
      return per_device((c.fwd_buf, c.bwd_buf, c.stash, acc, c.losses[0]))

    fn = self._shard_map(empty, split_params(self.param_specs(params)), P(STAGE, DATA))
    fwd_buf, bwd_buf, stash, acc, loss = fn(blocks, shared)
    inflight = InFlight(fwd_buf, bwd_buf, stash, acc, loss, jnp.zeros((m, b, t), token_dtype),
                        jnp.zeros((m, b, t), token_dtype))
    return TwoBWState(jnp.zeros((), jnp.int32), params, params, self.opt.init(params), inflight)

  def _params_of(self, state) -> Tree:
    return state.cur

  def newest(self, state) -> Tree:
    return state.cur

  def _window(self, state, tokens, targets, k, has_history):
    """Runs step k's ticks on `state`: (gradient of batch k-1, its loss, batch k's InFlight).

    Without history the microbatches of batch k-1 are skipped (step 0 has
    none), but the stash slots are those of step k.
    """
    m = self.num_microbatches
    specs = self._field_specs(state, state.cur)

    def body(prev, cur, f, tok, tgt, k, has_history):
      (prev_b, prev_s), (cur_b, cur_s) = split_params(prev), split_params(cur)
      acc_prev = local_block(f.acc)
      carry = TickCarry(local_block(f.fwd_buf), local_block(f.bwd_buf), local_block(f.stash),
                        (acc_prev, jax.tree.map(jnp.zeros_like, acc_prev)),
                        jnp.stack([local_block(f.loss), jnp.zeros_like(local_block(f.loss))]))
      window = (jnp.concatenate([f.tokens, tok]), jnp.concatenate([f.targets, tgt]))
      carry = self.engine.run((prev_b, cur_b), (prev_s, cur_s), *window, carry,
                              has_history=has_history, slot_base=(k * m) % self.plan.slots)
      g_blocks, g_shared, done = self._reduce(*carry.accs[0], carry.losses[0])
      # Batch k rides along as the next step's batch k-1 (a copy: the state is
      # donated to the next step, the caller's batch is not).
      inflight = InFlight(*per_device((carry.fwd_buf, carry.bwd_buf, carry.stash,
                                        carry.accs[1], carry.losses[1])), tok, tgt)
      return merge_params(g_blocks, g_shared), done, inflight

    batch = P(None, DATA)
    fn = self._shard_map(body, (specs.prev, specs.cur, specs.inflight, batch, batch, P(), P()),
                         (specs.cur, P(), specs.inflight))
    return fn(state.prev, state.cur, state.inflight, tokens, targets, k, has_history)

  def _step_fn(self, state, tokens, targets):
    k = state.step
    grads, loss_done, inflight = self._window(state, tokens, targets, k, k > 0)
    params, opt_state, finite = self._update(state.cur, state.opt_state, grads, k > 0)
    metrics = self._grad_metrics(grads, loss_done, k - 1, finite | (k == 0))
    return TwoBWState(k + 1, state.cur, params, opt_state, inflight), metrics

  def saved_fields(self, state):
    """Everything but the per-device in-flight buffers, which `resume` recomputes.

    They are most of a checkpoint (the stash ring alone is M activations or
    their residuals per device), and a function of what is saved: batch
    k-1's tokens and the weights v[k-1] (`prev`) it ran on.
    """
    keep = super().saved_fields(state)
    device = {n: jax.tree.map(lambda _: False, getattr(keep.inflight, n))
              for n, kind in InFlight.KINDS.items() if kind == "device"}
    return keep._replace(inflight=keep.inflight._replace(**device))

  def resume(self, restored, fresh, *, guarded=False, saved_stages=None):
    """Re-pads the weights and recomputes batch k-1's in-flight state on this mesh.

    At the start of step k the pipeline holds what step k-1 did of batch
    k-1, all of it at v[k-1] (`prev`): its first microbatches' stashes,
    activations and cotangents in transit, partial gradient and loss. They
    are made again by running step k-1 itself, the same compiled program
    the training steps run (no compilation of its own), on a state whose
    `cur` is v[k-1] and whose batch k-1 is the saved one; its other half,
    batch k-2's last microbatches, runs on zeros and is thrown away with the
    update it makes. Batch k-1's work reads nothing of batch k-2's, so on
    the same mesh everything step k reads comes out bit for bit as the
    uninterrupted run had it; stash slots that no backward reads again keep
    other values. On another mesh it is the same state in the new layout
    (equal up to the order of reductions). The cost is one step's compute.
    """
    state = super().resume(restored, fresh, saved_stages=saved_stages)
    k = int(state.step)
    if k == 0:
      return state   # nothing in flight before the first step
    f = state.inflight
    # The rerun consumes its state (it is donated): fresh buffers, and v[k-1]
    # itself, which comes back unchanged as the result's `prev`. Empty
    # optimizer leaves (SOAP's) are the restored state's own: new ones here.
    spare = lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding) if x.size == 0 else x
    rerun = TwoBWState(jax.device_put(np.int32(k - 1), fresh.step.sharding), fresh.prev,
                       state.prev, jax.tree.map(spare, fresh.opt_state), fresh.inflight)
    go = jax.device_put(np.asarray(True), self.replicated()) if guarded else None
    out, _ = self.step(rerun, f.tokens, f.targets, go)
    return state._replace(prev=out.prev, inflight=out.inflight)

  def pending_loss(self, state):
    """Loss of the last batch run (batch step-1) at the version it ran on."""
    if int(state.step) == 0:
      return None
    return self._evaluate(state.prev, state.inflight.tokens, state.inflight.targets)


_CLASSES = {"none": NoPipeline, "gpipe": GPipe, "1f1b": OneFOneB, "2bw": TwoBW,
            "pipedream": PipeDream, "interleaved": Interleaved, "zb1": ZeroBubbleH1}


def make_schedule(name: str, fns: StageFns, optimizer: optax.GradientTransformation,
                  mesh: Mesh, num_microbatches: int, options: ScheduleOptions | None = None,
                  **kwargs) -> Schedule:
  """Returns the schedule called `name` on `mesh` (see module docstring).

  `options` (`ScheduleOptions`, its defaults where None) holds every other
  choice: stash, vocab_parallel, shard_optimizer, expert_parallel, predict,
  virtual_stages, overlap_sends. Keyword arguments replace single fields of
  it (`stash='residuals'`); one that names no field raises TypeError naming
  it. The schedule keeps the options it was made with as `options`.
  """
  options = dataclasses.replace(options or ScheduleOptions(), **kwargs)
  if name not in _CLASSES:
    raise ValueError(f"unknown schedule '{name}'; choose from {', '.join(SCHEDULE_NAMES)}")
  # The classes take the options as `Schedule.__init__`'s keyword arguments,
  # one per field (tests/test_options.py checks that the two agree).
  sched = _CLASSES[name](fns, optimizer, mesh, num_microbatches, **options.as_kwargs())
  sched.options = options
  return sched
