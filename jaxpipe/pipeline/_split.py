"""A stage's backward split into B (the input's gradient) and W (the weights').

Zero-bubble schedules (ZB-H1, Qi et al., arXiv 2401.10241) run a stage's
backward in two halves: B, whose input cotangent the previous stage waits
for, and W, the weight gradient, which can wait and fill the pipeline's
drain. The split is only worth it if B and W together cost what one backward
costs: W must not recompute the forward, nor the cotangent chain through the
stage's layers that B has already computed (the weight gradient of a layer
needs the cotangent of that layer's output).

`SplitStage` does it for any stage function, without help from the model.
It traces the pullback of `jax.vjp(fn, blocks, x)` to a jaxpr whose inputs
are the forward's residuals and the output cotangent and whose outputs are
(g_blocks, g_x), and partitions its equations:

- B: every equation g_x depends on. Where an equation that B needs also
  feeds g_blocks (the backward `lax.scan` over stacked layers, a `jit` or
  `checkpoint` call), it is split in two, recursively: a scan becomes a
  B scan (the input-cotangent carry and what W needs of each iteration,
  stacked) and a W scan over the same iterations.
- W: the equations only g_blocks depends on: per weight use y = x.w the
  contraction x^T.dy. Two kinds of W-only work run in B where that keeps
  W's stash smaller: elementwise and reducing steps of a gradient (an
  RMSNorm scale's sum over tokens of dy * x_hat: a [dim] to keep instead of
  two activations) and forward values recomputed under remat that only W
  reads (the attention output p.v: smaller than p).
- W's stash: the values W reads that B (or the forward) computed: per
  weight use its input x and its output cotangent dy.

So each equation of the unsplit backward runs exactly once, in B or in W,
and neither half runs the forward (flops(B) + flops(W) = flops(backward),
which `tests/test_split.py` checks on XLA's compiled programs).

With `stash='inputs'` (the forward keeps only the stage input)
`backward_input_from_inputs` recomputes the forward once, in B, which keeps
what W needs: W never recomputes anything.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import jax
import numpy as np
from jax import lax
from jax.extend import core
from jax.extend import source_info_util

Tree = Any

__all__ = ["SplitStage", "split_pullback", "SplitPullback", "VjpLayout", "forward_with_vjp",
           "rebuild_vjp"]

# Primitives that call a jaxpr once with their operands (no iteration): a
# split evaluates the two halves of the called jaxpr inline.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr",
          "remat2": "jaxpr"}


# W's own work: the weights' contractions.
_MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general")


def _is_var(v) -> bool:
  return isinstance(v, core.Var) and not isinstance(v, core.DropVar)


def _open(jaxpr):
  """(open jaxpr, consts) of a Jaxpr or ClosedJaxpr."""
  if isinstance(jaxpr, core.ClosedJaxpr):
    return jaxpr.jaxpr, tuple(jaxpr.consts)
  return jaxpr, ()


class _Plan(NamedTuple):
  """How a jaxpr's equations divide between B and W.

  Attributes:
    jaxpr: the open jaxpr; consts: its constants (both halves read them).
    roles: per equation 'B', 'W', None (neither needs it) or a split
      (`_ScanSplit`, `_CallSplit`) that runs a part in each.
    b_want, w_want: per outvar, whether B (resp. W) returns it.
    b_in, w_in: per invar, whether B (resp. W) reads it.
    boundary: variables B defines that W reads (W's stash at this level).
  """
  jaxpr: Any
  consts: tuple
  roles: tuple
  b_want: tuple
  w_want: tuple
  b_in: tuple
  w_in: tuple
  boundary: tuple


def _nbytes(v) -> int:
  if not _is_var(v):
    return 0
  return int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize


def _analyse(jaxpr, consts, b_want: Sequence[bool], w_want: Sequence[bool],
             lin_in: Optional[Sequence[bool]] = None) -> _Plan:
  """The plan of `jaxpr` when B must return outvars `b_want` and W those of `w_want`.

  `lin_in`: per invar, whether it depends on the cotangents (all, if None).
  """
  if lin_in is None:
    lin_in = [True] * len(jaxpr.invars)
  # What depends on the cotangents; the rest is the forward recomputed
  # (rematerialisation inside the backward).
  lin = {v for v, l in zip(jaxpr.invars, lin_in) if l}
  eqn_lin = []
  for eqn in jaxpr.eqns:
    l = any(_is_var(v) and v in lin for v in eqn.invars)
    eqn_lin.append(l)
    if l:
      lin.update(eqn.outvars)
  need_b, need_w = set(), set()
  for v, b, w in zip(jaxpr.outvars, b_want, w_want):
    if _is_var(v):
      if b:
        need_b.add(v)
      if w:
        need_w.add(v)
  roles = [None] * len(jaxpr.eqns)
  for i in reversed(range(len(jaxpr.eqns))):
    eqn = jaxpr.eqns[i]
    ob = [_is_var(v) and v in need_b for v in eqn.outvars]
    ow = [_is_var(v) and v in need_w and not b for v, b in zip(eqn.outvars, ob)]
    role = None
    if any(ob) and any(ow):
      role = _split_eqn(eqn, ob, ow, [_is_var(v) and v in lin for v in eqn.invars])
    if role is not None:
      for v, rb, rw in zip(eqn.invars, role.b_in, role.w_in):
        if _is_var(v):
          if rb:
            need_b.add(v)
          if rw:
            need_w.add(v)
    elif any(ob):
      # An equation B needs runs whole in B; any output only W reads is
      # then part of W's stash.
      role = "B"
      need_b.update(v for v in eqn.invars if _is_var(v))
    elif any(ow):
      role = "W"
      need_w.update(v for v in eqn.invars if _is_var(v))
    roles[i] = role
  # Two kinds of W's work run in B instead when that makes W's stash smaller
  # (their flops move, they are not repeated):
  # - a recomputed forward value only W reads (remat's attention output p.v,
  #   a normalised input), when it is no bigger than its operands;
  # - an elementwise or reducing step of a weight's gradient (an RMSNorm
  #   scale's dy * x_hat summed over tokens), when it is no bigger than the
  #   operands that no other W work reads. Matmuls stay in W: they are what
  #   W is for.
  readers = {}
  for v in jaxpr.outvars:
    if _is_var(v):
      readers[v] = readers.get(v, 0) + len(jaxpr.outvars)  # never leaves the stash
  for eqn, role in zip(jaxpr.eqns, roles):
    if role == "W" or (role is not None and role != "B"):
      ins = eqn.invars if role == "W" else [v for v, r in zip(eqn.invars, role.w_in) if r]
      for v in {v for v in ins if _is_var(v)}:
        readers[v] = readers.get(v, 0) + 1
  b_defined = set(jaxpr.invars) | set(jaxpr.constvars)
  for i, eqn in enumerate(jaxpr.eqns):
    role = roles[i]
    operands = {v for v in eqn.invars if _is_var(v)}
    if role == "W" and all(v in b_defined for v in operands):
      out = sum(map(_nbytes, eqn.outvars))
      if not eqn_lin[i]:
        move = out <= sum(map(_nbytes, operands))
      else:
        move = (eqn.primitive.name not in _MATMULS and not any(core.jaxprs_in_params(eqn.params))
                and out <= sum(_nbytes(v) for v in operands if readers.get(v) == 1))
      if move:
        roles[i] = role = "B"
        for v in operands:
          readers[v] -= 1
    if role == "B":
      b_defined.update(eqn.outvars)
    elif role is not None and role != "W":
      b_defined.update(v for v, d in zip(eqn.outvars, role.b_defs) if d)
  # What each half reads, now that the roles are final.
  need_b = {v for v, b in zip(jaxpr.outvars, b_want) if b and _is_var(v)}
  need_w = {v for v, w in zip(jaxpr.outvars, w_want) if w and _is_var(v)}
  for eqn, role in zip(jaxpr.eqns, roles):
    if role is None:
      continue
    if role == "B":
      need_b.update(v for v in eqn.invars if _is_var(v))
    elif role == "W":
      need_w.update(v for v in eqn.invars if _is_var(v))
    else:
      need_b.update(v for v, r in zip(eqn.invars, role.b_in) if r and _is_var(v))
      need_w.update(v for v, r in zip(eqn.invars, role.w_in) if r and _is_var(v))
  boundary = []
  for eqn in jaxpr.eqns:  # definition order: deterministic
    for v in eqn.outvars:
      if _is_var(v) and v in b_defined and v in need_w and v not in boundary:
        boundary.append(v)
  b_in = tuple(v in need_b for v in jaxpr.invars)
  w_in = tuple(v in need_w for v in jaxpr.invars)
  return _Plan(jaxpr, consts, tuple(roles), tuple(b_want), tuple(w_want), b_in, w_in,
               tuple(boundary))


def _split_eqn(eqn, ob, ow, lin_in):
  """A split of an equation whose outputs both halves need, or None (it runs whole in B)."""
  name = eqn.primitive.name
  if name == "scan":
    return _ScanSplit.make(eqn, ob, ow, lin_in)
  if name in _CALLS and _CALLS[name] in eqn.params:
    return _CallSplit.make(eqn, ob, ow, lin_in)
  return None


def _bind(eqn, invals):
  """Runs one equation on `invals` in the current trace (as `jax.core.eval_jaxpr` does)."""
  params = eqn.primitive.get_bind_params(eqn.params)
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), \
      eqn.ctx.manager:
    out = eqn.primitive.bind(*invals, **params)
  return out if eqn.primitive.multiple_results else [out]


def _read(env, v):
  return v.val if isinstance(v, core.Literal) else env[v]


def _eval_b(plan: _Plan, args: Sequence[Any]):
  """B's half of `plan`: (the outvars B returns, W's stash at this level)."""
  env = dict(zip(plan.jaxpr.constvars, plan.consts))
  env.update((v, a) for v, a, used in zip(plan.jaxpr.invars, args, plan.b_in) if used)
  nested = []
  for eqn, role in zip(plan.jaxpr.eqns, plan.roles):
    if role is None or role == "W":
      continue
    if role == "B":
      outs = _bind(eqn, [_read(env, v) for v in eqn.invars])
      env.update((v, o) for v, o in zip(eqn.outvars, outs) if _is_var(v))
      continue
    ins = [_read(env, v) if used else None for v, used in zip(eqn.invars, role.b_in)]
    outs, stash = role.run_b(ins)
    defs = [v for v, d in zip(eqn.outvars, role.b_defs) if d]
    env.update((v, o) for v, o in zip(defs, outs) if _is_var(v))
    nested.append(stash)
  outs = [_read(env, v) for v, b in zip(plan.jaxpr.outvars, plan.b_want) if b]
  return outs, (tuple(env[v] for v in plan.boundary), tuple(nested))


def _eval_w(plan: _Plan, args: Sequence[Any], stash) -> list:
  """W's half of `plan`: the outvars W returns, from its invars `args` and B's `stash`."""
  values, nested = stash
  env = dict(zip(plan.jaxpr.constvars, plan.consts))
  env.update((v, a) for v, a, used in zip(plan.jaxpr.invars, args, plan.w_in) if used)
  env.update(zip(plan.boundary, values))
  nested = iter(nested)
  for eqn, role in zip(plan.jaxpr.eqns, plan.roles):
    if role is None or role == "B":
      continue
    if role == "W":
      outs = _bind(eqn, [_read(env, v) for v in eqn.invars])
      env.update((v, o) for v, o in zip(eqn.outvars, outs) if _is_var(v))
      continue
    ins = [_read(env, v) if used else None for v, used in zip(eqn.invars, role.w_in)]
    outs = role.run_w(ins, next(nested))
    defs = [v for v, d in zip(eqn.outvars, role.w_defs) if d]
    env.update((v, o) for v, o in zip(defs, outs) if _is_var(v))
  return [_read(env, v) for v, w in zip(plan.jaxpr.outvars, plan.w_want) if w]


class _CallSplit(NamedTuple):
  """A `jit`/`checkpoint` call split in two, each half evaluated inline.

  b_in, w_in: per operand, whether B (resp. W) reads it; b_defs, w_defs: per
  output, which half defines it.
  """
  plan: _Plan
  b_in: tuple
  w_in: tuple
  b_defs: tuple
  w_defs: tuple

  @staticmethod
  def make(eqn, ob, ow, lin_in):
    """The split of a call equation whose outputs `ob` B needs and `ow` only W needs.

    `lin_in`: per operand, whether it depends on the cotangents.
    """
    body, consts = _open(eqn.params[_CALLS[eqn.primitive.name]])
    plan = _analyse(body, consts, ob, ow, lin_in)
    return _CallSplit(plan, plan.b_in, plan.w_in, tuple(ob), tuple(ow))

  def run_b(self, ins):
    """(B's outputs, stash) of the call."""
    return _eval_b(self.plan, ins)

  def run_w(self, ins, stash):
    """W's outputs of the call."""
    return _eval_w(self.plan, ins, stash)


class _ScanSplit(NamedTuple):
  """A `lax.scan` split into a B scan and a W scan over the same iterations.

  The carries divide: a B carry is one B reads or returns (the input
  cotangent of the layers), a W carry one only W needs (the sum of a
  weight's gradient over iterations, for a weight every iteration shares).
  The B scan also returns, stacked over iterations, what its iterations
  computed and the W iterations read; the W scan takes them as inputs.

  Attributes:
    plan: the body's plan; params: the scan's parameters.
    bc: per carry, whether it is B's; wc: whether it is W's.
    carry_to_w: per carry, whether W's iterations read its per-iteration value
      although it is B's (B then returns it stacked).
    b_in, w_in, b_defs, w_defs: as in `_CallSplit`, over the scan's operands
      (consts, carries, xs) and outputs (carries, ys).
  """
  plan: _Plan
  params: dict
  bc: tuple
  wc: tuple
  carry_to_w: tuple
  b_in: tuple
  w_in: tuple
  b_defs: tuple
  w_defs: tuple

  @staticmethod
  def make(eqn, ob, ow, lin_in):
    """The split of a scan equation whose outputs `ob` B needs and `ow` only W needs.

    `lin_in`: per operand, whether it depends on the cotangents (every
    carry is taken to: a carry may pick them up in any iteration).
    """
    p = eqn.params
    nc, ncar = p["num_consts"], p["num_carry"]
    lin_in = list(lin_in[:nc]) + [True] * ncar + list(lin_in[nc + ncar:])
    body, consts = _open(p["jaxpr"])
    bc = list(ob[:ncar])
    wc = [w and not b for w, b in zip(ow[:ncar], bc)]
    # A carry B's iterations read must be B's; one W's iterations read must
    # be returned by W's: grow both sets until the body's plan agrees.
    while True:
      plan = _analyse(body, consts, bc + list(ob[ncar:]), wc + list(ow[ncar:]), lin_in)
      b_read = plan.b_in[nc:nc + ncar]
      w_read = plan.w_in[nc:nc + ncar]
      new_bc = [b or r for b, r in zip(bc, b_read)]
      new_wc = [not b and (w or r) for b, w, r in zip(new_bc, wc, w_read)]
      if new_bc == bc and new_wc == wc:
        break
      bc, wc = new_bc, new_wc
    carry_to_w = tuple(b and r for b, r in zip(bc, w_read))
    b_in = plan.b_in[:nc] + tuple(bc) + plan.b_in[nc + ncar:]
    w_in = plan.w_in[:nc] + tuple(wc) + plan.w_in[nc + ncar:]
    ys_b, ys_w = tuple(ob[ncar:]), tuple(w and not b for b, w in zip(ob[ncar:], ow[ncar:]))
    return _ScanSplit(plan, dict(p), tuple(bc), tuple(wc), carry_to_w, b_in, w_in,
                      tuple(bc) + ys_b, tuple(wc) + ys_w)

  def _loop(self, body, init, xs):
    p = self.params
    return lax.scan(body, init, xs, length=p["length"], reverse=p["reverse"],
                    unroll=p["unroll"])

  def run_b(self, ins):
    """(B's outputs: its carries then its ys, stash stacked over iterations)."""
    nc, ncar = self.params["num_consts"], self.params["num_carry"]
    consts, carry, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
    xs_used = self.plan.b_in[nc + ncar:]

    def body(c, x):
      it_c = iter(c)
      it_x = iter(x)
      args = (list(consts) + [next(it_c) if b else None for b in self.bc]
              + [next(it_x) if u else None for u in xs_used])
      outs, stash = _eval_b(self.plan, args)
      nb = sum(self.bc)
      to_w = tuple(a for a, t in zip(args[nc:nc + ncar], self.carry_to_w) if t)
      return tuple(outs[:nb]), (tuple(outs[nb:]), stash, to_w)

    init = tuple(c for c, b in zip(carry, self.bc) if b)
    xs_b = tuple(x for x, u in zip(xs, xs_used) if u)
    final, (ys, stash, to_w) = self._loop(body, init, xs_b)
    return list(final) + list(ys), (stash, to_w)

  def run_w(self, ins, stash):
    """W's outputs (its carries then its ys), from its operands and B's stacked stash."""
    nc, ncar = self.params["num_consts"], self.params["num_carry"]
    consts, carry, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
    xs_used = self.plan.w_in[nc + ncar:]
    b_stash, to_w = stash

    def body(c, x):
      x_ins, it_stash, it_to_w = x
      it_c, it_b, it_x = iter(c), iter(it_to_w), iter(x_ins)
      args = (list(consts)
              + [next(it_c) if w else next(it_b) if t else None
                 for w, t in zip(self.wc, self.carry_to_w)]
              + [next(it_x) if u else None for u in xs_used])
      outs = _eval_w(self.plan, args, it_stash)
      nw = sum(self.wc)
      return tuple(outs[:nw]), tuple(outs[nw:])

    init = tuple(c for c, w in zip(carry, self.wc) if w)
    xs_w = tuple(x for x, u in zip(xs, xs_used) if u)
    final, ys = self._loop(body, init, (xs_w, b_stash, to_w))
    return list(final) + list(ys)


class SplitPullback(NamedTuple):
  """A traced pullback split into B and W (`split_pullback`).

  Attributes:
    plan: the partition of the pullback's jaxpr.
    num_inputs: how many flat inputs the pullback takes.
    b_out, w_out: indices of the pullback's flat outputs B (resp. W) returns.
  """
  plan: _Plan
  num_inputs: int
  b_out: tuple
  w_out: tuple

  def backward_b(self, args: Sequence[Any], given: Sequence[int] = ()):
    """(B's outputs, W's stash) from the pullback's flat inputs.

    W's stash holds the inputs W reads itself (by position), except those
    at positions `given` (W's caller passes them again, e.g. the weights),
    and what B computed for it.
    """
    outs, inner = _eval_b(self.plan, args)
    given = set(given)
    reads = tuple(a for i, (a, used) in enumerate(zip(args, self.plan.w_in))
                  if used and i not in given)
    return outs, (reads, inner)

  def backward_w(self, stash, given: Optional[dict] = None):
    """W's outputs from its stash and `given` ({position: value}): the inputs B left out of it."""
    reads, inner = stash
    given = given or {}
    args, it = [], iter(reads)
    for i, used in enumerate(self.plan.w_in):
      args.append(given[i] if i in given else next(it) if used else None)
    return _eval_w(self.plan, args, inner)


def split_pullback(closed_jaxpr, b_out: Sequence[int],
                   cotangents: Optional[Sequence[int]] = None) -> SplitPullback:
  """Splits a jaxpr (a traced backward) into B, returning the outputs `b_out`, and W, the rest.

  Generic: any jaxpr, with `lax.scan`, `jit` and `checkpoint` calls split
  recursively where both halves need their outputs; any other equation that
  B needs runs whole in B. `cotangents`: the positions of the inputs that
  are cotangents (None: all). Work that depends on none of them is the
  forward recomputed (rematerialisation); W's share of it runs in B where
  that makes W's stash smaller.
  """
  jaxpr, consts = _open(closed_jaxpr)
  n = len(jaxpr.outvars)
  b_set = set(b_out)
  b_want = [i in b_set for i in range(n)]
  w_want = [i not in b_set for i in range(n)]
  lin_in = None
  if cotangents is not None:
    lin_in = [i in set(cotangents) for i in range(len(jaxpr.invars))]
  plan = _analyse(jaxpr, consts, b_want, w_want, lin_in)
  return SplitPullback(plan, len(jaxpr.invars), tuple(sorted(b_set)),
                       tuple(i for i in range(n) if i not in b_set))


def _signature(tree) -> tuple:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((tuple(np.shape(x)), np.dtype(x.dtype).name) for x in leaves)


class VjpLayout(NamedTuple):
  """How to rebuild a stage's `jax.vjp` function from a stash entry.

  Attributes:
    treedef: the structure of the vjp function (a pytree).
    layout: per leaf of it: ('w', i) the stage's i-th weight leaf, or
      ('r', j) the j-th stashed residual.
  """
  treedef: Any
  layout: tuple


def forward_with_vjp(fn, blocks: Any, x: jax.Array, mark=lambda leaf: leaf):
  """(y, aux, residuals to stash, layout): a stage's forward and what its backward needs.

  Leaves of the vjp that are the stage's weights themselves are not stashed
  (the backward takes them from the state); every other leaf is, passed
  through `mark` (the engine types them as varying over the mesh, like the
  ring that holds them).
  """
  (y, aux), vjp = jax.vjp(fn, blocks, x)
  leaves, treedef = jax.tree.flatten(vjp)
  weights = {id(w): i for i, w in enumerate(jax.tree.leaves(blocks))}
  layout, kept = [], []
  for leaf in leaves:
    if id(leaf) in weights:
      layout.append(("w", weights[id(leaf)]))
    else:
      layout.append(("r", len(kept)))
      kept.append(mark(leaf))
  return y, aux, tuple(kept), VjpLayout(treedef, tuple(layout))


def rebuild_vjp(spec: VjpLayout, kept: Sequence[Any], weights: Sequence[Any]):
  """The vjp function `forward_with_vjp` took apart, from its stash and the weights' leaves."""
  leaves = [weights[i] if kind == "w" else kept[i] for kind, i in spec.layout]
  return jax.tree.unflatten(spec.treedef, leaves)


class SplitStage:
  """A stage function's forward, and its backward as B then W.

      y, aux, stash = split.forward(blocks, x)
      g_x, w_stash = split.backward_input(blocks, stash, g_y, g_aux)
      g_blocks = split.backward_weights(blocks, w_stash)

  `fn`: (blocks, x) -> (y, aux), as `StageFns.stage`. The forward's stash
  is what `stash='residuals'` keeps today (the vjp's residuals without the
  weights, which every call takes from `blocks`); W's stash is what B keeps
  for W. g_x and g_blocks equal `jax.vjp(fn, blocks, x)[1]((g_y, g_aux))`
  (the same operations, in the same order). Each call traces under the
  caller's trace (a `shard_map`, a `lax.cond` branch); B and W must see the
  same shapes as the forward did.
  """

  def __init__(self, fn):
    self.fn = fn
    self._layouts: dict = {}
    self._splits: dict = {}

  def forward(self, blocks: Tree, x: jax.Array):
    """(y, aux, stash): the stage's outputs and its vjp residuals (no weights)."""
    y, aux, kept, layout = forward_with_vjp(self.fn, blocks, x)
    self._layouts[_signature((blocks, kept))] = layout
    return y, aux, kept

  def _split(self, blocks, stash, cts):
    """The split pullback for these shapes (traced once per signature) and its key."""
    key = _signature((blocks, stash, cts))
    if key not in self._splits:
      spec = self._layouts[_signature((blocks, stash))]

      def pull(weights, kept, cts):
        return rebuild_vjp(spec, kept, weights)(cts)

      weights = jax.tree.leaves(blocks)
      closed = jax.make_jaxpr(pull)(weights, stash, cts)
      n_out = len(closed.jaxpr.outvars)  # g_blocks' leaves, then g_x
      n_in = len(closed.jaxpr.invars)  # weights, residuals, then (g_y, g_aux)
      self._splits[key] = split_pullback(closed, [n_out - 1], cotangents=[n_in - 2, n_in - 1])
    return self._splits[key]

  def backward_input(self, blocks: Tree, stash: tuple, g_y: jax.Array, g_aux: jax.Array):
    """B: (g_x, W's stash) from the forward's stash and the output cotangents."""
    split = self._split(blocks, stash, (g_y, g_aux))
    args = jax.tree.leaves(blocks) + list(stash) + [g_y, g_aux]
    (g_x,), w_stash = split.backward_b(args, given=range(len(jax.tree.leaves(blocks))))
    # W finds its plan by the shape of its stash, whichever trace it runs in.
    self._splits[("w",) + _signature(w_stash)] = (split, jax.tree.structure(blocks))
    return g_x, w_stash

  def backward_input_from_inputs(self, blocks: Tree, x: jax.Array, g_y: jax.Array,
                                 g_aux: jax.Array):
    """B for `stash='inputs'`: recomputes the forward once and keeps what W needs."""
    _, _, stash = self.forward(blocks, x)
    return self.backward_input(blocks, stash, g_y, g_aux)

  def backward_weights(self, blocks: Tree, w_stash) -> Tree:
    """W: the weights' gradient (a tree like `blocks`) from W's stash."""
    split, treedef = self._splits[("w",) + _signature(w_stash)]
    weights = jax.tree.leaves(blocks)
    # W may read a weight leaf (an input of the pullback); it takes it from
    # `blocks`, never from the stash.
    g = split.backward_w(w_stash, dict(enumerate(weights)))
    return jax.tree.unflatten(treedef, g)

  def w_stash_shapes(self, blocks: Tree, x: jax.Array):
    """Shapes of (the forward's stash, W's stash) for a stage input like `x` (no work)."""
    box = {}

    def trace(blocks, x):
      y, aux, stash = self.forward(blocks, x)
      _, w_stash = self.backward_input(blocks, stash, y, aux)
      box["w"] = w_stash
      return stash, w_stash

    return jax.eval_shape(trace, blocks, x)
