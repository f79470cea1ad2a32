"""Training schedules behind one interface: none, gpipe, 1f1b, 2bw, pipedream.

A `Schedule` owns a mesh, the model's `StageFns` and an optax optimizer. Its
state is a typed pytree (`SyncState`, `PipeDreamState`, `TwoBWState`): the
parameters (with their versions where several are alive), the optimizer
state, a step counter and, for 2bw, everything in flight between steps. Each
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

Loss reporting: `step` returns `metrics['loss']`, the mean training loss of
batch `metrics['loss_step']` at the weights that batch ran on. For 2bw a
batch's last microbatches reach the last stage during the next step, so step k
reports batch k-1 (`loss_lag = 1`) and `pending_loss` gives the last batch's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpipe.pipeline import _vocab
from jaxpipe.pipeline._engine import DATA, STAGE, Engine, StageFns, TickCarry
from jaxpipe.pipeline._timetable import SCHEDULE_NAMES, min_microbatches, step_plan

Tree = Any

__all__ = ["Schedule", "SyncState", "PipeDreamState", "TwoBWState", "InFlight",
           "make_schedule", "make_mesh", "split_params", "merge_params", "SCHEDULE_NAMES"]


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


# --- typed states --------------------------------------------------------------
#
# Field kinds: 'step' a replicated counter; 'params' a parameter tree (natural
# layout, padded vocabulary); 'versions' a parameter tree with a leading
# version axis; 'opt' optimizer state following the parameters; 'device'
# per-device buffers with leading [stage, data] axes; 'batch' a [M, B, t]
# token batch; 'inflight' a nested `InFlight`.


class SyncState(NamedTuple):
  """State of none, gpipe and 1f1b.

  Attributes:
    step: updates done.
    params: the weights.
    opt_state: the optimizer's state.
  """
  step: jax.Array
  params: Tree
  opt_state: Tree

  KINDS = {"step": "step", "params": "params", "opt_state": "opt"}


class PipeDreamState(NamedTuple):
  """State of pipedream.

  Attributes:
    step: updates done (k).
    versions: [S, ...] the last S weight versions, v[j] at index j % S.
    opt_state: the optimizer's state.
  """
  step: jax.Array
  versions: Tree
  opt_state: Tree

  KINDS = {"step": "step", "versions": "versions", "opt_state": "opt"}


class InFlight(NamedTuple):
  """What a 2bw pipeline holds between step k-1 and step k (per device: [S, D, ...]).

  Attributes:
    fwd_buf, bwd_buf: the activation and cotangent in transit between stages.
    stash: the stash ring (stage inputs or residuals of microbatches whose
      backward has not run).
    acc: (blocks, shared) batch k-1's gradient accumulated so far.
    loss: batch k-1's loss sum so far.
    tokens, targets: batch k-1, whose last microbatches still run in step k.
  """
  fwd_buf: jax.Array
  bwd_buf: jax.Array
  stash: Tree
  acc: Tree
  loss: jax.Array
  tokens: jax.Array
  targets: jax.Array

  KINDS = {"fwd_buf": "device", "bwd_buf": "device", "stash": "device", "acc": "device",
           "loss": "device", "tokens": "batch", "targets": "batch"}


class TwoBWState(NamedTuple):
  """State of 2bw at the start of step k.

  Attributes:
    step: k.
    prev: v[k-1], the version batch k-1's last microbatches still run on
      (v[0] at k = 0).
    cur: v[k], the version batch k runs on.
    opt_state: the optimizer's state.
    inflight: the pipeline's in-flight state (`InFlight`).
  """
  step: jax.Array
  prev: Tree
  cur: Tree
  opt_state: Tree
  inflight: InFlight

  KINDS = {"step": "step", "prev": "params", "cur": "params", "opt_state": "opt",
           "inflight": "inflight"}


def _pick(tree: Tree, index) -> Tree:
  return jax.tree.map(lambda v: v[index], tree)


def _local(tree: Tree) -> Tree:
  return jax.tree.map(lambda x: x[0, 0], tree)


def _per_device(tree: Tree) -> Tree:
  return jax.tree.map(lambda x: x[None, None], tree)


def _all_finite(tree: Tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


@dataclasses.dataclass(frozen=True)
class _Spec:
  """A parameter's spec and rank, one leaf for `optax.tree_map_params`."""
  spec: P
  ndim: int


