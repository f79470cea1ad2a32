"""A stage's backward split into B and W (`jaxpipe.pipeline._split`).

What the split must do: B then W give the unsplit vjp's gradients (to
float32 rounding; they run the same operations), and nothing is computed
twice: the matmul FLOPs of XLA's compiled B and W add up to those of the
unsplit backward, W's are exactly the weight gradients' contractions, and
neither re-runs the forward. FLOPs are read from the compiled HLO with each
`while` body counted as many times as it runs (XLA's own `cost_analysis`
counts it once). A negative control shows the naive split (W a second vjp
keeping only the weights' gradient) fails the check.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe import model as model_lib
from jaxpipe.model._config import ModelConfig, MoEConfig
from jaxpipe.pipeline import step_plan
from jaxpipe.pipeline._split import SplitStage
from jaxpipe.pipeline._zbh1 import zb_h1

B, T, DIM, LAYERS = 4, 32, 64, 2

_COMP = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
# %name = shape op(operands), attributes; a tuple's shape has spaces.
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")


def _dims(shape: str):
  m = re.match(r"^[a-z0-9]+\[([0-9,]*)\](\{[^}]*\})?$", shape)
  return None if m is None else [int(d) for d in m.group(1).split(",") if d]


def hlo_dot_flops(text: str) -> tuple[float, int]:
  """(matmul FLOPs, dot count) of a compiled HLO module, loops counted per iteration.

  A dot's FLOPs are 2 x its output's size x its contracted size. A `while`
  body counts its known trip count times; every other called computation
  (fusions, calls, conditional branches: an upper bound) once per call.
  """
  comps, shapes, entry = {}, {}, None
  current = None
  for line in text.splitlines():
    m = _COMP.match(line)
    if m:
      current = comps.setdefault(m.group(1), [])
      if line.startswith("ENTRY"):
        entry = m.group(1)
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      name, shape, op, rest = m.groups()
      shapes[name] = _dims(shape)
      current.append((shapes[name], op, rest))
  memo = {}

  def cost(comp):
    if comp in memo:
      return memo[comp]
    flops, dots = 0.0, 0
    for out, op, rest in comps[comp]:
      if op == "convolution":
        raise NotImplementedError("convolutions are not counted")
      if op == "dot":
        lhs = shapes[re.match(r"%([^\s,)]+)", rest).group(1)]
        contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest).group(1)
        size = np.prod([lhs[int(d)] for d in contracting.split(",") if d])
        flops += 2.0 * np.prod(out) * size
        dots += 1
      times = 1
      if op == "while":
        n = re.search(r'known_trip_count":\{"n":"(\d+)"', rest)
        if n is None:
          raise ValueError("a while loop without a known trip count")
        times = int(n.group(1))
      for callee in re.findall(r"(?:calls|body|to_apply|branch_computations)=\{?%([^\s,}]+)",
                               rest):
        f, d = cost(callee)
        flops, dots = flops + times * f, dots + times * d
    memo[comp] = (flops, dots)
    return memo[comp]

  return cost(entry)


def _model(moe: bool, remat: str):
  cfg = ModelConfig(vocab_size=128, dim=DIM, n_layers=LAYERS, n_heads=4, n_kv_heads=2,
                    attention="xla", remat=remat,
                    moe=MoEConfig(num_experts=4 if moe else 0, top_k=2))
  model = model_lib.make_model(cfg)
  return cfg, model.apply_blocks, model.init(jax.random.PRNGKey(0))["blocks"]


def _unsplit(fn, blocks, x):
  """The vjp as the engine's stash='residuals' runs it: (blocks, stash, g_y, g_aux) -> grads."""
  _, vjp = jax.vjp(fn, blocks, x)
  leaves, treedef = jax.tree.flatten(vjp)
  weights = {id(w): i for i, w in enumerate(jax.tree.leaves(blocks))}
  layout = [weights.get(id(leaf)) for leaf in leaves]

  def pull(blocks, stash, g_y, g_aux):
    w, kept = jax.tree.leaves(blocks), iter(stash)
    return jax.tree.unflatten(treedef, [next(kept) if i is None else w[i] for i in layout])(
        (g_y, g_aux))

  return pull


def _flops(f, *args):
  return hlo_dot_flops(jax.jit(f).lower(*args).compile().as_text())[0]


def _inputs(seed=1):
  x = jax.random.normal(jax.random.PRNGKey(seed), (B, T, DIM))
  g_y = jax.random.normal(jax.random.PRNGKey(seed + 1), (B, T, DIM))
  return x, g_y, jnp.float32(0.7)


def _close(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)


CASES = [(False, "none"), (True, "none"), (False, "dots"), (True, "dots"), (False, "full")]


