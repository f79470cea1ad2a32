"""What every part of the engine shares: the model's stage functions, the carry, a step's context.

`StageFns` is the model as the pipeline sees it; `TickCarry` what flows
from tick to tick; `StepContext` what every tick of one step reads. The
helpers type values as varying over the mesh (`make_varying`), run work
only where this device has it (`only_if`), and read a stage's
`jax.vjp` residuals off an abstract trace (`vjp_layout`). Everything here
sees per-device (local) shapes, inside `jax.shard_map` over a
('stage', 'data') mesh.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxpipe._vma import varying_axes
from jaxpipe.pipeline import _vocab
from jaxpipe.pipeline._names import DATA, STAGE
from jaxpipe.pipeline._plan import TickKind
from jaxpipe.pipeline._split import VjpLayout, forward_with_vjp

Tree = Any

__all__ = ["StageFns", "TickCarry", "StepContext", "TickLoop", "PHASE", "TICKS", "make_varying",
           "varying_axes", "only_if", "vjp_layout", "residual_shapes", "expert_exchange",
           "no_experts", "acc_dtype", "vocab_split"]

AXES = (STAGE, DATA)
# The phases of a tick, each traced under its own `jax.named_scope`, so that a
# profile (XLA's CPU trace, Nsight Systems, XProf) names the work of every
# operation (the CPU trace account, tools/cpu/account.py, reads them back).
# The schedules add the once-per-step gradient reduction and the optimizer
# update.
# zb1's W (the weights' gradient, split from the backward) is a phase of its
# own, so that an account tells B from W.
PHASE = {p: f"pipe_{p}" for p in ("embed", "forward", "head", "backward", "weight_grad",
                                    "embed_grad", "send", "grad_reduce", "optimizer")}
# The prefix of each tick loop's named scope, then the work its ticks hold.
TICKS = "ticks_"


def _same(blocks: Tree) -> Tree:
  """The blocks as they are (`StageFns.prepare`'s default)."""
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


def vjp_layout(fn, blocks: Tree, x: jax.Array, mark=None) -> tuple[VjpLayout, tuple]:
  """The layout of stage `fn`'s `jax.vjp` residuals and their shapes, from an abstract trace.

  No work is emitted: `jax.eval_shape` traces on the side.
  """
  box = []

  def trace(blocks, x):
    _, _, kept, layout = forward_with_vjp(fn, blocks, x, mark or make_varying)
    box.append(layout)
    return kept

  shapes = jax.eval_shape(trace, blocks, x)
  return box[0], shapes


def only_if(pred: jax.Array, compute: Callable[[], Any]) -> Any:
  """compute() when `pred` (this device's), else zeros of its shapes: nothing is computed."""
  shapes = jax.eval_shape(compute)

  def skip():
    return make_varying(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))

  return lax.cond(pred, compute, skip)


def residual_shapes(fn, blocks: Tree, x: jax.Array) -> tuple:
  """Shapes of what `stash='residuals'` keeps per microbatch for a stage `fn` (outside a mesh)."""
  return vjp_layout(fn, blocks, x, mark=lambda leaf: leaf)[1]


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


class StepContext(NamedTuple):
  """What every tick of one step reads: traced values, the stage's position, the plan's sizes.

  `x0` holds the embedded inputs of every microbatch stage 0 starts this
  step ([n, b, t, ...], `StepEmbedding.forwards` order), looked up once per
  step; a tick's `row['embed_pos']` picks its one. `history`, `slots` and
  `trash` are the plan's (`StepPlan.history`, `StepPlan.slots`) and the
  scratch slot past the ring that an empty slot writes into.
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
  history: int
  slots: int
  trash: int

  def valid(self, i: jax.Array) -> jax.Array:
    """Whether window index `i` is a microbatch of this step (2bw's first has no previous batch)."""
    return (i >= 0) & ((i >= self.history) | self.has_history)

  def slot(self, mb: jax.Array, offset: jax.Array) -> jax.Array:
    """The stash slot of microbatch `mb` at the plan's slot `offset` (the scratch slot for none)."""
    return jnp.where(mb >= 0, (self.slot_base + offset) % self.slots, self.trash)


class TickLoop(NamedTuple):
  """A run of ticks of one kind, which the step runs as one loop (`StepPlan.segments`).

  Attributes:
    kind: what its ticks run (`TickKind`).
    fwd_gap, bwd_gap: whether some forward (backward) slot of its ticks is
      empty; that work is then guarded by a cond, so that an empty slot
      computes nothing. Where every stage has work in every tick (2bw's
      steady state) no cond guards it: a cond costs the CPU runtime some
      overlap.
  """
  kind: TickKind
  fwd_gap: bool = True
  bwd_gap: bool = True


def vocab_split(vocab_axes: Tree) -> bool:
  """Whether a StageFns' shared leaves are split over 'stage' by vocabulary (else replicated)."""
  return any(a is not None for a in jax.tree.leaves(vocab_axes, is_leaf=lambda a: a is None))
