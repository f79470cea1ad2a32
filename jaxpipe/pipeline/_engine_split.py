"""ZB-H1's backward in two halves (`plan.split_backward`, schedule zb1): B and W, apart.

The backward runs as B (the input's gradient) and W (the weights'), apart,
through `SplitStage`, which splits the stage's pullback without recomputing
anything. A tick runs, per stage, at most one F, at most one B and the W's
of the plan's row (`fwd`, `bwd`, `wgt`; 1F1B's ticks with W moved,
`_zbh1`), each under a cond on the stage's own row, in the phase order
forward, head, B, W, sends; every tick is of one kind, so the step is one
loop. B reads the forward's stash and writes what W needs into a second ring
(`wstash`); each W reads its entry and adds the weights' gradient into the
accumulator. The last stage's F and B of a microbatch share a tick, as in
1f1b: the head runs with the F (under a cond every stage takes alike) and B
takes its cotangent. A value received from a neighbour stays in its buffer
until the stage's F (B) of that microbatch, which the plan runs before the
neighbour sends the next (`StepPlan.inbox_slots`). Lockstep costs: a tick
lasts as long as its busiest stage, and carries the code of F, B and W
behind conds.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxpipe.pipeline._engine_types import (StageFns, StepContext, TickCarry, make_varying,
                                            only_if)
from jaxpipe.pipeline._plan import StepPlan
from jaxpipe.pipeline._split import SplitStage

Tree = Any

__all__ = ["SplitBackward", "WGT_ROWS"]

# Plan arrays with one entry per (tick, stage) that the tick loops read with
# the backward split into B and W: W's microbatches, B's and W's slots.
WGT_ROWS = ("wgt", "bwd_wslot", "wgt_slot")


class SplitBackward:
  """One stage's B and W (inside `shard_map`); see the module docstring."""

  rows = WGT_ROWS

  def __init__(self, fns: StageFns, plan: StepPlan, stash: Optional[str]):
    """B and W of `fns.stage` for a zb1 `plan`; `stash` as the engine's ('inputs', 'residuals').

    Raises ValueError where the plan needs more than the engine keeps: one
    weight version, one chunk, one received value of each kind at a time.
    """
    if plan.num_versions != 1 or plan.virtual_stages != 1:
      raise ValueError(f"{plan.schedule}: a split backward runs one weight version, one chunk")
    if plan.inbox_slots != 1:
      raise ValueError(f"{plan.schedule}: each stage must hold at most one received input "
                       f"and one cotangent at a time, the plan needs {plan.inbox_slots}")
    self.fns, self.plan, self.stash_mode = fns, plan, stash
    self.stage = SplitStage(fns.stage)
    # B without a microbatch writes W's stash into a scratch slot past its ring.
    self.trash = plan.w_slots

  # --- the rings ---------------------------------------------------------------

  def stash_entry(self, blocks: Tree, x: jax.Array) -> dict:
    """The forward's stash entry with `stash='residuals'`: what B reads (zeros; shapes only)."""
    kept, _ = self.stage.w_stash_shapes(blocks, x)
    return {"res": tuple(jnp.zeros(r.shape, r.dtype) for r in kept)}

  def w_entry(self, blocks: Tree, x: jax.Array) -> Tree:
    """W's stash entry for this stage's shapes.

    Traced inside the mesh, before any tick: B's plan is cached by shape
    there, and W finds it by its stash's (`SplitStage`).
    """
    return self.stage.w_stash_shapes(make_varying(self.fns.prepare(blocks)), x)[1]

  def empty_ring(self, blocks: Tree, x: jax.Array) -> Tree:
    """W's ring, zeroed: `w_slots` slots and the scratch slot, per leaf of `w_entry`."""
    return jax.tree.map(lambda v: jnp.zeros((self.plan.w_slots + 1,) + v.shape, v.dtype),
                        self.w_entry(blocks, x))

  # --- the phases ----------------------------------------------------------------

  def forward(self, blocks: Tree, x_in: jax.Array) -> tuple:
    """F with `stash='residuals'`: (output, aux loss, the stash entry of B's residuals)."""
    y, aux, kept = self.stage.forward(blocks, x_in)
    return y.astype(x_in.dtype), aux, {"res": make_varying(kept)}

  def backward_input(self, ctx: StepContext, c: TickCarry, row: dict,
                     g_head: Optional[jax.Array]) -> tuple[TickCarry, jax.Array]:
    """B on this stage: (the carry with W's ring and the losses updated, cotangent to send).

    B pulls the cotangent back to the stage input only (`SplitStage`; with
    `stash='inputs'` it recomputes the forward once, and W does not) and
    keeps what W needs in W's ring, at the slot the plan names; the weights'
    gradient is W's. The last stage's cotangent is the head's, of this
    tick (its F and B of a microbatch share a tick, as in 1F1B). B adds the
    forward's auxiliary loss, as a backward does. `c` holds the tick's
    stash, written by its forward.
    """
    s, split = ctx.stage, self.stage
    b = row["bwd"][s]
    b_ok = ctx.valid(b)
    slot = ctx.slot(b, row["bwd_slot"][s])
    blocks = ctx.blocks[0]

    def run():
      entry = jax.tree.map(lambda ring: lax.dynamic_index_in_dim(ring, slot, 0, keepdims=False),
                           c.stash)
      top = jnp.zeros_like(c.bwd_buf) if g_head is None else g_head.astype(c.bwd_buf.dtype)
      g_y = jnp.where(ctx.is_last, top, c.bwd_buf)
      g_aux = make_varying(jnp.ones((), entry["aux"].dtype))
      if self.stash_mode == "residuals":
        g_x, w = split.backward_input(blocks, entry["res"], g_y, g_aux)
      else:
        g_x, w = split.backward_input_from_inputs(blocks, entry["x"], g_y, g_aux)
      return make_varying((g_x.astype(c.bwd_buf.dtype), w, entry["aux"]))

    # An empty slot runs no B and computes nothing (other stages may be busy).
    g_x, w, aux = only_if(b_ok, run)
    # Written outside the cond, as the forward's stash is (`Engine._stash`).
    wslot = jnp.where(b >= 0, row["bwd_wslot"][s], self.trash)
    wstash = jax.tree.map(
        lambda r, v: lax.dynamic_update_index_in_dim(r, v.astype(r.dtype), wslot, 0),
        c.wstash, w)
    losses = c.losses.at[0].add(jnp.where(b_ok, aux, 0.0))
    return c._replace(wstash=wstash, losses=losses), g_x

  def backward_weights(self, ctx: StepContext, c: TickCarry, row: dict) -> TickCarry:
    """W's on this stage: the carry with the weights' gradients added to its accumulator.

    Each W reads what B kept for it (W's ring, at the slot the plan names)
    and runs the weight-gradient half of the backward alone, under a cond on
    this stage's own row: an empty entry adds nothing and computes nothing.
    A cell may hold several W's (the drain's, up to J): a `lax.scan` over the
    plan's J entries keeps one copy of W's program in the tick.
    """
    s, accs, wstash = ctx.stage, c.accs, c.wstash
    blocks = ctx.blocks[0]

    def one(acc, item):
      w, slot = item
      slot = jnp.where(w >= 0, slot, self.trash)

      def run():
        entry = jax.tree.map(
            lambda ring: lax.dynamic_index_in_dim(ring, slot, 0, keepdims=False), wstash)
        g = self.stage.backward_weights(blocks, entry)
        return make_varying(jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, g))

      return lax.cond(ctx.valid(w), run, lambda: acc), None

    ws, slots = row["wgt"][s], row["wgt_slot"][s]
    if ws.shape[0] == 1:
      acc, _ = one(accs[0][0], (ws[0], slots[0]))
    else:
      acc, _ = lax.scan(one, accs[0][0], (ws, slots))
    return c._replace(accs=((acc, accs[0][1]),) + tuple(accs[1:]))

  def keep_received(self, ctx: StepContext, row: dict, c: TickCarry,
                    received: tuple) -> tuple[jax.Array, jax.Array]:
    """The buffers with what arrived this tick (`received`), else what they held (`c`'s).

    A stage may run its F (B) of a microbatch some ticks after its
    neighbour sent the input (cotangent); the value waits in the buffer,
    which only a neighbour's next F (B) replaces (`StepPlan.inbox_slots`
    checks that it is read before).
    """
    fwd_buf, bwd_buf = received
    s, last = ctx.stage, self.plan.num_stages - 1
    sent_f = (s > 0) & (row["fwd"][jnp.maximum(s - 1, 0)] >= 0)
    sent_b = (s < last) & (row["bwd"][jnp.minimum(s + 1, last)] >= 0)
    return jnp.where(sent_f, fwd_buf, c.fwd_buf), jnp.where(sent_b, bwd_buf, c.bwd_buf)