@pytest.mark.parametrize("moe,remat", CASES)
def test_b_then_w_gives_the_unsplit_gradients(moe, remat):
  _, fn, blocks = _model(moe, remat)
  x, g_y, g_aux = _inputs()
  split = SplitStage(fn)
  y, aux, stash = jax.jit(split.forward)(blocks, x)
  y_ref, aux_ref = fn(blocks, x)
  _close((y, aux), (y_ref, aux_ref))
  g_x, w_stash = jax.jit(split.backward_input)(blocks, stash, g_y, g_aux)
  g_blocks = jax.jit(split.backward_weights)(blocks, w_stash)
  ref_blocks, ref_x = jax.jit(_unsplit(fn, blocks, x))(blocks, stash, g_y, g_aux)
  _close(g_x, ref_x)
  _close(g_blocks, ref_blocks)
  # stash='inputs': B recomputes the forward once; W is the same.
  g_x2, w_stash2 = jax.jit(split.backward_input_from_inputs)(blocks, x, g_y, g_aux)
  _close(g_x2, ref_x)
  _close(jax.jit(split.backward_weights)(blocks, w_stash2), ref_blocks)
  # The check sees a wrong gradient (a negative control).
  with pytest.raises(AssertionError):
    _close(g_blocks, jax.tree.map(lambda g: g * (1 + 1e-3), ref_blocks))


@pytest.mark.parametrize("moe,remat", [(False, "none"), (True, "dots")])
def test_b_and_w_share_the_backward_flops_without_recomputing(moe, remat):
  cfg, fn, blocks = _model(moe, remat)
  x, g_y, g_aux = _inputs()
  split = SplitStage(fn)
  _, _, stash = split.forward(blocks, x)
  _, w_stash = split.backward_input(blocks, stash, g_y, g_aux)
  unsplit = _unsplit(fn, blocks, x)
  f = _flops(split.forward, blocks, x)
  b = _flops(split.backward_input, blocks, stash, g_y, g_aux)
  w = _flops(split.backward_weights, blocks, w_stash)
  whole = _flops(unsplit, blocks, stash, g_y, g_aux)
  # Every matmul of the backward runs once, in B or in W, and the forward
  # in neither (the unsplit backward here starts from the residuals).
  assert b + w == pytest.approx(whole, rel=1e-9)
  assert b < whole - 0.9 * w
  # W is exactly the weights' contractions: 2 x tokens x every matrix that
  # multiplies activations (the MoE router's and the experts' included).
  matrices = sum(leaf.size for path, leaf in jax.tree_util.tree_leaves_with_path(blocks)
                 if leaf.ndim >= 3 and "router" not in jax.tree_util.keystr(path))
  if not moe:
    assert w == pytest.approx(2.0 * B * T * matrices, rel=1e-9)
  # stash='inputs': B pays the forward once, W nothing more.
  b_in = _flops(split.backward_input_from_inputs, blocks, x, g_y, g_aux)
  assert b_in == pytest.approx(f + b, rel=1e-9)
  # Negative control, the trap: W as a vjp that keeps only the weights'
  # gradient redoes B's cotangent chain through the layers.
  naive_w = _flops(lambda *a: unsplit(*a)[0], blocks, stash, g_y, g_aux)
  assert naive_w == pytest.approx(whole, rel=1e-9) and naive_w > w + 0.9 * b


def test_w_stash_is_each_weight_use_input_and_output_cotangent():
  cfg, fn, blocks = _model(False, "none")
  x, g_y, g_aux = _inputs()
  stash, w_stash = SplitStage(fn).w_stash_shapes(blocks, x)
  nbytes = lambda t: sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(t))
  hidden, kv = model_lib.ffn_dim(cfg), cfg.n_kv_heads * DIM // cfg.n_heads
  # Per token and layer: the inputs of q/k/v (one), o, gate/up (one) and
  # down, and the output cotangents of q, k, v, o, gate, up, down. The two
  # RMSNorm scales' gradients are finished in B (a [dim] each per layer):
  # dy * x_hat summed over tokens is cheaper to keep than its operands.
  per_token = (DIM + DIM + DIM + hidden) + (DIM + kv + kv + DIM + hidden + hidden + DIM)
  assert nbytes(w_stash) == 4 * LAYERS * (B * T * per_token + 2 * DIM)
  assert nbytes(w_stash) < nbytes(stash)


