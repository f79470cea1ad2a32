"""The training step's per-stage program, inside `jax.shard_map` over a ('stage', 'data') mesh.

`Engine.run` executes a `StepPlan` tick by tick. Each run of ticks of one
kind (forward-only, backward-only, both; the same weight version on every
stage or not) is its own `lax.scan` whose body contains only that kind's
work, so a tick with no backward anywhere costs a forward and nothing more.
Before the first tick, stage 0's inputs of every microbatch it starts in
the step are embedded at once (`_embedding`). Within a tick, in this order
(each step's inputs depend on the previous one, so every stage runs the same
phase at the same time), each phase under its own `jax.named_scope`
(`PHASE`):

1. forward: stage s runs its blocks on its input (stage 0: its embedded
   microbatch) and stashes what its backward needs: with
   `stash='residuals'` the residuals of `jax.vjp` (the stage's weights left
   out, they are in the state), with `stash='inputs'` only the stage input,
   recomputed in the backward;
2. head: the loss of the last stage's output and its gradient, on the last
   stage or, with a split vocabulary, a slice on every stage (`_phases`);
3. backward: stage s pulls back the cotangent from stage s+1 (on the last
   stage, the head's) through its stash and adds the weight gradient into the
   accumulator the plan names;
4. `ppermute`s carry the activation to stage s+1 and the cotangent to s-1.

After the last tick, stage 0's input cotangents of the step go into the
embedding's gradient, once for all (`_embedding`).

The forward, the head and the transfers are `Phases` (`_phases`), which the
evaluation runs too (`_evaluate`, `Engine.evaluate`). Two schedules add to
the tick: zb1 splits the backward into B and W (`_engine_split`),
interleaved runs v chunks of blocks per stage round a ring of the stages
(`_chunks`).

Parameters arrive per stage: `blocks` is this stage's slice of the stacked
blocks; `shared` (embedding, final norm, output layer) holds this stage's
vocabulary slice of every leaf that `StageFns.vocab_axes` marks and a copy of
the others. Everything here sees per-device (local) shapes. Gradients of the
vocabulary slices never leave their stage; those of the replicated leaves and
the blocks are summed over the mesh once per step, by the schedule.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe._vma import varying_axes
from jaxpipe.pipeline._chunks import chunk_of
from jaxpipe.pipeline._engine_types import (PHASE, TICKS, StageFns, StepContext, TickCarry,
                                            TickLoop, acc_dtype, expert_exchange, make_varying,
                                            no_experts, residual_shapes, vjp_layout)
from jaxpipe.pipeline._evaluate import Evaluation
from jaxpipe.pipeline._names import DATA, STAGE, STASH_MODES
from jaxpipe.pipeline._phases import Phases
from jaxpipe.pipeline._plan import StepPlan, TickKind
from jaxpipe.pipeline._split import rebuild_vjp

Tree = Any

__all__ = ["StageFns", "TickCarry", "Engine", "PHASE", "make_varying", "varying_axes",
           "residual_shapes", "expert_exchange", "no_experts", "acc_dtype", "chunk_of",
           "DATA", "STAGE"]

# Plan arrays with one entry per (tick, stage), fed to the tick loops (with
# v > 1 chunks and with a split backward, `Chunks.rows` and `SplitBackward.rows` too).
_ROWS = ("fwd", "bwd", "fwd_version", "bwd_version", "acc", "fwd_slot", "bwd_slot")


class Engine(Phases):
  """Runs a `StepPlan`'s training step on one stage (inside `shard_map`).

  `Phases`' forward, head and transfers, with the stash, the backward and
  the gradients added; see the module docstring.
  """

  def __init__(self, fns: StageFns, plan: StepPlan, *, stash: str = "inputs",
               solo_stage: Optional[int] = None, rings_in_state: bool = False,
               overlap: bool = False):
    """Args:
      fns, plan: the model's stage functions and the plan to execute. Where
        `fns.vocab_axes` marks no leaf, the shared parameters are whole on
        every stage: the embedding is looked up on stage 0 and the head runs
        on the last stage alone, with no collective (`pipeline.head`).
      stash: 'inputs' or 'residuals' (see the module docstring).
      solo_stage: run stage `solo_stage`'s program alone, on a mesh whose
        'stage' axis has one device (the planner's cost of one stage's tick:
        the stage's position is a constant, sends are dropped).
      rings_in_state: whether the stash rings come in with the step's state
        and go out with it (`FlushedState.rings`) rather than being made
        afresh each step; a tick without forwards then still writes them
        (`_touch_trash`).
      overlap: each transfer placed where the tick's block compute can hide
        it, for devices whose transfers run beside their kernels (GPUs):
        the activation is sent as soon as the forward made it (it travels
        while the backward computes), and the cotangent a backward makes is
        sent at the start of the next tick with a backward (it travels
        while that tick's forward computes; `TickCarry.bwd_buf` then holds
        it until then). With a split backward (zb1) the cotangent is sent
        as soon as B made it, beside W. The values every tick computes are
        the same either way. Off, the tick ends with its transfers, at S=2
        one exchange for both directions: fewer collectives, each a
        barrier of every stage on a CPU.
    """
    if stash not in STASH_MODES:
      raise ValueError(f"stash must be one of {STASH_MODES}, got {stash!r}")
    last, top = plan.num_stages - 1, plan.virtual_stages - 1
    heads = (plan.bwd[:, last] >= 0) & (plan.bwd_chunk[:, last] == top)
    if not plan.head_stash and not np.all(
        ~heads | ((plan.fwd[:, last] == plan.bwd[:, last]) & (plan.fwd_chunk[:, last] == top))):
      raise ValueError(f"{plan.schedule}: the last stage's backwards must share a tick with "
                       "its forwards, or the plan must stash the head's cotangent")
    super().__init__(fns, plan, stash=stash, solo_stage=solo_stage, overlap=overlap)
    self.rings_in_state = rings_in_state

  def traffic(self, act_bytes: int, tokens: int) -> dict[str, float]:
    """Bytes one device sends in a steady tick, by kind, as this engine's program moves them.

    `act_bytes` is one microbatch's activation on one device, `tokens` its
    token count. Point to point: the activation forward and the cotangent
    back (one exchange at S=2, two sends on a middle stage). With a split
    vocabulary, collectives over 'stage': the head's broadcast of the last
    stage's output and the sum of its cotangent (two all-reduces, 2(S-1)/S
    of the data each in a ring), the softmax statistics' all-gather (3
    float32 per token, to S-1 peers), and the embedding's lookup and
    gradient, once per step over all of stage 0's microbatches, per tick
    on average. The data-parallel gradient reduction is once per step and
    not counted here.
    """
    s_ = self.num_stages
    steady = [t for t in range(self.plan.num_ticks)
              if (self.plan.fwd[t] >= 0).all() or (self.plan.bwd[t] >= 0).all()
              or self.plan.split_backward]  # zb1's every tick sends (its kinds mix)
    if s_ == 1:
      return {"point_to_point": 0.0, "head": 0.0, "embedding": 0.0}
    # Interleaved's ring: every stage sends an activation and a cotangent.
    p2p = act_bytes if s_ == 2 and self.chunks.num == 1 else 2 * act_bytes
    ring = 2 * (s_ - 1) / s_
    head = (2 * ring * act_bytes + (s_ - 1) * 12 * tokens) if self.split else 0.0
    e = self.step_embedding
    embed = (ring * act_bytes * (len(e.forwards) + len(e.backwards)) / max(len(steady), 1)
             if self.split else 0.0)
    return {"point_to_point": float(p2p), "head": float(head), "embedding": float(embed)}

  # --- the carry ---------------------------------------------------------------

  def stash_entry(self, blocks: Tree, x: jax.Array) -> dict:
    """One slot's stash for a stage input `x` (zeros; shapes only matter).

    `blocks` are the stage's; with v > 1 chunks a slot holds one chunk's
    input or residuals.
    """
    aux = jnp.zeros((), jnp.float32)
    if self.stash_mode == "residuals" and self.split_backward is not None:
      entry = {**self.split_backward.stash_entry(blocks, x), "aux": aux}
    elif self.stash_mode == "residuals":
      _, kept = vjp_layout(self.fns.stage, self.chunks.of(blocks, 0), x)
      entry = {"res": tuple(jnp.zeros(r.shape, r.dtype) for r in kept), "aux": aux}
    else:
      entry = {"x": jnp.zeros_like(x), "aux": aux}
    if self.plan.head_stash:
      entry["dh"] = jnp.zeros_like(x)
    return entry

  def empty_carry(self, blocks: Tree, shared: Tree, x_like: jax.ShapeDtypeStruct,
                  rings: Optional[tuple] = None) -> TickCarry:
    """A carry with nothing in flight, typed as varying, for this stage's shapes.

    `rings`: (stash, wstash) to use as they are instead of zeroed ones (a
    flushed step's rings kept from the step before; `empty_rings` makes
    the first).
    """
    x = make_varying(jnp.zeros(x_like.shape, x_like.dtype))
    f32 = lambda v: jnp.zeros(v.shape, acc_dtype(v))
    acc = (jax.tree.map(f32, blocks), jax.tree.map(f32, shared))
    if rings is None:
      stash, wstash = self.empty_rings(blocks, x_like)
    else:
      stash, wstash = rings
      if self.split_backward is not None:
        # For its trace, which `empty_rings` makes otherwise.
        self.split_backward.w_entry(blocks, x)
    return make_varying(TickCarry(x, x, stash, (acc,) * self.plan.num_accumulators,
                                  jnp.zeros((self.plan.num_accumulators,), jnp.float32),
                                  wstash))

  def empty_rings(self, blocks: Tree, x_like: jax.ShapeDtypeStruct) -> tuple:
    """(stash, wstash): the stash rings of this stage's shapes, zeroed (wstash None but for zb1)."""
    x = make_varying(jnp.zeros(x_like.shape, x_like.dtype))
    entry = self.stash_entry(make_varying(self.fns.prepare(blocks)), x)
    stash = jax.tree.map(lambda v: jnp.zeros((self.num_slots,) + v.shape, v.dtype), entry)
    wstash = (None if self.split_backward is None
              else self.split_backward.empty_ring(blocks, x))
    return make_varying((stash, wstash))

  # --- one step ----------------------------------------------------------------

  def run(self, blocks_versions: tuple, shared_versions: tuple, tokens: jax.Array,
          targets: jax.Array, carry: TickCarry, *, has_history=True, slot_base=0) -> TickCarry:
    """Runs every tick of the plan on this stage; returns the final carry.

    Args:
      blocks_versions: the stage's block weights, one tree per plan version.
      shared_versions: the stage's shared parameters, one tree per version.
      tokens, targets: [window, b, t] the microbatches the plan's window
        indices name.
      carry: the incoming carry (`empty_carry` for a flushed step).
      has_history: whether window indices below `plan.history` exist (False
        in 2bw's first step).
      slot_base: the stash slot of this step's first microbatch.
    """
    ctx = self.context(blocks_versions, shared_versions, tokens, targets, carry.fwd_buf,
                       has_history=has_history, slot_base=slot_base)
    plan = self.plan
    rows = _ROWS + self.chunks.rows + (() if self.split_backward is None
                                       else self.split_backward.rows)
    grads_x0 = []
    for kind, t0, t1 in plan.segments():
      # One loop per run of ticks of one kind, each body holding only that
      # kind's work. (A single loop switching on the kind would keep one
      # working set instead of one per loop, but XLA's CPU runtime then
      # serialises the stages: a conditional holding collectives blocks.)
      xs = {k: jnp.asarray(getattr(plan, k)[t0:t1]) for k in rows}
      xs["embed_pos"] = jnp.asarray(self.step_embedding.embed_pos[t0:t1])
      loop = TickLoop(kind, bool((plan.fwd[t0:t1] < 0).any()),
                      bool((plan.bwd[t0:t1] < 0).any()))

      def body(c, row, loop=loop):
        return self._tick(loop, ctx, c, row)

      # Named by the work of its ticks (ticks_f, ticks_b, ticks_fb, zb1's
      # ticks_fbw), so that a compiled program's loops say which they are
      # (`jaxpipe.gpu` finds the steady ticks' transfers by it).
      work = zip("fbw", (kind.fwd, kind.bwd, kind.wgt))
      with jax.named_scope(TICKS + "".join(p for p, on in work if on)):
        carry, g_x0 = lax.scan(body, carry, xs)
      # Stage 0's input cotangent of each tick (zeros elsewhere), for the
      # embedding's gradient after the last tick.
      grads_x0.append(g_x0 if kind.bwd else None)
    return self.embedding.add_grads(ctx, carry, grads_x0)

  def _tick(self, loop: TickLoop, ctx: StepContext, c: TickCarry,
            row: dict) -> tuple[TickCarry, Optional[jax.Array]]:
    """One tick of one kind on this stage: (the carry after it, stage 0's input cotangent).

    The phases in order: forward and stash (its input embedded on stage 0),
    head, backward, transfers. Within the tick `c` carries the stash, the
    accumulators and the losses as each phase leaves them, and the buffers
    as they came in.
    """
    kind = loop.kind
    send_f, send_b, g_head, g_x0 = jnp.zeros_like(c.fwd_buf), jnp.zeros_like(c.bwd_buf), None, None
    to_next, to_prev = self._sends()
    # Overlap: the cotangent the last backward made goes out first thing, and
    # travels while the forward computes (the backward below reads it).
    rotate = self.overlap and kind.bwd and self.split_backward is None
    if rotate:
      with jax.named_scope(PHASE["send"]):
        c = c._replace(bwd_buf=lax.ppermute(c.bwd_buf, STAGE, to_prev))
    fwd_buf = bwd_buf = None
    if kind.fwd:
      c, send_f, g_head = self._forward_phase(loop, ctx, c, row)
      if self.overlap:  # it travels while the backward computes
        with jax.named_scope(PHASE["send"]):
          fwd_buf = lax.ppermute(send_f, STAGE, to_next)
    elif self.rings_in_state:
      c = c._replace(stash=self._touch_trash(c.stash))
    if kind.bwd:
      with jax.named_scope(PHASE["backward"]):
        if self.split_backward is not None:
          c, send_b = self.split_backward.backward_input(ctx, c, row, g_head)
        else:
          c, send_b = self._backward(loop, ctx, c, row, g_head)
        g_x0 = jnp.where(ctx.is_first, send_b, jnp.zeros_like(send_b))
      if self.overlap and not rotate:  # zb1: B's cotangent travels while W computes
        with jax.named_scope(PHASE["send"]):
          bwd_buf = lax.ppermute(send_b, STAGE, to_prev)
    if kind.wgt:
      with jax.named_scope(PHASE["weight_grad"]):
        c = self.split_backward.backward_weights(ctx, c, row)
    if self.solo_stage is not None:
      return c._replace(fwd_buf=send_f, bwd_buf=send_b), g_x0
    with jax.named_scope(PHASE["send"]):
      if not self.overlap:
        fwd_buf, bwd_buf = self._exchange(kind, ctx, (c.fwd_buf, c.bwd_buf), (send_f, send_b))
      else:  # sent above; a direction this tick has no work in keeps its buffer
        if fwd_buf is None:
          fwd_buf = c.fwd_buf
        if bwd_buf is None:  # rotated: this tick's cotangent waits for the next
          bwd_buf = send_b if rotate else c.bwd_buf
      if self.split_backward is not None:
        fwd_buf, bwd_buf = self.split_backward.keep_received(ctx, row, c, (fwd_buf, bwd_buf))
    return c._replace(fwd_buf=fwd_buf, bwd_buf=bwd_buf), g_x0

  def _forward_phase(self, loop: TickLoop, ctx: StepContext, c: TickCarry, row: dict):
    """The tick's forward, head and stash write: (carry, activation to send, head's cotangent).

    The head's cotangent is None where the tick has no head.
    """
    kind, g_head = loop.kind, None
    y, f_ok, entry = self._forward(loop, ctx, c.fwd_buf, row)
    if kind.head_version is not None:
      with jax.named_scope(PHASE["head"]):
        g_head, c = self._head_tick(kind, ctx, row, y, c)
        if self.plan.head_stash:
          entry = {**entry, "dh": make_varying(g_head).astype(y.dtype)}
    with jax.named_scope(PHASE["forward"]):
      c = c._replace(stash=self._stash(ctx, row, c.stash, entry, c.fwd_buf))
    send_f = jnp.where(f_ok, y, jnp.zeros_like(y)).astype(c.fwd_buf.dtype)
    return c, send_f, g_head

  def _head_tick(self, kind: TickKind, ctx: StepContext, row: dict, y: jax.Array,
                 c: TickCarry) -> tuple[jax.Array, TickCarry]:
    """The head of the last stage's forward microbatch: (its cotangent, the carry with
    its shared gradient and loss added)."""
    (loss_h, g_sh, g_head), last_ok = self._head(kind, ctx, row, y, self._loss_and_grads)
    a, accs = kind.head_acc, list(c.accs)
    accs[a] = (accs[a][0], jax.tree.map(
        lambda acc, g: acc + jnp.where(last_ok, g, jnp.zeros_like(g)).astype(acc.dtype),
        accs[a][1], g_sh))
    losses = c.losses.at[a].add(jnp.where(last_ok & ctx.is_last, loss_h, 0.0))
    return g_head, c._replace(accs=tuple(accs), losses=losses)

  def _touch_trash(self, stash: dict) -> dict:
    """The stash with one element of its scratch slot zeroed (for a tick without forwards).

    Where the rings come in with the state and go out with it
    (`rings_in_state`), ticks that only read them kept XLA from updating
    them in place: it copied each ring on the way out (the benchmark's
    gpipe step at S=2, M=8: 81 MiB of temporaries; 32 MiB with this write,
    76 MiB with rings made afresh each step).
    """
    if self.trash >= self.num_slots:
      return stash
    return jax.tree.map(
        lambda r: lax.dynamic_update_slice(r, jnp.zeros((1,) * r.ndim, r.dtype),
                                           (self.trash,) + (0,) * (r.ndim - 1)), stash)

  def _stash(self, ctx: StepContext, row: dict, stash: dict, entry: dict, like: jax.Array) -> dict:
    """The stash with the tick's forward entry written into its slot."""
    if self.plan.head_stash and "dh" not in entry:
      entry = {**entry, "dh": jnp.zeros_like(like)}
    # Written before the backward reads: on the last stage the backward is
    # this very microbatch. Outside any cond: XLA copies a buffer that a
    # conditional reads and the loop body then writes.
    s = ctx.stage
    slot_f = ctx.slot(row["fwd"][s], row["fwd_slot"][s])
    return jax.tree.map(
        lambda r, v: lax.dynamic_update_index_in_dim(r, v.astype(r.dtype), slot_f, 0),
        stash, entry)

  def _backward(self, loop: TickLoop, ctx: StepContext, c: TickCarry, row: dict,
                g_head: Optional[jax.Array]) -> tuple[TickCarry, jax.Array]:
    """The tick's backward on this stage: (the carry with its gradient and aux loss added,
    the input cotangent to send). `c` holds the tick's stash, written by its forward."""
    kind, s = loop.kind, ctx.stage
    b = row["bwd"][s]
    b_ok = ctx.valid(b)
    slot = ctx.slot(b, row["bwd_slot"][s])
    zeros = jnp.zeros_like
    if self.plan.head_stash:
      top = None
    else:  # the head ran this tick, or the last stage has no backward in it
      top = zeros(c.bwd_buf) if g_head is None else g_head.astype(c.bwd_buf.dtype)
    # Accumulators this tick's backwards may add into (the plan's, or all).
    targets = [a for a in range(self.plan.num_accumulators) if kind.bwd_version in (None, a)]
    block_accs = tuple(c.accs[a][0] for a in targets)
    chunk = self.chunks.bwd(row, s)
    tops = self.chunks.tops(ctx.is_last, chunk)

    def backward_and_add(valid=True):
      entry = jax.tree.map(
          lambda ring: lax.dynamic_index_in_dim(ring, slot, 0, keepdims=False), c.stash)
      g_top = (entry["dh"] if top is None else top).astype(c.bwd_buf.dtype)
      g_y = jnp.where(tops, g_top, c.bwd_buf)
      g_aux = make_varying(jnp.ones((), entry["aux"].dtype))
      g_blocks, g_x = self._with_version(ctx.blocks, kind.bwd_version, row["bwd_version"][s],
                                         self._pullback(ctx, entry, chunk, (g_y, g_aux)))
      new = []
      for a, acc in zip(targets, block_accs):
        mine = self._mine(kind, row, s, valid, a)
        new.append(jax.tree.map(
            lambda t, g, mine=mine: self.chunks.add(t, jnp.where(mine, g, zeros(g)), chunk),
            acc, g_blocks))
      g_x = jnp.where(valid, g_x, zeros(g_x))
      return tuple(new), g_x.astype(c.bwd_buf.dtype), entry["aux"]

    # As for the forward: an empty slot runs no backward and adds nothing
    # (the accumulators are updated inside the branch, in place).
    if loop.bwd_gap:
      block_accs, g_x, aux_b = lax.cond(
          b_ok, backward_and_add,
          lambda: (block_accs, zeros(c.bwd_buf), make_varying(jnp.zeros((), jnp.float32))))
    else:  # every slot is filled, but for the previous batch's in 2bw's first step
      block_accs, g_x, aux_b = backward_and_add(b_ok)
    accs, losses = list(c.accs), c.losses
    for a, acc in zip(targets, block_accs):
      accs[a] = (acc, accs[a][1])
      losses = losses.at[a].add(jnp.where(self._mine(kind, row, s, b_ok, a), aux_b, 0.0))
    return c._replace(accs=tuple(accs), losses=losses), g_x

  @staticmethod
  def _mine(kind: TickKind, row: dict, stage: jax.Array, valid, acc: int):
    """Whether this stage's backward adds into accumulator `acc` (and its slot is filled)."""
    return valid if kind.bwd_version is not None else valid & (row["acc"][stage] == acc)

  def _pullback(self, ctx: StepContext, entry: dict, chunk, cotangents: tuple):
    """blocks -> (weight gradient, input cotangent): the stage's pullback of `cotangents`
    (output, aux loss) from its stash `entry`, for `_with_version` to call."""
    def backward(blocks):
      blocks = self.chunks.of(blocks, chunk)
      if self.stash_mode == "residuals":
        pull = rebuild_vjp(ctx.layout, entry["res"], jax.tree.leaves(blocks))
      else:
        _, pull = jax.vjp(self.fns.stage, blocks, entry["x"])
      return pull(cotangents)
    return backward

  # --- evaluation ----------------------------------------------------------------

  def evaluate(self, blocks: Tree, shared: Tree, tokens: jax.Array, targets: jax.Array,
               x_like: jax.ShapeDtypeStruct) -> jax.Array:
    """The summed loss of [M, b, t] microbatches by forward ticks alone (no gradients).

    The forward, head and transfers of this engine's step, on the ticks of
    `Evaluation` (`_evaluate`); summing over the mesh gives the batch total.
    """
    evaluation = Evaluation(self.fns, self.num_stages, tokens.shape[0], self.chunks.num,
                            solo_stage=self.solo_stage)
    return evaluation.loss(blocks, shared, tokens, targets, x_like)
