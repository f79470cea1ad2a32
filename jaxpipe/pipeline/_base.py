"""The schedules' common base: mesh, typed states, their shardings, the guarded update.

`Schedule` (see `_schedules` for the five schedules) owns a mesh, the
model's `StageFns` and an optax optimizer; its state is one of the typed
pytrees here, whose fields' kinds (`KINDS`) give both the shardings `jax.jit`
places them with and the specs `shard_map` splits them by.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpipe.pipeline import _vocab
from jaxpipe.pipeline._engine import DATA, PHASE, STAGE, StageFns, no_experts
from jaxpipe.pipeline._mesh import make_mesh
from jaxpipe.pipeline._names import experts_split
from jaxpipe.pipeline._timetable import check_virtual_stages, min_microbatches

Tree = Any

__all__ = ["Schedule", "StepProgram", "SyncState", "FlushedState", "PipeDreamState", "TwoBWState",
           "InFlight", "make_mesh", "split_params", "merge_params"]


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
  """State of none, 1f1b and interleaved.

  Attributes:
    step: updates done.
    params: the weights.
    opt_state: the optimizer's state.
  """
  step: jax.Array
  params: Tree
  opt_state: Tree

  KINDS = {"step": "step", "params": "params", "opt_state": "opt"}


class FlushedState(NamedTuple):
  """State of gpipe and zb1: `SyncState`'s fields and the stash rings.

  Attributes:
    step: updates done.
    params: the weights.
    opt_state: the optimizer's state.
    rings: per device ([S, D, ...] each leaf): the stash rings a step's
      ticks write and read (the forward's stash, and W's stash or None).
      They hold nothing from one step to the next (each step writes a slot
      before it reads it); they are state so that a step neither allocates
      nor zero-fills them (on CPUs a step's block of over 64 MiB is mapped
      afresh, and faulted in, at every step). A checkpoint leaves them out.
      With `ScheduleOptions.rings_in_state` only; otherwise a step makes
      its rings and the state is a `SyncState`.
  """
  step: jax.Array
  params: Tree
  opt_state: Tree
  rings: Tree

  KINDS = {"step": "step", "params": "params", "opt_state": "opt", "rings": "device"}


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


class StepProgram:
  """A lowered or compiled step (`Schedule.lower_step`) that takes the state as `step` does.

  The jitted step may take the state's fields in another order
  (`Schedule.donation_order`); calling this with a state, tokens and targets
  (and `go` for the guarded step) passes them as the program wants them.
  Everything else (`compile`, `as_text`, `memory_analysis`, ...) is the
  wrapped JAX object's, `compile` returning a `StepProgram` again.
  """

  def __init__(self, inner: Any, args: Any, scope: Callable[[], Any] = contextlib.nullcontext):
    self._inner, self._args, self._scope = inner, args, scope

  def compile(self, *a, **k) -> "StepProgram":
    """The compiled step (`jax.stages.Lowered.compile`, inside the schedule's
    `ScheduleOptions.compile_scope`), wrapped likewise."""
    with self._scope():
      return StepProgram(self._inner.compile(*a, **k), self._args, self._scope)

  def __call__(self, state, *rest):
    """Runs the compiled step on `state` (and tokens, targets, `go`): (state, metrics)."""
    return self._inner(self._args(state), *rest)

  def __getattr__(self, name):
    if name.startswith("_"):  # not yet set (a copy, an unpickling): no recursion
      raise AttributeError(name)
    return getattr(self._inner, name)


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


def pick_version(tree: Tree, index) -> Tree:
  """Version `index` of a ring of weight versions (each leaf's leading axis)."""
  return jax.tree.map(lambda v: v[index], tree)


def local_block(tree: Tree) -> Tree:
  """A per-device tree's own block: each leaf without its [stage, data] axes of size 1."""
  return jax.tree.map(lambda x: x[0, 0], tree)


def per_device(tree: Tree) -> Tree:
  """The inverse of `local_block`: each leaf given leading [stage, data] axes of size 1."""
  return jax.tree.map(lambda x: x[None, None], tree)


def _all_finite(tree: Tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


@dataclasses.dataclass(frozen=True)
class _Spec:
  """A parameter's spec and rank, one leaf for `optax.tree_map_params`."""
  spec: P
  ndim: int


def _splits_data(spec: P) -> bool:
  return any(e == DATA or (isinstance(e, tuple) and DATA in e) for e in spec)


def _data_split(shape: tuple, spec: P, num_stages: int, num_data: int) -> P:
  """`spec` with 'data' added on the first axis of `shape` that can take it (see
  `Schedule.opt_param_specs`); `spec` itself where none can or it has 'data' already."""
  if _splits_data(spec):
    return spec
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


class Schedule:
  """Base class: shardings, the optimizer step with its NaN guard, and jitting."""

  name = "base"
  loss_lag = 0
  pipelined = True

  def __init__(self, fns: StageFns, optimizer: optax.GradientTransformation, mesh: Mesh,
               num_microbatches: int, *, stash: str = "inputs", shard_optimizer: bool = True,
               expert_parallel: bool = True, vocab_parallel: bool = True,
               predict: Optional[Any] = None, virtual_stages: int = 1,
               overlap_sends: Optional[bool] = None, rings_in_state: bool = False,
               compile_scope: Optional[Callable[[], Any]] = None):
    if not vocab_parallel:
      # The shared parameters whole on every stage: the embedding is used on
      # the first, the head on the last (see `Engine`).
      fns = fns._replace(vocab_axes=jax.tree.map(lambda _: None, fns.vocab_axes,
                                                 is_leaf=lambda a: a is None))
    self.vocab_parallel = vocab_parallel
    self.compile_scope = compile_scope or contextlib.nullcontext
    self.rings_in_state = rings_in_state
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
    # One expert stands for "any": whether the model has experts at all is for
    # the blocks' `expert_axes` to say (None on every leaf of a dense model).
    self.expert_parallel = experts_split(self.name if self.pipelined else "none",
                                         self.num_data, 1, expert_parallel)
    if not self.pipelined and self.num_stages != 1:
      raise ValueError(f"schedule '{self.name}' runs without stages; got a mesh of "
                       f"{self.num_stages} stages")
    self.virtual_stages = virtual_stages
    # Transfers placed for overlap where they run beside the kernels (GPUs,
    # TPUs: `Engine(overlap=...)`); on CPU devices a collective is a
    # barrier, and the tick ends with one exchange.
    self.overlap_sends = (mesh.devices.flat[0].platform != "cpu" if overlap_sends is None
                          else overlap_sends)
    check_virtual_stages(self.name, self.num_stages, num_microbatches, virtual_stages)
    need = (min_microbatches(self.name, self.num_stages, virtual_stages)
            if self.pipelined else 1)
    if num_microbatches < need:
      raise ValueError(f"schedule {self.name} with {self.num_stages} stages needs at least "
                       f"{need} microbatches per step, got {num_microbatches}")
    # The vocabulary as the state holds it: padded to a multiple of S.
    self.vocab = (_vocab.padded_vocab(fns.vocab_size, self.num_stages)
                  if self.pipelined and vocab_parallel else fns.vocab_size)
    self._jit_step = None
    self._compiled_steps: set[bool] = set()  # step kinds (guarded or not) called once
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
    vocabulary axis; the rest is replicated. With expert parallelism the
    experts' axis of a block leaf (`StageFns.expert_axes`) is also split over
    'data'. Without a pipeline, replicated.
    """
    blocks, shared = split_params(params)
    if not self.pipelined:
      return jax.tree.map(lambda _: P(), params)
    vocab = lambda a: P(*lead, *([None] * a), STAGE) if a is not None else P()
    return merge_params(jax.tree.map(lambda a: P(*lead, STAGE, *([None] * (a - 1)), DATA)
                                     if a is not None else P(*lead, STAGE),
                                     self.expert_axes(blocks, len(lead)),
                                     is_leaf=lambda a: a is None),
                        jax.tree.map(vocab, self.fns.vocab_axes, is_leaf=lambda a: a is None))

  def expert_axes(self, blocks: Tree, lead: int = 0) -> Tree:
    """Per block leaf: its expert axis if this schedule splits it over 'data', else None.

    The axis is counted in the stacked leaf, behind `lead` extra leading axes
    that `blocks` carries (pipedream's versions). Raises ValueError if the
    replicas cannot share the experts evenly.
    """
    axes = self._split_experts(blocks)

    def check(a, x):
      if a is not None and x.shape[a + lead] % self.num_data:
        raise ValueError(f"expert parallelism splits the {x.shape[a + lead]} experts over "
                         f"{self.num_data} data replicas, which does not divide them; "
                         "set mesh.expert_parallel=false or another mesh.data")
      return a
    return jax.tree.map(check, axes, blocks, is_leaf=lambda a: a is None)

  def _split_experts(self, blocks: Tree) -> Tree:
    return (self.fns.expert_axes if self.expert_parallel else no_experts)(blocks)

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
    no such axis stays replicated over 'data'. A leaf whose parameter is
    split over 'data' already (experts under expert parallelism) keeps its
    parameter's spec: each replica updates the experts it holds.
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

    with jax.named_scope(PHASE["optimizer"]):
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
    """A parameter-shaped field of the state (for the optimizer state's structure)."""
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

  # The order in which the jitted step takes the state's fields, where it is
  # not the state's own (None). JAX pairs each output with the first donated
  # input of its shape and sharding, in the order of the inputs, and XLA
  # copies wherever a step's result is not the value that its paired buffer
  # held. 2bw returns its input `cur` as the output `prev`: taking `cur`
  # before `prev` gives `prev` the buffer it already lives in and the new
  # `cur` the old `prev`'s, so a step moves no weights.
  donation_order: Optional[tuple[str, ...]] = None

  def _jitted_step(self, state, guarded: bool):
    """(the jitted step, state -> its first argument) for the guarded or the plain step."""
    if self._jit_step is None:
      self._jit_step = {}
    if guarded not in self._jit_step:
      shardings = self.state_shardings(state)
      # Metrics replicated everywhere, so every process can read them.
      fn = self._guarded_step if guarded else self._plain_step
      order = self.donation_order
      if order is None:
        jitted, args, keep_unused = fn, (lambda st: st), False
      else:
        kind = type(state)
        if sorted(order) != sorted(kind._fields):
          raise ValueError(f"{type(self).__name__}.donation_order {order} does not name the "
                           f"fields of {kind.__name__} {kind._fields}")

        def jitted(fields, *rest):
          return fn(kind(**dict(zip(order, fields))), *rest)

        args = lambda st: tuple(getattr(st, n) for n in order)
        # keep_unused: a field the step does not read (2bw's `prev` embedding:
        # it embeds once per step, at `cur`) must still be an argument, or its
        # output would take the next field's buffer of that shape and XLA
        # would copy again.
        keep_unused = True
      self._jit_step[guarded] = (jax.jit(jitted, donate_argnums=(0,), keep_unused=keep_unused,
                                         out_shardings=(shardings, self.replicated())),
                                 args)
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
    guarded = go is not None
    fn, args = self._jitted_step(state, guarded)
    # The first call of each kind compiles, inside `compile_scope` (the CPU
    # tuning's pins the compiler's threads); a later call with inputs of
    # other types would compile outside it.
    first = guarded not in self._compiled_steps
    with self.compile_scope() if first else contextlib.nullcontext():
      out = fn(args(state), tokens, targets, *((go,) if guarded else ()))
    self._compiled_steps.add(guarded)
    return out

  def lower_step(self, state, tokens, targets, go: Optional[jax.Array] = None):
    """The lowered (not yet compiled) step, for HLO inspection and compile timing.

    A `StepProgram`: its `compile()` can be called as `step` is, with the state.
    """
    fn, args = self._jitted_step(state, go is not None)
    return StepProgram(fn.lower(args(state), tokens, targets, *(() if go is None else (go,))),
                       args, self.compile_scope)

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

  # --- checkpoints and resuming ------------------------------------------------
  #
  # A checkpoint holds what cannot be recomputed (`saved_fields`); `resume`
  # makes the state to continue from out of what was read, on this mesh or
  # another. A checkpoint's arrays keep their global shapes when only the
  # data degree changes, and orbax reshards them on restore. What a stage
  # count decides: the vocabulary padding (a multiple of S), pipedream's S
  # weight versions and interleaved's layer order; 2bw's per-device in-flight
  # buffers are not saved at all.

  def check_relayout(self, saved_stages: int, saved_data: int) -> None:
    """Raises ValueError if a state saved on a saved_stages x saved_data mesh cannot resume here."""
    del saved_stages, saved_data

  def saved_fields(self, state: NamedTuple) -> NamedTuple:
    """A tree of bools shaped like `state`: the arrays a checkpoint holds.

    The others are recomputed from them by `resume`.
    """
    return jax.tree.map(lambda _: True, state)

  def checkpointed(self, state: NamedTuple) -> NamedTuple:
    """`state` as a checkpoint holds it: the arrays `saved_fields` leaves out are None.

    Takes arrays or `jax.eval_shape` structs (the planner sizes checkpoints with it).
    """
    return jax.tree.map(lambda keep, x: x if keep else None, self.saved_fields(state), state)

  def resume(self, restored: NamedTuple, fresh: NamedTuple, *,
             guarded: bool = False, saved_stages: Optional[int] = None) -> NamedTuple:
    """The state to continue from, out of `restored`, read off a checkpoint of any mesh.

    `restored` holds the checkpoint's arrays where `saved_fields` says so
    and `fresh`'s elsewhere; `fresh` is this mesh's initial state: it gives
    every array's shape and sharding, and its buffers may be consumed. A
    vocabulary axis padded for another stage count is cut back to the
    vocabulary and padded again with zeros (padding rows hold zeros under
    every optimizer, see `_vocab.pad_vocab`); every other array must already
    have its shape here. `guarded`: whether the run's steps take `go` (see
    `step`), so that a recomputation runs the very program they run.
    `saved_stages`: the stage count the checkpoint was written with, for a
    schedule whose layout depends on it (`Interleaved`); None = this one.
    """
    del guarded, saved_stages

    def fit(x, like):
      if x.shape == like.shape:
        return x if x.sharding == like.sharding else jax.device_put(x, like.sharding)
      axes = [a for a, (m, n) in enumerate(zip(x.shape, like.shape)) if m != n]
      v = self.fns.vocab_size
      if (x.ndim != like.ndim or len(axes) != 1
          or min(x.shape[axes[0]], like.shape[axes[0]]) < v):
        raise ValueError(f"an array of shape {x.shape} in the checkpoint has shape "
                         f"{like.shape} on this mesh; only vocabulary padding may differ")
      resize = functools.partial(_vocab.resize_axis, axis=axes[0], size=like.shape[axes[0]])
      return jax.jit(lambda a: resize(lax.slice_in_dim(a, 0, v, axis=axes[0])),
                     out_shardings=like.sharding)(x)

    return jax.tree.map(fit, restored, fresh)