def test_a_weight_shared_by_every_iteration_is_summed_in_w():
  # Generic over stage functions: a scan whose weight `shared` is a constant
  # of every iteration (its gradient is a carry of the backward scan) beside
  # per-layer weights, and a weight used outside the scan.
  def fn(blocks, x):
    def layer(h, w):
      return jnp.tanh(h @ blocks["shared"]) @ w + h, None
    h, _ = lax.scan(layer, x @ blocks["first"], blocks["stacked"])
    return h, jnp.sum(h * h) * 1e-3

  k = jax.random.split(jax.random.PRNGKey(3), 3)
  blocks = {"shared": 0.1 * jax.random.normal(k[0], (DIM, DIM)),
            "stacked": 0.1 * jax.random.normal(k[1], (3, DIM, DIM)),
            "first": 0.1 * jax.random.normal(k[2], (DIM, DIM))}
  x, g_y, g_aux = _inputs()
  split = SplitStage(fn)
  _, _, stash = split.forward(blocks, x)
  g_x, w_stash = split.backward_input(blocks, stash, g_y, g_aux)
  g_blocks = split.backward_weights(blocks, w_stash)
  ref_blocks, ref_x = _unsplit(fn, blocks, x)(blocks, stash, g_y, g_aux)
  _close(g_x, ref_x)
  _close(g_blocks, ref_blocks)
  b = _flops(split.backward_input, blocks, stash, g_y, g_aux)
  w = _flops(split.backward_weights, blocks, w_stash)
  whole = _flops(_unsplit(fn, blocks, x), blocks, stash, g_y, g_aux)
  assert b + w == pytest.approx(whole, rel=1e-9)
  assert w == pytest.approx(2.0 * B * T * DIM * DIM * (1 + 3 + 3), rel=1e-9)


def test_split_runs_inside_shard_map_per_stage():
  _, fn, blocks = _model(False, "none")
  mesh = jax.make_mesh((2,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
  two = jax.tree.map(lambda a: jnp.stack([a, 1.5 * a]), blocks)  # a different stage each
  x, g_y, g_aux = _inputs()
  split = SplitStage(fn)

  def per_stage(blocks, x, g_y):
    blocks = jax.tree.map(lambda a: a[0], blocks)
    y, aux, stash = split.forward(blocks, x[0])
    # The cotangent of aux is typed like aux, as the engine types it.
    g_a = lax.pcast(g_aux, ("stage",), to="varying")
    g_x, w_stash = split.backward_input(blocks, stash, g_y[0], g_a)
    # W in another branch of the program, as the engine's later tick would.
    g_blocks = lax.cond(jnp.all(jnp.isfinite(g_x)), lambda: split.backward_weights(blocks, w_stash),
                        lambda: jax.tree.map(jnp.zeros_like, blocks))
    return g_x[None], jax.tree.map(lambda g: g[None], g_blocks)

  xs, gs = jnp.stack([x, -x]), jnp.stack([g_y, 2 * g_y])
  g_x, g_blocks = jax.jit(jax.shard_map(per_stage, mesh=mesh, in_specs=P("stage"),
                                        out_specs=P("stage")))(two, xs, gs)
  for s in range(2):
    mine = jax.tree.map(lambda a: a[s], two)
    _, vjp = jax.vjp(fn, mine, xs[s])
    ref_blocks, ref_x = vjp((gs[s], g_aux))
    _close(g_x[s], ref_x)
    _close(jax.tree.map(lambda a: a[s], g_blocks), ref_blocks)


@pytest.mark.parametrize("stages", [2, 4])
def test_zb_h1_timetable(stages):
  M = 8
  table = zb_h1(stages, M)
  # 1F1B's ticks; under F = B = W = 1 the step takes ZB-H1's 3M + S - 1
  # units at S = 2 and, at S = 4, 29 against ZB-H1's 27 and 1F1B's 33.
  assert table.num_ticks == M + 2 * (stages - 1)
  assert table.cost == {2: 3 * M + 1, 4: 29}[stages]
  busy = (table.fwd >= 0).astype(int) + (table.bwd >= 0) + (table.wgt >= 0).sum(-1)
  assert table.cost == busy.max(axis=1).sum()
  when = {}
  for kind, a in (("F", table.fwd), ("B", table.bwd)):
    for t, s in zip(*np.nonzero(a >= 0)):
      when[(kind, int(s), int(a[t, s]))] = int(t)
  for t, s, j in zip(*np.nonzero(table.wgt >= 0)):
    assert ("W", int(s), int(table.wgt[t, s, j])) not in when
    when[("W", int(s), int(table.wgt[t, s, j]))] = int(t)
  assert len(when) == 3 * M * stages  # each item once
  for s in range(stages):
    for m in range(M):
      # A value sent in a tick is read in a later one; the head's cotangent,
      # and B's W stash, in the same tick (the engine's phases: F, head, B, W).
      if s:
        assert when[("F", s, m)] > when[("F", s - 1, m)]
      if s == stages - 1:
        assert when[("B", s, m)] == when[("F", s, m)]
      else:
        assert when[("B", s, m)] > when[("B", s + 1, m)]
      assert when[("W", s, m)] >= when[("B", s, m)]
    # Memory: W's stash holds at most S + 1 microbatches at once, as the plan's ring.
    w_slots = step_plan("zb1", stages, M).w_slots
    for t in range(table.num_ticks):
      waiting = sum(when[("B", s, m)] <= t and t <= when[("W", s, m)] for m in range(M))
      assert waiting <= w_slots <= stages + 1
