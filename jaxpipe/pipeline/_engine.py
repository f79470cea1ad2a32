"""The per-stage program that runs inside `jax.shard_map` over a ('stage', 'data') mesh.

`Engine.run` executes a `StepPlan` tick by tick. Each run of ticks of one
kind (forward-only, backward-only, both; the same weight version on every
stage or not) is its own `lax.scan` whose body contains only that kind's
work, so a tick with no backward anywhere costs a forward and nothing more.
Before the first tick, stage 0's inputs of every microbatch it starts in
the step are embedded at once (with a split vocabulary each stage looks up
its rows and one `psum` over `stage` assembles them). Within a tick, in this
order (each step's inputs depend on the previous one, so every stage runs
the same phase at the same time), each phase under its own `jax.named_scope`
(`PHASE`):

1. forward: stage s runs its blocks on its input (stage 0: its embedded
   microbatch) and stashes what its backward needs: with
   `stash='residuals'` the residuals of `jax.vjp` (the stage's weights left
   out, they are in the state), with `stash='inputs'` only the stage input,
   recomputed in the backward;
2. head: with a split vocabulary the last stage's output is broadcast
   (`psum`) and every stage computes the logits of its vocabulary slice and
   their share of the loss and its gradient (`_vocab.cross_entropy`); the
   gradient with respect to the hidden state comes back summed over stages.
   With the embedding and head whole on every stage (`pipeline.head`), the
   last stage computes them alone and nothing crosses stages;
3. backward: stage s pulls back the cotangent from stage s+1 (on the last
   stage, the head's) through its stash and adds the weight gradient into the
   accumulator the plan names;
4. `ppermute`s carry the activation to stage s+1 and the cotangent to s-1.

After the last tick, stage 0's input cotangents of the step go to every
stage at once (one `psum`, with a split vocabulary) and each scatters them
into its rows of the embedding's gradient.

ZB-H1 (`plan.split_backward`, schedule zb1): the backward runs as B (the
input's gradient) and W (the weights'), apart, through `SplitStage`, which
splits the stage's pullback without recomputing anything. A tick runs, per
stage, at most one F, at most one B and the W's of the plan's row (`fwd`,
`bwd`, `wgt`; 1F1B's ticks with W moved, `_zbh1`), each under a cond on the
stage's own row, in the phase order forward, head, B, W, sends; every tick
is of one kind, so the step is one loop. B reads the forward's stash and
writes what W needs into a second ring (`wstash`); each W reads its entry
and adds the weights' gradient into the accumulator. The last stage's F
and B of a microbatch share a tick, as in 1f1b: the head runs with the F
(under a cond every stage takes alike) and B takes its cotangent. A value
received from a neighbour stays in its buffer until the stage's F (B) of
that microbatch, which the plan runs before the neighbour sends the next
(`StepPlan.inbox_slots`). Lockstep costs: a tick lasts as long as its
busiest stage, and carries the code of F, B and W behind conds.

`Engine.evaluate` runs the forward ticks alone (GPipe's; with v chunks, the
forward halves of interleaved's ticks, around the ring v times) with the
head's loss only.

Interleaved 1F1B (`plan.virtual_stages` v > 1): `blocks` holds the stage's v
chunks of L/(S v) blocks one after another (chunk j is the pipeline's
virtual stage j*S + s; `layer_order` in `_timetable`). A forward or
backward runs the chunk the plan names. In the lockstep order stage s's
chunk changes every S ticks, offset by s, so no loop of ticks has one chunk
on every stage and the choice is made per tick: the chunk's blocks are
sliced out of the stage's (`lax.dynamic_slice`, a copy of 1/v of the
stage's weights per use, which a `lax.switch` over the chunks would trade
for v copies of the stage's program in every tick; `chunk_of` takes a
static chunk as a static slice) and its weight gradient is added into that
chunk's rows of the accumulator in place. Stage S-1's output goes round the
ring to stage 0 (and stage 0's input cotangent to stage S-1), so every
stage both sends and receives in both directions. The embedding feeds
stage 0's forwards of chunk 0 and its gradient takes their backwards; the
head runs in the ticks in which the last stage's forward is of chunk v-1
(under a `lax.cond` on the tick's chunk, which every stage reads alike, so
the steady state stays one loop).

Parameters arrive per stage: `blocks` is this stage's slice of the stacked
blocks; `shared` (embedding, final norm, output layer) holds this stage's
vocabulary slice of every leaf that `StageFns.vocab_axes` marks and a copy of
the others. Everything here sees per-device (local) shapes. Gradients of the
vocabulary slices never leave their stage; those of the replicated leaves and
the blocks are summed over the mesh once per step, by the schedule.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe._vma import varying_axes
from jaxpipe.pipeline import _vocab
from jaxpipe.pipeline._names import DATA, STAGE, STASH_MODES
from jaxpipe.pipeline._split import SplitStage, VjpLayout, forward_with_vjp, rebuild_vjp
from jaxpipe.pipeline._timetable import StepPlan, TickKind

Tree = Any

__all__ = ["StageFns", "TickCarry", "Engine", "PHASE", "make_varying", "varying_axes",
           "residual_shapes", "expert_exchange", "no_experts", "acc_dtype", "chunk_of"]

AXES = (STAGE, DATA)
# The phases of a tick, each traced under its own `jax.named_scope`, so that a
# profile (XLA's CPU trace, Nsight Systems, XProf) names the work of every
# operation; `jaxpipe.account` reads them back. The schedules add the
# once-per-step gradient reduction and the optimizer update.
# zb1's W (the weights' gradient, split from the backward) is a phase of its
# own, so that an account tells B from W.
PHASE = {p: f"pipe_{p}" for p in ("embed", "forward", "head", "backward", "weight_grad",
                                    "embed_grad", "send", "grad_reduce", "optimizer")}
# The prefix of each tick loop's named scope, then the work its ticks hold.
TICKS = "ticks_"
# Plan arrays with one entry per (tick, stage), fed to the tick loops.
_ROWS = ("fwd", "bwd", "fwd_version", "bwd_version", "acc", "fwd_slot", "bwd_slot")
# And with v > 1 chunks per stage, which chunk each forward and backward runs.
_CHUNK_ROWS = ("fwd_chunk", "bwd_chunk")
# And with the backward split into B and W (zb1): W's microbatch, its slots.
_WGT_ROWS = ("wgt", "bwd_wslot", "wgt_slot")


def chunk_of(blocks: Tree, chunk, num_chunks: int) -> Tree:
  """Chunk `chunk` of a stage's stacked blocks (v = num_chunks chunks, one after another).

  A static chunk is a static slice; a traced one a `lax.dynamic_slice` (a
  copy of the chunk's 1/v of the stage's weights).
  """
  if num_chunks == 1:
    return blocks

  def one(w):
    size = w.shape[0] // num_chunks
    if isinstance(chunk, (int, np.integer)):
      return lax.slice_in_dim(w, int(chunk) * size, (int(chunk) + 1) * size, axis=0)
    return lax.dynamic_slice_in_dim(w, chunk * size, size, axis=0)
  return jax.tree.map(one, blocks)


def _add_to_chunk(acc: jax.Array, grad: jax.Array, chunk, num_chunks: int) -> jax.Array:
  """`acc` with `grad` (one chunk's rows) added into chunk `chunk`'s rows, in place."""
  if num_chunks == 1:
    return acc + grad.astype(acc.dtype)
  size = acc.shape[0] // num_chunks
  start = chunk * size
  rows = lax.dynamic_slice_in_dim(acc, start, size, axis=0)
  return lax.dynamic_update_slice_in_dim(acc, rows + grad.astype(acc.dtype), start, axis=0)


def _same(blocks: Tree) -> Tree:
  return blocks


def no_experts(blocks: Tree) -> Tree:
  """The `expert_axes` of a dense model: None (no expert axis) for every leaf of `blocks`."""
  return jax.tree.map(lambda _: None, blocks)


def acc_dtype(x) -> jnp.dtype:
  """The dtype `x`'s gradient is summed in over microbatches: float32 for floats, else x's."""
  # Whatever the weights' dtype: a bfloat16 running sum drops the late microbatches' low bits.
  return jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype


class StageFns(NamedTuple):
  """The model as the pipeline sees it.

  Attributes:
    embed: (shared, tokens [b, t]) -> activations [b, t, ...]. Must be a row
      lookup: row v of every leaf `vocab_axes` marks gives token v (the
      pipeline hands each stage its rows and local ids).
    stage: (blocks, x) -> (x, aux): applies a stacked slice of blocks; aux is
      a scalar auxiliary loss (0 for dense models) added to the objective.
    logits: (shared, x) -> float32 logits [b, t, V'] over the vocabulary
      entries `shared` holds (all of them on one device, a slice on a stage).
    vocab_size: the true vocabulary size.
    vocab_axes: a tree like `shared` giving, per leaf, its vocabulary axis
      or None (a leaf every stage keeps whole).
    prepare: blocks -> the blocks as `stage` computes with them (the
      compute-dtype copy of the matrices), applied once per step; gradients
      come back in its dtypes and are accumulated in the parameters'.
    loss_chunk: tokens whose logits the head computes at once (the backward
      recomputes each chunk's); 0 = a whole microbatch's at once.
    expert_axes: blocks -> a tree like them giving, per leaf, its expert axis
      (counted in the stacked leaf) or None. With expert parallelism the
      pipeline splits those axes over 'data', and `stage`, given a slice of
      the experts, must send tokens to them itself (`expert_exchange`).
  """
  embed: Callable[[Tree, jax.Array], jax.Array]
  stage: Callable[[Tree, jax.Array], tuple[jax.Array, jax.Array]]
  logits: Callable[[Tree, jax.Array], jax.Array]
  vocab_size: int
  vocab_axes: Tree
  prepare: Callable[[Tree], Tree] = _same
  loss_chunk: int = 0
  expert_axes: Callable[[Tree], Tree] = no_experts

  def loss(self, shared: Tree, x: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of `x` over the whole vocabulary (one device, no mesh axis).

    The one-device reference's head (schedule `none`): `jaxpipe.xent`'s
    cross-entropy, the function a model's own loss calls with these very
    arguments (jaxpipe's `Model.head_loss` does), and the one the pipelines'
    head calls over a split vocabulary. A target outside the vocabulary
    makes the loss and its gradient NaN.
    """
    return _vocab.chunked_cross_entropy(self.logits, shared, x, targets, offset=0,
                                        vocab_size=self.vocab_size, axis=None,
                                        chunk=self.loss_chunk)


def expert_exchange(x: jax.Array) -> jax.Array:
  """All-to-all over 'data' of an [n, ...] array (n = the data degree), inside `shard_map`.

  Index j goes to replica j; the result's index j is what replica j sent.
  This is how a model's Mixture-of-Experts layer sends token slots to the
  replicas that hold their experts when the pipeline splits the experts over
  'data' (`StageFns.expert_axes`), and brings the outputs back.
  """
  return lax.all_to_all(x, DATA, 0, 0)


def make_varying(tree: Tree) -> Tree:
  """Types every leaf as varying over both mesh axes.

  Differentiating a replicated input inside `shard_map` makes JAX sum its
  cotangent over the replicas at every use (a psum per tick); as a varying
  value its gradient stays local, and the schedule sums it once per step. A
  fresh scan carry must also be typed as what the loop body produces.
  """
  def one(x):
    missing = tuple(a for a in AXES if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(one, tree)


def _vjp_layout(fn, blocks: Tree, x: jax.Array, mark=None) -> tuple[VjpLayout, tuple]:
  """The layout and the residuals' shapes, from an abstract trace (no work is emitted)."""
  box = []

  def trace(blocks, x):
    _, _, kept, layout = forward_with_vjp(fn, blocks, x, mark or make_varying)
    box.append(layout)
    return kept

  shapes = jax.eval_shape(trace, blocks, x)
  return box[0], shapes


def _only_if(pred: jax.Array, compute: Callable[[], Any]) -> Any:
  """compute() when `pred` (this device's), else zeros of its shapes: nothing is computed."""
  shapes = jax.eval_shape(compute)

  def skip():
    return make_varying(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))

  return lax.cond(pred, compute, skip)


def residual_shapes(fn, blocks: Tree, x: jax.Array) -> tuple:
  """Shapes of what `stash='residuals'` keeps per microbatch for a stage `fn` (outside a mesh)."""
  return _vjp_layout(fn, blocks, x, mark=lambda leaf: leaf)[1]


class TickCarry(NamedTuple):
  """What flows from tick to tick (and, in 2bw, from step to step), per device.

  Attributes:
    fwd_buf: [b, t, ...] activation received from stage s-1 last tick.
    bwd_buf: [b, t, ...] cotangent received from stage s+1 last tick; with
      `Engine(overlap=True)` (and no split backward), the cotangent this
      stage computed in its last backward, which the next tick with a
      backward sends to stage s-1 first thing.
    stash: by slot: 'x' [R, b, t, ...] stage inputs or 'res' (residual
      rings), 'aux' [R] the forward's auxiliary loss, and for gpipe 'dh'
      [R, b, t, ...] the head's cotangent of the last stage's output.
    accs: per accumulator, (blocks, shared) gradient sums.
    losses: [A] loss sums (cross-entropy on the last stage plus this
      stage's auxiliary losses), one per accumulator.
    wstash: with the backward split (zb1), W's stash by slot (what B keeps
      for W, `SplitStage`), [w_slots + 1, ...] per leaf; else None.
  """
  fwd_buf: jax.Array
  bwd_buf: jax.Array
  stash: dict
  accs: tuple
  losses: jax.Array
  wstash: Any = None


class _Ctx(NamedTuple):
  """What every tick of one step reads (traced values and the stage's position).

  `x0` holds the embedded inputs of every microbatch stage 0 starts this
  step ([n, b, t, ...], `_StepEmbedding.forwards` order), looked up once per
  step; a tick's `row['embed_pos']` picks its one.
  """
  stage: jax.Array
  is_first: jax.Array
  is_last: jax.Array
  offset: jax.Array
  blocks: tuple
  shared: tuple
  tokens: jax.Array
  targets: jax.Array
  has_history: jax.Array
  slot_base: jax.Array
  layout: Optional[VjpLayout]
  x0: Optional[jax.Array]


class _StepEmbedding(NamedTuple):
  """Which microbatches stage 0 embeds and pulls back in a step, read off the plan.

  The embedding's lookup and its gradient are done once per step for all of
  them, not per tick: with the vocabulary split over the stages each is a
  collective, and one per step is a barrier per step instead of two per tick.

  Attributes:
    forwards: window indices of stage 0's forwards, in tick order.
    version: the shared version they are embedded with (one per step).
    embed_pos: int32 [T]: each tick's position in `forwards` (0 where none).
    backwards: window indices of stage 0's backwards, in tick order.
    grad_ticks: the ticks those backwards run in.
    grad_accs: the accumulator each backward's embedding gradient goes to.
  """
  forwards: np.ndarray
  version: Optional[int]
  embed_pos: np.ndarray
  backwards: np.ndarray
  grad_ticks: np.ndarray
  grad_accs: np.ndarray

  @classmethod
  def of(cls, plan: StepPlan) -> "_StepEmbedding":
    """The step's embedding work, from the plan's stage-0 columns (forwards and
    backwards of chunk 0: with v > 1 chunks the others take and give the ring's)."""
    fwd_ticks = np.flatnonzero((plan.fwd[:, 0] >= 0) & (plan.fwd_chunk[:, 0] == 0))
    versions = {int(v) for v in plan.embed_version[fwd_ticks]}
    if len(versions) > 1:
      raise ValueError(f"{plan.schedule}: stage 0 embeds with several shared versions in one "
                       f"step ({sorted(versions)}); the engine embeds a step's microbatches at once")
    pos = np.zeros(plan.num_ticks, np.int32)
    pos[fwd_ticks] = np.arange(len(fwd_ticks), dtype=np.int32)
    grad_ticks = np.flatnonzero((plan.bwd[:, 0] >= 0) & (plan.bwd_chunk[:, 0] == 0))
    return cls(plan.fwd[fwd_ticks, 0].astype(np.int32), versions.pop() if versions else None,
               pos, plan.bwd[grad_ticks, 0].astype(np.int32), grad_ticks.astype(np.int32),
               plan.embed_acc[grad_ticks].astype(np.int32))


def vocab_split(vocab_axes: Tree) -> bool:
  """Whether a StageFns' shared leaves are split over 'stage' by vocabulary (else replicated)."""
  return any(a is not None for a in jax.tree.leaves(vocab_axes, is_leaf=lambda a: a is None))


class Engine:
  """Runs a `StepPlan` on one stage (inside `shard_map`); see the module docstring."""

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
    self.fns, self.plan, self.stash_mode = fns, plan, stash
    self.solo_stage, self.rings_in_state = solo_stage, rings_in_state
    self.overlap = overlap and solo_stage is None and plan.num_stages > 1
    self.num_stages = plan.num_stages
    self.chunks = plan.virtual_stages
    self.split = vocab_split(fns.vocab_axes)
    self.step_embedding = _StepEmbedding.of(plan)
    # Forwards the plan leaves empty write into a scratch slot past the ring.
    self.trash = plan.slots
    self.num_slots = plan.slots + int((plan.fwd < 0).any())
    # zb1: B and W of one stage's backward without recomputation (`_split`);
    # B without a microbatch writes W's stash into a scratch slot past its ring.
    self.split_stage = None
    if plan.split_backward:
      if plan.num_versions != 1 or self.chunks != 1:
        raise ValueError(f"{plan.schedule}: a split backward runs one weight version, one chunk")
      if plan.inbox_slots != 1:
        raise ValueError(f"{plan.schedule}: each stage must hold at most one received input "
                         f"and one cotangent at a time, the plan needs {plan.inbox_slots}")
      self.split_stage = SplitStage(fns.stage)
      self.w_trash = plan.w_slots

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
    p2p = act_bytes if s_ == 2 and self.chunks == 1 else 2 * act_bytes
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
    if self.stash_mode == "residuals" and self.split_stage is not None:
      kept, _ = self.split_stage.w_stash_shapes(blocks, x)
      entry = {"res": tuple(jnp.zeros(r.shape, r.dtype) for r in kept), "aux": aux}
    elif self.stash_mode == "residuals":
      _, kept = _vjp_layout(self.fns.stage, chunk_of(blocks, 0, self.chunks), x)
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
      self._w_entry(blocks, x)  # for its trace (which `empty_rings` makes otherwise)
    return make_varying(TickCarry(x, x, stash, (acc,) * self.plan.num_accumulators,
                                  jnp.zeros((self.plan.num_accumulators,), jnp.float32),
                                  wstash))

  def empty_rings(self, blocks: Tree, x_like: jax.ShapeDtypeStruct) -> tuple:
    """(stash, wstash): the stash rings of this stage's shapes, zeroed (wstash None but for zb1)."""
    x = make_varying(jnp.zeros(x_like.shape, x_like.dtype))
    entry = self.stash_entry(make_varying(self.fns.prepare(blocks)), x)
    stash = jax.tree.map(lambda v: jnp.zeros((self.num_slots,) + v.shape, v.dtype), entry)
    w_entry = self._w_entry(blocks, x)
    wstash = None if w_entry is None else jax.tree.map(
        lambda v: jnp.zeros((self.plan.w_slots + 1,) + v.shape, v.dtype), w_entry)
    return make_varying((stash, wstash))

  def _w_entry(self, blocks: Tree, x: jax.Array) -> Optional[Tree]:
    """zb1's W stash entry for this stage's shapes; None without a split backward.

    Traced inside the mesh, before any tick: B's plan is cached by shape
    there, and W finds it by its stash's (`SplitStage`).
    """
    if self.split_stage is None:
      return None
    return self.split_stage.w_stash_shapes(make_varying(self.fns.prepare(blocks)), x)[1]

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
    s = self._stage_index()
    blocks = tuple(make_varying(self.fns.prepare(b)) for b in blocks_versions)
    shared = tuple(make_varying(v) for v in shared_versions)
    layout = None
    if self.stash_mode == "residuals":
      layout, _ = _vjp_layout(self.fns.stage, chunk_of(blocks[0], 0, self.chunks),
                              carry.fwd_buf)
    offset = s * self._local_vocab(shared[0]) if self.split else jnp.int32(0)
    ctx = _Ctx(stage=s, is_first=s == 0, is_last=s == self.num_stages - 1, offset=offset,
               blocks=blocks, shared=shared, tokens=tokens, targets=targets,
               has_history=jnp.asarray(has_history), slot_base=jnp.asarray(slot_base),
               layout=layout, x0=None)
    ctx = ctx._replace(x0=self._embed_step(ctx, carry.fwd_buf.dtype))
    plan = self.plan
    grads_x0 = []
    for kind, t0, t1 in plan.segments():
      # One loop per run of ticks of one kind, each body holding only that
      # kind's work. (A single loop switching on the kind would keep one
      # working set instead of one per loop, but XLA's CPU runtime then
      # serialises the stages: a conditional holding collectives blocks.)
      xs = {k: jnp.asarray(getattr(plan, k)[t0:t1])
            for k in _ROWS + (_CHUNK_ROWS if self.chunks > 1 else ())
            + (_WGT_ROWS if self.split_stage is not None else ())}
      xs["embed_pos"] = jnp.asarray(self.step_embedding.embed_pos[t0:t1])
      # Where every stage has work in every tick of the run (2bw's steady
      # state), no cond guards it: a cond costs the CPU runtime some overlap.
      gaps = (bool((plan.fwd[t0:t1] < 0).any()), bool((plan.bwd[t0:t1] < 0).any()))

      def body(c, row, kind=kind, gaps=gaps):
        return self._tick(kind, ctx, c, row, gaps)

      # Named by the work of its ticks (ticks_f, ticks_b, ticks_fb, zb1's
      # ticks_fbw), so that a compiled program's loops say which they are
      # (`jaxpipe.gpu` finds the steady ticks' transfers by it).
      work = zip("fbw", (kind.fwd, kind.bwd, kind.wgt))
      with jax.named_scope(TICKS + "".join(p for p, on in work if on)):
        carry, g_x0 = lax.scan(body, carry, xs)
      # Stage 0's input cotangent of each tick (zeros elsewhere), for the
      # embedding's gradient after the last tick.
      grads_x0.append(g_x0 if kind.bwd else None)
    return self._embed_grad_step(ctx, carry, grads_x0)

  def _tick(self, kind: TickKind, ctx: _Ctx, c: TickCarry, row: dict,
            gaps: tuple[bool, bool] = (True, True)) -> tuple[TickCarry, Optional[jax.Array]]:
    """One tick of one kind on this stage: (the carry after it, stage 0's input cotangent).

    The phases in order: forward and stash (its input embedded on stage 0),
    head, backward, transfers. `gaps`: whether some forward (backward) slot of
    these ticks is empty; its work is then guarded by a cond, so that an
    empty slot computes nothing.
    """
    accs, losses, stash = list(c.accs), c.losses, c.stash
    send_f, send_b, g_head, g_x0 = jnp.zeros_like(c.fwd_buf), jnp.zeros_like(c.bwd_buf), None, None
    to_next, to_prev = self._sends()
    # Overlap: the cotangent the last backward made goes out first thing, and
    # travels while the forward computes (the backward below reads it).
    rotate = self.overlap and kind.bwd and self.split_stage is None
    if rotate:
      with jax.named_scope(PHASE["send"]):
        c = c._replace(bwd_buf=lax.ppermute(c.bwd_buf, STAGE, to_prev))
    fwd_buf = bwd_buf = None
    if kind.fwd:
      y, f_ok, entry = self._forward(kind, ctx, c, row, gaps[0])
      if kind.head_version is not None:
        with jax.named_scope(PHASE["head"]):
          g_head, entry, accs, losses = self._head_tick(kind, ctx, row, y, entry, accs, losses)
      with jax.named_scope(PHASE["forward"]):
        stash = self._stash(ctx, row, stash, entry, c.fwd_buf)
      send_f = jnp.where(f_ok, y, jnp.zeros_like(y)).astype(c.fwd_buf.dtype)
      if self.overlap:  # it travels while the backward computes
        with jax.named_scope(PHASE["send"]):
          fwd_buf = lax.ppermute(send_f, STAGE, to_next)
    elif self.rings_in_state:
      stash = self._touch_trash(stash)
    wstash = c.wstash
    if kind.bwd:
      with jax.named_scope(PHASE["backward"]):
        if self.split_stage is not None:
          send_b, wstash, losses = self._backward_input(ctx, c, row, stash, g_head, losses)
        else:
          send_b, accs, losses = self._backward(kind, ctx, c, row, stash, g_head, accs, losses,
                                                gaps[1])
        g_x0 = jnp.where(ctx.is_first, send_b, jnp.zeros_like(send_b))
      if self.overlap and not rotate:  # zb1: B's cotangent travels while W computes
        with jax.named_scope(PHASE["send"]):
          bwd_buf = lax.ppermute(send_b, STAGE, to_prev)
    if kind.wgt:
      with jax.named_scope(PHASE["weight_grad"]):
        accs = self._backward_weights(ctx, row, wstash, accs)
    if self.solo_stage is not None:
      return TickCarry(send_f, send_b, stash, tuple(accs), losses, wstash), g_x0
    with jax.named_scope(PHASE["send"]):
      if not self.overlap:
        fwd_buf, bwd_buf = self._exchange(kind, ctx, c, send_f, send_b)
      else:  # sent above; a direction this tick has no work in keeps its buffer
        if fwd_buf is None:
          fwd_buf = c.fwd_buf
        if bwd_buf is None:  # rotated: this tick's cotangent waits for the next
          bwd_buf = send_b if rotate else c.bwd_buf
      if self.split_stage is not None:
        fwd_buf, bwd_buf = self._keep_received(ctx, row, c, fwd_buf, bwd_buf)
    return TickCarry(fwd_buf, bwd_buf, stash, tuple(accs), losses, wstash), g_x0

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

  def _keep_received(self, ctx: _Ctx, row: dict, c: TickCarry, fwd_buf: jax.Array,
                     bwd_buf: jax.Array) -> tuple[jax.Array, jax.Array]:
    """zb1: the buffers with what arrived this tick, else what they held.

    A stage may run its F (B) of a microbatch some ticks after its
    neighbour sent the input (cotangent); the value waits in the buffer,
    which only a neighbour's next F (B) replaces (`StepPlan.inbox_slots`
    checks that it is read before).
    """
    s, last = ctx.stage, self.num_stages - 1
    sent_f = (s > 0) & (row["fwd"][jnp.maximum(s - 1, 0)] >= 0)
    sent_b = (s < last) & (row["bwd"][jnp.minimum(s + 1, last)] >= 0)
    return jnp.where(sent_f, fwd_buf, c.fwd_buf), jnp.where(sent_b, bwd_buf, c.bwd_buf)

  def _exchange(self, kind: TickKind, ctx: _Ctx, c: TickCarry, send_f: jax.Array,
                send_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The tick's transfers: (activation from stage s-1, cotangent from stage s+1)."""
    fwd_buf, bwd_buf = c.fwd_buf, c.bwd_buf
    if self.chunks > 1 and self.num_stages == 1:
      # One stage: the ring is the stage itself.
      return (send_f if kind.fwd else fwd_buf), (send_b if kind.bwd else bwd_buf)
    if self.chunks > 1 and self.num_stages == 2 and kind.fwd and kind.bwd:
      # Interleaved on two stages: both directions of the ring are the same
      # swap, and each stage sends an activation and a cotangent: one exchange.
      got = lax.ppermute(jnp.stack([send_f, send_b]), STAGE, [(0, 1), (1, 0)])
      fwd_buf, bwd_buf = got[0], got[1]
    elif self.num_stages == 2 and kind.fwd and kind.bwd and self.chunks == 1:
      # Two stages: stage 0 sends its output up while stage 1 sends its input
      # cotangent down, one exchange. Each keeps the half it reads (stage 1
      # its forward input, stage 0 its backward cotangent); the other half is
      # never read (the first stage embeds, the last takes the head's).
      got = lax.ppermute(jnp.where(ctx.is_first, send_f, send_b), STAGE, [(0, 1), (1, 0)])
      fwd_buf = bwd_buf = got
    else:
      to_next, to_prev = self._sends()
      if kind.fwd:
        fwd_buf = lax.ppermute(send_f, STAGE, to_next)
      if kind.bwd:
        bwd_buf = lax.ppermute(send_b, STAGE, to_prev)
    return fwd_buf, bwd_buf

  def _stage_index(self) -> jax.Array:
    if self.solo_stage is not None:
      return jnp.int32(self.solo_stage)
    return lax.axis_index(STAGE)

  def _sends(self) -> tuple[list, list]:
    """ppermute pairs to the next and the previous stage (none for a solo stage).

    With v > 1 chunks the ring closes: stage S-1 sends on to stage 0 (its
    output of chunk j is stage 0's input of chunk j+1), and stage 0 back to
    stage S-1.
    """
    if self.solo_stage is not None:
      return [], []
    n = self.num_stages
    wrap = self.chunks > 1 and n > 1
    return ([(i, i + 1) for i in range(n - 1)] + ([(n - 1, 0)] if wrap else []),
            [(i + 1, i) for i in range(n - 1)] + ([(0, n - 1)] if wrap else []))

  def _valid(self, ctx: _Ctx, i: jax.Array) -> jax.Array:
    return (i >= 0) & ((i >= self.plan.history) | ctx.has_history)

  def _slot(self, ctx: _Ctx, mb: jax.Array, offset: jax.Array) -> jax.Array:
    return jnp.where(mb >= 0, (ctx.slot_base + offset) % self.plan.slots, self.trash)

  def _local_vocab(self, shared: Tree) -> int:
    axes = jax.tree.leaves(self.fns.vocab_axes, is_leaf=lambda a: a is None)
    for leaf, a in zip(jax.tree.leaves(shared), axes):
      if a is not None:
        return leaf.shape[a]
    return self.fns.vocab_size

  # --- the phases of a tick ------------------------------------------------------

  def _lookup(self, ctx: _Ctx, shared: Tree, tokens: jax.Array) -> jax.Array:
    """Embeddings of `tokens`: with a split vocabulary, this stage's rows (zeros elsewhere)."""
    if not self.split:
      return self.fns.embed(shared, tokens)
    return _vocab.masked_lookup(self.fns.embed, shared, tokens, ctx.offset,
                                self._local_vocab(shared))

  def _embed_step(self, ctx: _Ctx, dtype) -> Optional[jax.Array]:
    """[n, b, t, ...] stage 0's inputs of the step, embedded at once (see `_StepEmbedding`)."""
    e = self.step_embedding
    if e.version is None:
      return None
    with jax.named_scope(PHASE["embed"]):
      tokens = ctx.tokens[jnp.asarray(np.maximum(e.forwards, 0))]
      x0 = self._lookup(ctx, ctx.shared[e.version], tokens)
      if self.split:
        # Each stage holds a slice of the rows: summing assembles them.
        x0 = lax.psum(x0, STAGE)
      return x0.astype(dtype)

  def _forward(self, kind: TickKind, ctx: _Ctx, c: TickCarry, row: dict, gap: bool):
    """(output, whether this stage's forward slot is filled, its stash entry) of the tick."""
    s = ctx.stage
    f = row["fwd"][s]
    f_ok = self._valid(ctx, f)
    x_in = c.fwd_buf
    if kind.embed_version is not None:
      embeds = ctx.is_first if self.chunks == 1 else ctx.is_first & (row["fwd_chunk"][s] == 0)
      x_in = jnp.where(embeds, ctx.x0[row["embed_pos"]].astype(x_in.dtype), x_in)
    x_in = jnp.where(f_ok, x_in, jnp.zeros_like(x_in))
    fns = self.fns
    chunk = row["fwd_chunk"][s] if self.chunks > 1 else 0

    def forward(blocks):
      blocks = chunk_of(blocks, chunk, self.chunks)
      if self.stash_mode == "residuals" and self.split_stage is not None:
        y, aux, kept = self.split_stage.forward(blocks, x_in)
        return y.astype(x_in.dtype), aux, {"res": make_varying(kept)}
      if self.stash_mode == "residuals":
        y, aux, kept, layout = forward_with_vjp(fns.stage, blocks, x_in, make_varying)
        assert layout.layout == ctx.layout.layout, "the stage traced differently"
        return y.astype(x_in.dtype), aux, {"res": kept}
      y, aux = fns.stage(blocks, x_in)
      return y.astype(x_in.dtype), aux, {"x": x_in}

    # An empty slot computes nothing: the stage's work is under a cond on
    # this stage's own validity (other stages may be busy this tick).
    compute = lambda: self._with_version(ctx.blocks, kind.fwd_version, row["fwd_version"][s],
                                         forward)
    with jax.named_scope(PHASE["forward"]):
      y, aux, entry = _only_if(f_ok, compute) if gap else compute()
    return y, f_ok, {**entry, "aux": aux}

  def _head_tick(self, kind: TickKind, ctx: _Ctx, row: dict, y: jax.Array, entry: dict,
                 accs: list, losses: jax.Array):
    """The head of the last stage's forward microbatch: (its cotangent, entry, accs, losses).

    With a split vocabulary every stage computes its slice's logits (the last
    stage's output broadcast to all); otherwise the last stage alone.
    """
    last = row["fwd"][self.num_stages - 1]
    last_ok = self._valid(ctx, last)
    shared, targets = ctx.shared[kind.head_version], ctx.targets[jnp.maximum(last, 0)]
    # With v > 1 chunks the head runs when the last stage's forward is of the
    # last chunk: the same on every stage (it is the tick's row), so a cond
    # around collectives is one that every stage takes alike.
    # zb1's ticks are all of one kind: the head runs when the last stage's
    # forward does, under a cond that every stage likewise takes alike.
    runs = None
    if self.chunks > 1:
      runs = row["fwd_chunk"][self.num_stages - 1] == self.chunks - 1
      last_ok = last_ok & runs
    elif self.split_stage is not None:
      runs = last >= 0
    if self.split:
      # psum of the last stage's output (zeros elsewhere): a broadcast that
      # also makes every stage's head wait for every stage's forward.
      def head():
        h = lax.psum(jnp.where(ctx.is_last, y, jnp.zeros_like(y)), STAGE)
        return self._head(ctx, shared, h, targets)
      loss_h, g_sh, g_head = (head() if runs is None else
                              _only_if(runs, lambda: make_varying(head())))
    else:
      on = ctx.is_last if runs is None else ctx.is_last & runs
      loss_h, g_sh, g_head = _only_if(on, lambda: self._head(ctx, shared, y, targets))
    a = kind.head_acc
    accs[a] = (accs[a][0], jax.tree.map(
        lambda acc, g: acc + jnp.where(last_ok, g, jnp.zeros_like(g)).astype(acc.dtype),
        accs[a][1], g_sh))
    losses = losses.at[a].add(jnp.where(last_ok & ctx.is_last, loss_h, 0.0))
    if self.plan.head_stash:
      entry = {**entry, "dh": make_varying(g_head).astype(y.dtype)}
    return g_head, entry, accs, losses

  def _head(self, ctx: _Ctx, shared: Tree, h: jax.Array, targets: jax.Array):
    """(loss, shared gradient (slice), gradient of h (summed over stages)) of one microbatch."""
    def objective(sh, h):
      return _vocab.chunked_cross_entropy(self.fns.logits, sh, h, targets, ctx.offset,
                                          self.fns.vocab_size, STAGE if self.split else None,
                                          self.fns.loss_chunk)

    loss, pull = jax.vjp(objective, shared, h)
    g_shared, g_h = pull(jnp.ones_like(loss))
    return loss, g_shared, g_h

  def _stash(self, ctx: _Ctx, row: dict, stash: dict, entry: dict, like: jax.Array) -> dict:
    """The stash with the tick's forward entry written into its slot."""
    if self.plan.head_stash and "dh" not in entry:
      entry = {**entry, "dh": jnp.zeros_like(like)}
    # Written before the backward reads: on the last stage the backward is
    # this very microbatch. Outside any cond: XLA copies a buffer that a
    # conditional reads and the loop body then writes.
    s = ctx.stage
    slot_f = self._slot(ctx, row["fwd"][s], row["fwd_slot"][s])
    return jax.tree.map(
        lambda r, v: lax.dynamic_update_index_in_dim(r, v.astype(r.dtype), slot_f, 0),
        stash, entry)

  def _backward(self, kind: TickKind, ctx: _Ctx, c: TickCarry, row: dict, stash: dict,
                g_head: Optional[jax.Array], accs: list, losses: jax.Array, gap: bool):
    """The tick's backward on this stage: (input cotangent to send, accs, losses)."""
    plan, fns, s = self.plan, self.fns, ctx.stage
    b = row["bwd"][s]
    b_ok = self._valid(ctx, b)
    slot = self._slot(ctx, b, row["bwd_slot"][s])
    zeros = jnp.zeros_like
    if plan.head_stash:
      top = None
    else:  # the head ran this tick, or the last stage has no backward in it
      top = zeros(c.bwd_buf) if g_head is None else g_head.astype(c.bwd_buf.dtype)
    # Accumulators this tick's backwards may add into (the plan's, or all).
    targets = [a for a in range(plan.num_accumulators)
               if kind.bwd_version is None or kind.bwd_version == a]
    block_accs = tuple(accs[a][0] for a in targets)
    # With v > 1 chunks only the last chunk's backward takes the head's
    # cotangent on the last stage; the others take the ring's.
    chunk = row["bwd_chunk"][s] if self.chunks > 1 else 0
    tops = ctx.is_last if self.chunks == 1 else ctx.is_last & (chunk == self.chunks - 1)

    def backward_and_add(valid=True):
      entry = jax.tree.map(
          lambda ring: lax.dynamic_index_in_dim(ring, slot, 0, keepdims=False), stash)
      g_top = (entry["dh"] if top is None else top).astype(c.bwd_buf.dtype)
      g_y = jnp.where(tops, g_top, c.bwd_buf)
      g_aux = make_varying(jnp.ones((), entry["aux"].dtype))

      def backward(blocks):
        blocks = chunk_of(blocks, chunk, self.chunks)
        if self.stash_mode == "residuals":
          pull = rebuild_vjp(ctx.layout, entry["res"], jax.tree.leaves(blocks))
        else:
          _, pull = jax.vjp(fns.stage, blocks, entry["x"])
        return pull((g_y, g_aux))

      g_blocks, g_x = self._with_version(ctx.blocks, kind.bwd_version, row["bwd_version"][s],
                                         backward)
      new = []
      for a, acc in zip(targets, block_accs):
        mine = valid if kind.bwd_version is not None else valid & (row["acc"][s] == a)
        new.append(jax.tree.map(
            lambda t, g, mine=mine: _add_to_chunk(t, jnp.where(mine, g, zeros(g)), chunk,
                                                  self.chunks),
            acc, g_blocks))
      g_x = jnp.where(valid, g_x, zeros(g_x))
      return tuple(new), g_x.astype(c.bwd_buf.dtype), entry["aux"]

    # As for the forward: an empty slot runs no backward and adds nothing
    # (the accumulators are updated inside the branch, in place).
    if gap:
      block_accs, g_x, aux_b = lax.cond(
          b_ok, backward_and_add,
          lambda: (block_accs, zeros(c.bwd_buf), make_varying(jnp.zeros((), jnp.float32))))
    else:  # every slot is filled, but for the previous batch's in 2bw's first step
      block_accs, g_x, aux_b = backward_and_add(b_ok)
    for a, acc in zip(targets, block_accs):
      accs[a] = (acc, accs[a][1])
      mine = b_ok if kind.bwd_version is not None else b_ok & (row["acc"][s] == a)
      losses = losses.at[a].add(jnp.where(mine, aux_b, 0.0))
    return g_x, accs, losses

  def _backward_input(self, ctx: _Ctx, c: TickCarry, row: dict, stash: dict,
                      g_head: Optional[jax.Array], losses: jax.Array
                      ) -> tuple[jax.Array, Tree, jax.Array]:
    """zb1's B on this stage: (input cotangent to send, W's stash ring, losses).

    B pulls the cotangent back to the stage input only (`SplitStage`; with
    `stash='inputs'` it recomputes the forward once, and W does not) and
    keeps what W needs in W's ring, at the slot the plan names; the weights'
    gradient is W's. The last stage's cotangent is the head's, of this
    tick (its F and B of a microbatch share a tick, as in 1F1B). B adds the
    forward's auxiliary loss, as a backward does.
    """
    s, split = ctx.stage, self.split_stage
    b = row["bwd"][s]
    b_ok = self._valid(ctx, b)
    slot = self._slot(ctx, b, row["bwd_slot"][s])
    blocks = ctx.blocks[0]

    def run():
      entry = jax.tree.map(lambda ring: lax.dynamic_index_in_dim(ring, slot, 0, keepdims=False),
                           stash)
      top = jnp.zeros_like(c.bwd_buf) if g_head is None else g_head.astype(c.bwd_buf.dtype)
      g_y = jnp.where(ctx.is_last, top, c.bwd_buf)
      g_aux = make_varying(jnp.ones((), entry["aux"].dtype))
      if self.stash_mode == "residuals":
        g_x, w = split.backward_input(blocks, entry["res"], g_y, g_aux)
      else:
        g_x, w = split.backward_input_from_inputs(blocks, entry["x"], g_y, g_aux)
      return make_varying((g_x.astype(c.bwd_buf.dtype), w, entry["aux"]))

    # An empty slot runs no B and computes nothing (other stages may be busy).
    g_x, w, aux = _only_if(b_ok, run)
    # Written outside the cond, as the forward's stash is (see `_stash`).
    wslot = jnp.where(b >= 0, row["bwd_wslot"][s], self.w_trash)
    wstash = jax.tree.map(
        lambda r, v: lax.dynamic_update_index_in_dim(r, v.astype(r.dtype), wslot, 0),
        c.wstash, w)
    losses = losses.at[0].add(jnp.where(b_ok, aux, 0.0))
    return g_x, wstash, losses

  def _backward_weights(self, ctx: _Ctx, row: dict, wstash: Tree, accs: list) -> list:
    """zb1's W's on this stage: the accumulators with the weights' gradients added.

    Each W reads what B kept for it (W's ring, at the slot the plan names)
    and runs the weight-gradient half of the backward alone, under a cond on
    this stage's own row: an empty entry adds nothing and computes nothing.
    A cell may hold several W's (the drain's, up to J): a `lax.scan` over the
    plan's J entries keeps one copy of W's program in the tick.
    """
    s = ctx.stage
    blocks = ctx.blocks[0]

    def one(acc, item):
      w, slot = item
      slot = jnp.where(w >= 0, slot, self.w_trash)

      def run():
        entry = jax.tree.map(
            lambda ring: lax.dynamic_index_in_dim(ring, slot, 0, keepdims=False), wstash)
        g = self.split_stage.backward_weights(blocks, entry)
        return make_varying(jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, g))

      return lax.cond(self._valid(ctx, w), run, lambda: acc), None

    ws, slots = row["wgt"][s], row["wgt_slot"][s]
    if ws.shape[0] == 1:
      acc, _ = one(accs[0][0], (ws[0], slots[0]))
    else:
      acc, _ = lax.scan(one, accs[0][0], (ws, slots))
    return [(acc, accs[0][1])] + list(accs[1:])

  def _embed_grad_step(self, ctx: _Ctx, carry: TickCarry, grads_x0: list) -> TickCarry:
    """The carry with the step's embedding gradients added, once for all of stage 0's backwards.

    `grads_x0` holds, per run of ticks, stage 0's input cotangent of each
    tick (None for runs without a backward). Each is scattered into the rows
    of its microbatch's tokens in the accumulator the plan names; with a
    split vocabulary, after one broadcast from stage 0 to every stage, each
    of which adds into its own rows.
    """
    e = self.step_embedding
    if not len(e.backwards):
      return carry
    with jax.named_scope(PHASE["embed_grad"]):
      starts = np.cumsum([0] + [t1 - t0 for _, t0, t1 in self.plan.segments()])
      pieces = []
      for t in e.grad_ticks:
        seg = int(np.searchsorted(starts, t, side="right") - 1)
        pieces.append(grads_x0[seg][t - starts[seg]])
      g0 = jnp.stack(pieces)                                          # [n, b, t, ...]
      if self.split:
        g0 = lax.psum(g0, STAGE)  # stage 0's cotangents, to every stage's rows
      tokens = ctx.tokens[jnp.asarray(np.maximum(e.backwards, 0))]

      def add_microbatch(acc, item):
        g, toks, mine = item
        # A lookup's gradient depends on the table's shape, not its values:
        # any version serves.
        _, pull = jax.vjp(lambda t: self._lookup(ctx, t, toks), ctx.shared[0])
        (g_e,) = pull(make_varying(jnp.where(mine, g, jnp.zeros_like(g))))
        # No validity mask: an empty slot's cotangent is zero, and
        # `acc + scatter(0)` is what XLA turns into a scatter-add in place.
        return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, g_e), None

      accs = list(carry.accs)
      for a in sorted({int(x) for x in e.grad_accs}):
        # One microbatch's rows at a time: a scatter-add's temporaries grow
        # with its update, and XLA's deterministic scatter on GPUs sorts the
        # whole update by row, through float32, int32 and predicate copies of
        # it (docs/accelerators.md measures what this saves).
        mine = jnp.asarray(e.grad_accs == a)
        shared_acc, _ = lax.scan(add_microbatch, accs[a][1], (g0, tokens, mine))
        accs[a] = (accs[a][0], shared_acc)
      return carry._replace(accs=tuple(accs))

  @staticmethod
  def _with_version(versions: tuple, static: Optional[int], dynamic: jax.Array, fn):
    """fn(the weights of one version): a static choice is free; a per-stage one
    a `lax.switch`, each branch computing with its version's buffers in
    place (a select would copy the weights)."""
    if static is not None:
      return fn(versions[static])
    if len(versions) == 1:
      return fn(versions[0])
    index = jnp.clip(dynamic, 0, len(versions) - 1)
    return lax.switch(index, [functools.partial(fn, v) for v in versions])

  # --- evaluation ----------------------------------------------------------------

  def evaluate(self, blocks: Tree, shared: Tree, tokens: jax.Array, targets: jax.Array,
               x_like: jax.ShapeDtypeStruct) -> jax.Array:
    """The summed loss of [M, b, t] microbatches by forward ticks alone (no gradients).

    GPipe's M+S-1 forward ticks; with v > 1 chunks the forward halves of
    interleaved's ticks (Mv+S-1 of them: each group of S microbatches goes
    round the ring v times, chunk by chunk, the head after the last).
    Cross-entropy counted on the last stage, auxiliary losses on each stage;
    summing over the mesh gives the batch total.
    """
    m, num_stages, v = tokens.shape[0], self.num_stages, self.chunks
    s = self._stage_index()
    is_first, is_last = s == 0, s == num_stages - 1
    blocks, shared = make_varying(self.fns.prepare(blocks)), make_varying(shared)
    offset = s * self._local_vocab(shared) if self.split else jnp.int32(0)
    ctx = _Ctx(stage=s, is_first=is_first, is_last=is_last, offset=offset, blocks=(blocks,),
               shared=(shared,), tokens=tokens, targets=targets, has_history=jnp.asarray(True),
               slot_base=jnp.asarray(0), layout=None, x0=None)
    x0 = self._lookup(ctx, shared, tokens)
    if self.split:
      x0 = lax.psum(x0, STAGE)
    to_next, _ = self._sends()
    # Stage s's k-th forward, at tick k + s: microbatch (k // (S v)) S + k % S
    # through its chunk (k // S) % v (with v = 1: microbatch t - s).
    k = np.arange(m * v + num_stages - 1)[:, None] - np.arange(num_stages)[None, :]
    ok = (k >= 0) & (k < m * v)
    rows = {"mb": np.where(ok, (k // (num_stages * v)) * num_stages + k % num_stages, -1),
            "chunk": np.where(ok, (k // num_stages) % v, -1)}
    rows = {name: jnp.asarray(x.astype(np.int32)) for name, x in rows.items()}

    def head_loss(h, tgt):
      return _vocab.chunked_cross_entropy(self.fns.logits, shared, h, tgt, offset,
                                          self.fns.vocab_size, STAGE if self.split else None,
                                          self.fns.loss_chunk)

    def tick(c, row):
      buf, total = c
      f, chunk = row["mb"][s], row["chunk"][s]
      last = row["mb"][num_stages - 1]
      f_ok = f >= 0
      # The head: every tick (masked) with one chunk, else under a cond on
      # the last stage's chunk, which every stage reads alike.
      runs = None if v == 1 else row["chunk"][num_stages - 1] == v - 1
      last_ok = (last >= 0) if runs is None else (last >= 0) & runs
      embeds = is_first if v == 1 else is_first & (chunk == 0)
      x = jnp.where(f_ok, jnp.where(embeds, x0[jnp.clip(f, 0, m - 1)].astype(buf.dtype), buf),
                    jnp.zeros_like(buf))
      y, aux = self.fns.stage(chunk_of(blocks, chunk, v), x)
      y = y.astype(buf.dtype)
      tgt = targets[jnp.clip(last, 0, m - 1)]
      if self.split:
        head = lambda: head_loss(lax.psum(jnp.where(is_last, y, jnp.zeros_like(y)), STAGE), tgt)
        loss = head() if runs is None else _only_if(runs, lambda: make_varying(head()))
      else:
        on = is_last if runs is None else is_last & runs
        loss = _only_if(on, lambda: head_loss(y, tgt))
      total = total + jnp.where(f_ok, aux, 0.0) + jnp.where(last_ok & is_last, loss, 0.0)
      if num_stages == 1 and v > 1:
        return (y, total), None
      return (lax.ppermute(y, STAGE, to_next), total), None

    init = make_varying((jnp.zeros(x_like.shape, x_like.dtype), jnp.zeros((), jnp.float32)))
    (_, total), _ = lax.scan(tick, init, rows)
    return total
