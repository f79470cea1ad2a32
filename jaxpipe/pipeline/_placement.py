"""Where a schedule's arrays live: shardings and `shard_map` specs from the state's kinds.

`Placement` is a base of `Schedule`: the specs of the parameters (blocks over
'stage' on their layer axis, shared leaves over 'stage' on their vocabulary
axis, experts over 'data' under expert parallelism), of the optimizer state
(ZeRO-1 over 'data'), and of every field of a typed state by its kind
(`_states`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpipe.pipeline._engine import DATA, STAGE, no_experts
from jaxpipe.pipeline._states import Tree, merge_params, split_params

__all__ = ["Placement"]


@dataclasses.dataclass(frozen=True)
class _Spec:
  """A parameter's spec and rank, one leaf for `optax.tree_map_params`."""
  spec: P
  ndim: int


def _splits_data(spec: P) -> bool:
  return any(e == DATA or (isinstance(e, tuple) and DATA in e) for e in spec)


def _data_split(shape: tuple, spec: P, num_stages: int, num_data: int) -> P:
  """`spec` with 'data' added on the first axis of `shape` that can take it (see
  `Placement.opt_param_specs`); `spec` itself where none can or it has 'data' already."""
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


class Placement:
  """The shardings and specs of a schedule's parameters, optimizer state and typed states.

  A base of `Schedule`, which sets what these read: `mesh`, `fns` (the
  `StageFns`), `opt`, `pipelined`, `num_stages`, `num_data`,
  `shard_optimizer`, `expert_parallel`, and `_params_of(state)`.
  """

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
