"""The schedules' common base: the optimizer step with its NaN guard, jitting, resuming.

`Schedule` (see `_schedules` for the schedules) owns a mesh, the model's
`StageFns` and an optax optimizer; its state is one of the typed pytrees of
`_states`, whose fields' kinds (`KINDS`) give both the shardings `jax.jit`
places them with and the specs `shard_map` splits them by (`_placement`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh

from jaxpipe.pipeline import _vocab
from jaxpipe.pipeline._engine import DATA, PHASE, STAGE, StageFns
from jaxpipe.pipeline._names import experts_split
from jaxpipe.pipeline._placement import Placement
from jaxpipe.pipeline._states import SyncState, Tree, merge_params, split_params
from jaxpipe.pipeline._timetable import check_virtual_stages, min_microbatches

__all__ = ["Schedule", "StepProgram"]


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


def _all_finite(tree: Tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


class Schedule(Placement):
  """Base class: the guarded optimizer step, jitting, padding, resuming; shardings: `Placement`."""

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

  def _check_shared(self, shared: Tree) -> None:
    axes = jax.tree.structure(self.fns.vocab_axes, is_leaf=lambda a: a is None)
    if jax.tree.structure(shared) != axes:
      raise ValueError("StageFns.vocab_axes must have the structure of the non-block "
                       f"parameters: {jax.tree.structure(shared)} vs {axes}")
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