def _data_split(shape: tuple, spec: P, num_stages: int, num_data: int) -> P:
  """`spec` with 'data' added on the first axis of `shape` that can take it (see
  `Schedule.opt_param_specs`); `spec` itself where none can."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  stacked = max(len(shape) - 2, 0)
  for a in [*range(stacked), *range(stacked, len(shape))]:
    if entries[a] is None and shape[a] % num_data == 0:
      entries[a] = DATA
      return P(*entries)
    if entries[a] == STAGE and shape[a] % (num_stages * num_data) == 0:
      entries[a] = (STAGE, DATA)
      return P(*entries)
  return spec


def _acc_dtype(x) -> jnp.dtype:
  # Gradients are summed over microbatches in float32, whatever the weights'.
  return jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype


class Schedule:
  """Base class: shardings, the optimizer step with its NaN guard, and jitting."""

  name = "base"
  loss_lag = 0
  pipelined = True

  def __init__(self, fns: StageFns, optimizer: optax.GradientTransformation, mesh: Mesh,
               num_microbatches: int, *, stash: str = "inputs", shard_optimizer: bool = True,
               predict: Optional[Any] = None):
    self.fns, self.opt, self.mesh = fns, optimizer, mesh
    self.shard_optimizer = shard_optimizer
    self.predict = predict
    if predict is not None and self.pipelined:
      raise ValueError(f"schedule '{self.name}' cannot take gradients at predicted weights; "
                       "only schedule none can (the one-device simulation)")
    self.num_stages = mesh.shape[STAGE]
    self.num_data = mesh.shape[DATA]
    self.num_microbatches = num_microbatches
    self.stash = stash
    if not self.pipelined and self.num_stages != 1:
      raise ValueError(f"schedule '{self.name}' runs without stages; got a mesh of "
                       f"{self.num_stages} stages")
    need = min_microbatches(self.name, self.num_stages) if self.pipelined else 1
    if num_microbatches < need:
      raise ValueError(f"schedule {self.name} with {self.num_stages} stages needs at least "
                       f"{need} microbatches per step, got {num_microbatches}")
    # The vocabulary as the state holds it: padded to a multiple of S.
    self.vocab = (_vocab.padded_vocab(fns.vocab_size, self.num_stages) if self.pipelined
                  else fns.vocab_size)
    self._jit_step = None
    self._jit_eval = None

  # --- shardings, from the kinds of the state's fields -------------------------

  def _named(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  def replicated(self) -> NamedSharding:
    """A sharding that keeps a full copy on every device of the mesh."""
    return self._named(P())

  def batch_sharding(self) -> NamedSharding:
    """Sharding of a [M, B/M, seq] token batch: rows split over 'data'."""
    return self._named(P(None, DATA))

  def param_specs(self, params: Tree, lead: tuple = ()) -> Tree:
    """PartitionSpecs of a parameter tree (behind `lead` extra leading axes).

    Blocks are split over 'stage' on their layer axis, shared leaves on their
    vocabulary axis; the rest is replicated. Without a pipeline, replicated.
    """
    blocks, shared = split_params(params)
    if not self.pipelined:
      return jax.tree.map(lambda _: P(), params)
    vocab = lambda a: P(*lead, *([None] * a), STAGE) if a is not None else P()
    return merge_params(jax.tree.map(lambda _: P(*lead, STAGE), blocks),
                        jax.tree.map(vocab, self.fns.vocab_axes, is_leaf=lambda a: a is None))

  def _check_shared(self, shared: Tree) -> None:
    axes = jax.tree.structure(self.fns.vocab_axes, is_leaf=lambda a: a is None)
    if jax.tree.structure(shared) != axes:
      raise ValueError("StageFns.vocab_axes must have the structure of the non-block "
                       f"parameters: {jax.tree.structure(shared)} vs {axes}")

  def param_shardings(self, params: Tree, lead: tuple = ()) -> Tree:
    """Shardings of a parameter tree (see `param_specs`)."""
    return jax.tree.map(self._named, self.param_specs(params, lead))

  def opt_param_specs(self, params: Tree) -> Tree:
    """PartitionSpecs of the optimizer's parameter-shaped state (ZeRO-1 over 'data').

    Each leaf keeps its parameter's spec and, with `shard_optimizer` on a
    mesh of D > 1 replicas, is also split D ways over 'data': each replica
    then updates its slice and the new weights are gathered. The axis is the
    first, in this order, whose size allows it: the stacking axes of a leaf
    with three or more (layers, experts; so that Muon orthogonalises whole
    matrices, each on one replica), then the others. An axis already split
    over 'stage' takes ('stage', 'data') when S x D divides it. A leaf with
    no such axis stays replicated over 'data'.
    """
    specs = self.param_specs(params)
    if not self.shard_optimizer or self.num_data == 1:
      return specs
    return jax.tree.map(lambda x, spec: _data_split(x.shape, spec, self.num_stages,
                                                    self.num_data),
                        params, specs)

  def opt_shardings(self, params: Tree, opt_state: Tree) -> Tree:
    """Shardings of the optimizer state: each parameter-shaped copy as `opt_param_specs` says."""
    specs = jax.tree.map(lambda x, spec: _Spec(spec, len(x.shape)), params,
                         self.opt_param_specs(params))
    masked = lambda x: isinstance(x, optax.MaskedNode)

    def place(x, spec):
      # Partitioned optimizers hold MaskedNode placeholders where a group
      # does not apply; they stay placeholders. Buffers with extra leading
      # axes (the delay's slots) keep their parameter's layout behind them.
      if masked(x):
        return x
      lead = len(x.shape) - spec.ndim
      return self._named(P(*([None] * lead), *spec.spec) if lead else spec.spec)

    return optax.tree_map_params(self.opt, place, opt_state, specs,
                                 transform_non_params=lambda _: self.replicated(),
                                 is_leaf=masked)

  def _field_specs(self, state: NamedTuple, params: Tree) -> NamedTuple:
    """PartitionSpecs of every field of a typed state (opt: None, see `state_shardings`)."""
    out = {}
    for name, kind in type(state).KINDS.items():
      value = getattr(state, name)
      if kind == "step":
        out[name] = P()
      elif kind == "params":
        out[name] = self.param_specs(value)
      elif kind == "versions":
        out[name] = self.param_specs(value, lead=(None,))
      elif kind == "opt":
        out[name] = None
      elif kind == "device":
        out[name] = jax.tree.map(lambda _: P(STAGE, DATA), value)
      elif kind == "batch":
        out[name] = P(None, DATA)
      elif kind == "inflight":
        out[name] = self._field_specs(value, params)
      else:
        raise ValueError(f"{type(state).__name__}.{name}: unknown field kind {kind!r}")
    return type(state)(**out)

  def state_shardings(self, state: NamedTuple) -> NamedTuple:
    """Shardings of every field of a state (arrays or `jax.eval_shape` structs)."""
    params = self._params_of(state)

    def shard(state, specs):
      out = {}
      for name, kind in type(state).KINDS.items():
        if kind == "opt":
          out[name] = self.opt_shardings(params, getattr(state, name))
        elif kind == "inflight":
          out[name] = shard(getattr(state, name), getattr(specs, name))
        else:
          out[name] = jax.tree.map(self._named, getattr(specs, name),
                                   is_leaf=lambda x: isinstance(x, P))
      return type(state)(**out)

    return shard(state, self._field_specs(state, params))

  def _params_of(self, state) -> Tree:
    """A parameter-shaped field of the state (for the optimizer state's structure)."""
    raise NotImplementedError

  # --- optimizer ---------------------------------------------------------------

  def _update(self, params, opt_state, grads, allowed):
    """Applies the optimizer when `allowed` and every gradient is finite."""
    finite = _all_finite(grads)
    if self.shard_optimizer and self.num_data > 1:
      # Pinned at both ends, so that XLA computes the update on each
      # replica's slice (the gradient is already whole on every replica) and
      # gathers only the finished update, rather than updating whole copies.
      sliced = jax.tree.map(self._named, self.opt_param_specs(params))
      pin = lambda t: lax.with_sharding_constraint(t, sliced)
    else:
      pin = lambda t: t

    def apply(_):
      updates, new_state = self.opt.update(pin(grads), opt_state, params)
      return optax.apply_updates(params, pin(updates)), new_state

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

  # --- vocabulary padding --------------------------------------------------------

  def pad(self, params: Tree) -> Tree:
    """Natural parameters with the vocabulary padded as the state holds it (NumPy stays NumPy)."""
    return self._pad(params)

  def _pad(self, params: Tree) -> Tree:
    blocks, shared = split_params(params)
    self._check_shared(shared)
    return merge_params(blocks, _vocab.pad_vocab(shared, self.fns.vocab_axes, self.vocab))

  def _unpad(self, params: Tree) -> Tree:
    blocks, shared = split_params(params)
    return merge_params(blocks, _vocab.unpad_vocab(shared, self.fns.vocab_axes,
                                                   self.fns.vocab_size))

  # --- interface ---------------------------------------------------------------

  def init(self, params: Tree, batch_shape: tuple[int, int, int],
           token_dtype=jnp.int32) -> NamedTuple:
    """Places `params` (natural shapes) on the mesh and builds the initial training state.

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

  def init_sharded(self, init: Any, rng: jax.Array, batch_shape: tuple[int, int, int],
                   token_dtype=jnp.int32) -> NamedTuple:
    """The initial state with parameters `init(rng)` made directly in their shardings.

    Drawing the parameters, padding the vocabulary and building the state
    are one jitted function with the state's output shardings, so XLA
    partitions the random draws too (jax_threefry_partitionable, on by
    default, makes each shard's numbers independent of the sharding): no
    device ever holds more than its share, and the values equal
    `init(params=init(rng))`'s.
    """
    return self.init_program(init, rng, batch_shape, token_dtype)(rng)

  def init_program(self, init: Any, rng: jax.Array, batch_shape: tuple[int, int, int],
                   token_dtype=jnp.int32):
    """The jitted rng -> initial state function `init_sharded` runs (for inspection)."""
    fn = lambda r: self._init_fn(init(r), batch_shape=tuple(batch_shape),
                                 token_dtype=token_dtype)
    return jax.jit(fn, out_shardings=self.state_shardings(jax.eval_shape(fn, rng)))

  def _init_fn(self, params, *, batch_shape, token_dtype):
    del batch_shape, token_dtype
    params = self._pad(params)
    return SyncState(jnp.zeros((), jnp.int32), params, self.opt.init(params))

  def _params_of(self, state) -> Tree:
    return state.params

  def newest(self, state) -> Tree:
    """The newest weights as the state holds them (vocabulary padded)."""
    return state.params

  def params(self, state) -> Tree:
    """The newest weights (those the next batch runs on), natural shapes."""
    return jax.jit(self._unpad)(self.newest(state))

  def _step_fn(self, state, tokens, targets):
    raise NotImplementedError

  def _eval_fn(self, params, tokens, targets):
    raise NotImplementedError

  def _guarded_step(self, state, tokens, targets, go):
    """The step when `go`, else nothing: the state comes back as it went in.

    Lets a caller queue step k+1 before it has read step k's metrics and
    still stop on what they say (`go` = step k's `finite`): the state is
    donated, so the last good state must survive inside the device program.
    """
    metrics = jax.eval_shape(self._step_fn, state, tokens, targets)[1]
    idle = jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), metrics)
    new_state, metrics = lax.cond(go, lambda: self._step_fn(state, tokens, targets),
                                  lambda: (state, idle))
    return new_state, {**metrics, "ran": go}

  def _plain_step(self, state, tokens, targets):
    new_state, metrics = self._step_fn(state, tokens, targets)
    return new_state, {**metrics, "ran": jnp.asarray(True)}

  def _jitted_step(self, state, guarded: bool):
    if self._jit_step is None:
      self._jit_step = {}
    if guarded not in self._jit_step:
      shardings = self.state_shardings(state)
      # Metrics replicated everywhere, so every process can read them.
      fn = self._guarded_step if guarded else self._plain_step
      self._jit_step[guarded] = jax.jit(fn, donate_argnums=(0,),
                                        out_shardings=(shardings, self.replicated()))
    return self._jit_step[guarded]

  def step(self, state, tokens: jax.Array, targets: jax.Array, go: Optional[jax.Array] = None):
    """One training step on a [M, B/M, seq] batch; returns (state, metrics).

    With `go` (a boolean scalar, possibly still being computed on the
    devices) the step runs only when it is true; otherwise it returns its
    state unchanged, with `metrics['ran']` false. The guard is a separate
    program (it costs some memory where the state is rearranged, as 2bw's
    is); without `go` there is none. Dispatch returns at once; reading the
    metrics waits for the step.
    """
    if go is None:
      return self._jitted_step(state, False)(state, tokens, targets)
    return self._jitted_step(state, True)(state, tokens, targets, go)

  def lower_step(self, state, tokens, targets, go: Optional[jax.Array] = None):
    """The lowered (not yet compiled) step, for HLO inspection and compile timing."""
    if go is None:
      return self._jitted_step(state, False).lower(state, tokens, targets)
    return self._jitted_step(state, True).lower(state, tokens, targets, go)

  def _evaluate(self, params, tokens, targets):
    """Mean loss of a batch at `params` (the state's layout), jitted once."""
    if self._jit_eval is None:
      self._jit_eval = jax.jit(self._eval_fn, out_shardings=self.replicated())
    return self._jit_eval(params, tokens, targets)

  def eval_loss(self, state, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean loss of a [M, B/M, seq] batch at the newest weights (no update)."""
    return self._evaluate(self.newest(state), tokens, targets)

  def pending_loss(self, state) -> Optional[jax.Array]:
    """Loss of the batch whose report is still in flight (2bw), else None."""
    return None

  # --- resuming on another mesh ----------------------------------------------------
  #
  # A checkpoint's arrays keep their global shapes when only the data degree
  # changes, and orbax reshards them on restore. What a stage count decides:
  # the vocabulary padding (a multiple of S), pipedream's S weight versions
  # and 2bw's per-device in-flight buffers, which `relayout` handles.

  def check_relayout(self, saved_stages: int, saved_data: int) -> None:
    """Raises ValueError if a state saved on a saved_stages x saved_data mesh cannot resume here."""
    del saved_stages, saved_data

  def restored_fields(self, state: NamedTuple) -> NamedTuple:
    """A tree of bools shaped like `state`: the arrays a checkpoint of another mesh supplies.

    The others are rebuilt by `relayout`.
    """
    return jax.tree.map(lambda _: True, state)

  def relayout(self, restored: NamedTuple, fresh: NamedTuple) -> NamedTuple:
    """This mesh's state from `restored`, read off a checkpoint of another mesh.

    `fresh` is this mesh's initial state: it gives every array's shape and
    sharding, and the arrays `restored_fields` leaves out. A vocabulary axis
    padded for another stage count is cut back to the vocabulary and padded
    again with zeros (padding rows hold zeros under every optimizer, see
    `_vocab.pad_vocab`); every other array must already have its shape here.
    """
    def fit(x, like):
      if x.shape == like.shape:
        return x if x.sharding == like.sharding else jax.device_put(x, like.sharding)
      axes = [a for a, (m, n) in enumerate(zip(x.shape, like.shape)) if m != n]
      v = self.fns.vocab_size
      if (x.ndim != like.ndim or len(axes) != 1
          or min(x.shape[axes[0]], like.shape[axes[0]]) < v):
        raise ValueError(f"an array of shape {x.shape} in the checkpoint has shape "
                         f"{like.shape} on this mesh; only vocabulary padding may differ")
      resize = functools.partial(_vocab._resize, axis=axes[0], size=like.shape[axes[0]])  # pylint: disable=protected-access
      return jax.jit(lambda a: resize(lax.slice_in_dim(a, 0, v, axis=axes[0])),
                     out_shardings=like.sharding)(x)

    return jax.tree.map(fit, restored, fresh)


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

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, _acc_dtype(x)), params)
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

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.plan = step_plan(self.name, self.num_stages, self.num_microbatches)
    self.engine = Engine(self.fns, self.plan, stash=self.stash)

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
    """Sums a step's per-device gradient and loss sums into batch means."""
    n = self.num_microbatches * self.num_data
    g_blocks = jax.tree.map(lambda g: lax.psum(g, DATA) / n, g_blocks)
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

  def _flushed_grads(self, blocks, shared, tokens, targets, *, pick=None):
    """One flushed step of the plan (gpipe, 1f1b, pipedream): mean grads and loss.

    `blocks` and `shared` are parameter trees; with `pick`, rings with a
    leading version axis instead, and `pick(stage)` gives (the version of
    the stage's blocks, the shared versions the plan's indices choose from).
    Without it the one version is used as it is (no copy).
    """
    lead = () if pick is None else (None,)
    one = (lambda t: t) if pick is None else (lambda t: _pick(t, 0))
    x_like = self._act_like(one(shared), tokens)

    def body(blocks, shared, tokens, targets):
      if pick is None:
        blocks_v, shared_v = (blocks,), (shared,)
      else:
        b, sh = pick(lax.axis_index(STAGE))
        blocks_v, shared_v = (_pick(blocks, b),), tuple(_pick(shared, i) for i in sh)
      carry = self.engine.empty_carry(blocks_v[0], shared_v[0], x_like)
      carry = self.engine.run(blocks_v, shared_v, tokens, targets, carry)
      (g_blocks, g_shared), = carry.accs
      return self._reduce(g_blocks, g_shared, carry.losses[0])

    specs = self.param_specs(merge_params(blocks, shared), lead=lead)
    plain = self.param_specs(merge_params(one(blocks), one(shared)))
    fn = self._shard_map(body, (*split_params(specs), P(None, DATA), P(None, DATA)),
                         (*split_params(plain), P()))
    g_blocks, g_shared, loss = fn(blocks, shared, tokens, targets)
    return merge_params(g_blocks, g_shared), loss


class _OneVersion(_Pipelined):
  """gpipe and 1f1b: one weight version, a flush every step."""

  def _step_fn(self, state, tokens, targets):
    grads, loss = self._flushed_grads(*split_params(state.params), tokens, targets)
    params, opt_state, finite = self._update(state.params, state.opt_state, grads,
                                             jnp.array(True))
    metrics = self._grad_metrics(grads, loss, state.step, finite)
    return SyncState(state.step + 1, params, opt_state), metrics


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
    return _pick(state.versions, state.step % self.num_stages)

  def _step_fn(self, state, tokens, targets):
    k, s_ = state.step, self.num_stages
    blocks_v, shared_v = split_params(state.versions)
    lagged = lambda d: jnp.maximum(0, k - d) % s_
    grads, loss = self._flushed_grads(
        blocks_v, shared_v, tokens, targets,
        pick=lambda s: (lagged(s_ - 1 - s), (lagged(s_ - 1), k % s_)))
    newest = _pick(state.versions, k % s_)
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
  gradient and loss, and batch k's tokens stay in the state for step k+1.

  Final weights: after N steps the newest version is v[N], which equals N
  steps of one-device training with `jaxpipe.optim.delay(opt, 1)`; the last
  batch's gradient is in flight in both.
  """

  name = "2bw"
  loss_lag = 1

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
      return _per_device((c.fwd_buf, c.bwd_buf, c.stash, acc, c.losses[0]))

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
    m, f = self.num_microbatches, state.inflight
    specs = self._field_specs(state, state.cur)

    def body(prev, cur, fwd_buf, bwd_buf, stash, acc, loss, prev_tok, prev_tgt, tok, tgt, k,
             has_history):
      (prev_b, prev_s), (cur_b, cur_s) = split_params(prev), split_params(cur)
      acc_prev = _local(acc)
      carry = TickCarry(_local(fwd_buf), _local(bwd_buf), _local(stash),
                        (acc_prev, jax.tree.map(jnp.zeros_like, acc_prev)),
                        jnp.stack([_local(loss), jnp.zeros_like(_local(loss))]))
      window = (jnp.concatenate([prev_tok, tok]), jnp.concatenate([prev_tgt, tgt]))
      carry = self.engine.run((prev_b, cur_b), (prev_s, cur_s), *window, carry,
                              has_history=has_history, slot_base=(k * m) % self.plan.slots)
      g_blocks, g_shared, done = self._reduce(*carry.accs[0], carry.losses[0])
      return (merge_params(g_blocks, g_shared), done, *_per_device(
          (carry.fwd_buf, carry.bwd_buf, carry.stash, carry.accs[1], carry.losses[1])))

    inflight = specs.inflight
    fn = self._shard_map(
        body,
        (specs.prev, specs.cur, inflight.fwd_buf, inflight.bwd_buf, inflight.stash, inflight.acc,
         inflight.loss, inflight.tokens, inflight.targets, P(None, DATA), P(None, DATA), P(),
         P()),
        (specs.cur, P(), inflight.fwd_buf, inflight.bwd_buf, inflight.stash, inflight.acc,
         inflight.loss))
    grads, loss_done, fwd_buf, bwd_buf, stash, acc, loss = fn(
        state.prev, state.cur, f.fwd_buf, f.bwd_buf, f.stash, f.acc, f.loss, f.tokens,
        f.targets, tokens, targets, k, has_history)
    # Copies: the state is donated to the next step, the caller's batch is not.
    inflight = InFlight(fwd_buf, bwd_buf, stash, acc, loss, jnp.copy(tokens), jnp.copy(targets))
    return grads, loss_done, inflight

  def _step_fn(self, state, tokens, targets):
    k = state.step
    grads, loss_done, inflight = self._window(state, tokens, targets, k, k > 0)
    params, opt_state, finite = self._update(state.cur, state.opt_state, grads, k > 0)
    metrics = self._grad_metrics(grads, loss_done, k - 1, finite | (k == 0))
    return TwoBWState(k + 1, state.cur, params, opt_state, inflight), metrics

  def restored_fields(self, state):
    """Everything but the per-device in-flight buffers, whose layout is the mesh's."""
    keep = super().restored_fields(state)
    device = {n: jax.tree.map(lambda _: False, getattr(keep.inflight, n))
              for n, kind in InFlight.KINDS.items() if kind == "device"}
    return keep._replace(inflight=keep.inflight._replace(**device))

  def relayout(self, restored, fresh):
    """Re-pads the weights and rebuilds batch k-1's in-flight state on this mesh.

    At the start of step k the pipeline holds what step k-1 did of batch
    k-1, all of it at v[k-1] (`prev`): its first microbatches' stashes,
    activations in transit, partial gradient and loss. Rerunning step k-1's
    ticks without their batch-k-2 half, on v[k-1] and the saved batch k-1,
    makes the same state in this mesh's layout (equal up to the order of
    reductions), so step k applies batch k-1's gradient as it would have.
    """
    state = super().relayout(restored, fresh)
    k = int(state.step)
    if k == 0:
      return state
    f = state.inflight
    start = state._replace(cur=state.prev, inflight=fresh.inflight._replace(
        tokens=f.tokens, targets=f.targets))
    shardings = self.state_shardings(fresh).inflight
    rebuild = jax.jit(lambda st, tok, tgt: self._window(st, tok, tgt, st.step - 1,
                                                         jnp.asarray(False))[2],
                      out_shardings=shardings)
    return state._replace(inflight=rebuild(start, f.tokens, f.targets))

  def pending_loss(self, state):
    """Loss of the last batch run (batch step-1) at the version it ran on."""
    if int(state.step) == 0:
      return None
    return self._evaluate(state.prev, state.inflight.tokens, state.inflight.targets)


_CLASSES = {"none": NoPipeline, "gpipe": GPipe, "1f1b": OneFOneB, "2bw": TwoBW,
            "pipedream": PipeDream}


def make_schedule(name: str, fns: StageFns, optimizer: optax.GradientTransformation,
                  mesh: Mesh, num_microbatches: int, **kwargs) -> Schedule:
  """Returns the schedule called `name` on `mesh` (see module docstring).

  Keyword arguments: `stash` ('inputs' or 'residuals', see `Engine`);
  `shard_optimizer` (default True: ZeRO-1, the optimizer's parameter-shaped
  state split over 'data', see `Schedule.opt_param_specs`); `predict`
  (schedule none only: a function (params, opt_state) -> the weights the
  gradient is taken at, e.g. `jaxpipe.optim.predicted_params`; the update is
  applied to params, and evaluation uses params).
  """
  if name not in _CLASSES:
    raise ValueError(f"unknown schedule '{name}'; choose from {', '.join(SCHEDULE_NAMES)}")
  return _CLASSES[name](fns, optimizer, mesh, num_microbatches, **kwargs)
