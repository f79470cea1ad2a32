"""The one cross-entropy (`jaxpipe.xent`) and model.loss_chunk, which computes it a chunk at a time.

The one-device reference that every pipeline is checked against (schedule
`none`) trains on `Model.loss` itself: the same program (identical jaxprs)
and the same bits, chunked or not.

Chunked equals unchunked, in float32, in value (rtol 1e-6, atol 1e-7) and in
the gradients with respect to the final norm, the output layer (or the tied
embedding) and the hidden states:
- the one-device head (`Model.head_loss`, and `StageFns.loss`, which
  `schedule=none` trains with), for chunks of 1, of a size that divides the
  token count and of one that does not, of the whole count and beyond it;
- the vocabulary-parallel head inside `jax.shard_map` on an emulated
  2-stage mesh, against the one-device loss (with a vocabulary that the
  stage count does not divide, too);
- whole schedules (2bw, gpipe, none) trained with and without chunks;
- a bad target still makes the loss and the gradient NaN;
- the compiled backward's temporaries shrink with the chunk.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe import model as model_lib
from jaxpipe import trainer
from jaxpipe.config import ModelConfig
from jaxpipe.pipeline import _vocab, make_mesh, make_schedule

from tests import _pipeline_util as util

CFG = ModelConfig(vocab_size=61, dim=32, n_layers=1, n_heads=4, n_kv_heads=2)
ROWS, SEQ = 3, 10   # 30 tokens per microbatch
# One token at a time; 7 does not divide 30 (four full chunks and one of 2
# real tokens and 5 of padding); 10 divides it; the whole count; beyond it.
# 7 does not divide the 30 tokens, 10 does, 64 exceeds them.
CHUNKS = [7, 10, 64]
TIES = pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])

VALUE_TOL = dict(rtol=1e-6, atol=1e-7)
GRAD_RTOL = 1e-5
# An entry of a weight gradient is a sum over tokens that may cancel to far
# below its terms; chunks sum them in another order, so its rounding is
# relative to the terms, not to the sum. Allow one float32 ulp of the leaf's
# largest entry on top of the relative tolerance.
ULP = float(np.finfo(np.float32).eps)


def _assert_grads_close(got, want):
  """Every leaf within rtol 1e-5, plus one ulp of the leaf's largest entry."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    np.testing.assert_allclose(g, w, rtol=GRAD_RTOL, atol=ULP * float(np.max(np.abs(w))),
                               err_msg=jax.tree_util.keystr(path))


def _model(tie: bool, chunk: int = 0, vocab: int = CFG.vocab_size) -> model_lib.Model:
  return model_lib.build(dataclasses.replace(CFG, tie_embeddings=tie, loss_chunk=chunk,
                                             vocab_size=vocab))


def _head_params(m: model_lib.Model):
  """The embedding, final norm and output layer (what the head reads), no blocks."""
  params = jax.jit(m.init)(jax.random.key(0))
  return {"embed": params["embed"], "head": params["head"]}


def _inputs(vocab: int = CFG.vocab_size):
  """Hidden states [ROWS, SEQ, dim] and targets [ROWS, SEQ] of one microbatch."""
  x = jax.random.normal(jax.random.key(1), (ROWS, SEQ, CFG.dim), jnp.float32)
  targets = jax.random.randint(jax.random.key(2), (ROWS, SEQ), 0, vocab)
  return x, targets


def _value_and_grads(loss_fn, params, x, targets):
  """(loss, (gradient w.r.t. params, gradient w.r.t. x)), jitted."""
  return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(params, x, targets)


# --- one device ----------------------------------------------------------------


@TIES
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_head_loss_equals_unchunked(chunk, tie):
  """Model.head_loss: the same mean and the same gradients, whatever the chunk."""
  params, (x, targets) = _head_params(_model(tie)), _inputs()
  want, want_g = _value_and_grads(_model(tie).head_loss, params, x, targets)
  got, got_g = _value_and_grads(_model(tie, chunk).head_loss, params, x, targets)
  np.testing.assert_allclose(float(got), float(want), **VALUE_TOL)
  _assert_grads_close(got_g, want_g)
  # The gradients compared are those of the norm, the output layer (or the
  # tied embedding) and x; none of them is trivially zero.
  g_params, g_x = want_g
  reached = [g_params["head"]["norm"]["scale"], g_x,
             g_params["embed"]["embedding"] if tie else g_params["head"]["out"]["kernel"]]
  assert all(np.abs(np.asarray(g)).max() > 1e-4 for g in reached)


@TIES
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_stage_fns_loss_equals_unchunked(chunk, tie):
  """StageFns.loss (what schedule=none trains with) takes loss_chunk from the model config."""
  params, (x, targets) = _head_params(_model(tie)), _inputs()
  fns = trainer.stage_fns(_model(tie, chunk))
  assert fns.loss_chunk == chunk
  want, want_g = _value_and_grads(trainer.stage_fns(_model(tie)).loss, params, x, targets)
  got, got_g = _value_and_grads(fns.loss, params, x, targets)
  np.testing.assert_allclose(float(got), float(want), **VALUE_TOL)
  _assert_grads_close(got_g, want_g)


def test_the_mean_counts_real_tokens_only():
  """Padding adds nothing: dropping a token moves the loss far beyond the tolerance.

  A negative control: the chunked mean over 29 of the 30 tokens (the last
  chunk of 7 then holds one real token) differs from the mean over 30, so
  the comparisons above would catch padding that was counted.
  """
  m, params, (x, targets) = _model(False, 7), _head_params(_model(False)), _inputs()
  full = float(m.head_loss(params, x, targets))
  short = float(m.head_loss(params, x.reshape(-1, CFG.dim)[:-1], targets.reshape(-1)[:-1]))
  want = float(_model(False).head_loss(params, x.reshape(-1, CFG.dim)[:-1],
                                       targets.reshape(-1)[:-1]))
  np.testing.assert_allclose(short, want, **VALUE_TOL)
  assert abs(short - full) > 1e3 * VALUE_TOL["atol"]


# --- the reference is Model.loss ----------------------------------------------------


def _jaxpr_of_value_and_grad(loss_fn, *args) -> str:
  return str(jax.make_jaxpr(jax.value_and_grad(loss_fn))(*args))


@pytest.mark.parametrize("chunk", [0, 7])
def test_the_reference_loss_is_model_loss(chunk):
  """schedule=none's loss (StageFns.loss after the blocks) is Model.loss's program.

  Their jaxprs (value and gradient) are the same text, which a second
  cross-entropy anywhere would break, while the chunk does change the text.
  A step of `none` with SGD at rate 1 then gives Model.loss's loss and
  weights minus its gradient, bit for bit.
  """
  from jaxpipe.pipeline._schedules import _full_loss  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(CFG, n_layers=2, loss_chunk=chunk)
  m = model_lib.build(cfg)
  fns = trainer.stage_fns(m)
  params = jax.jit(m.init)(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(3), (1, ROWS, SEQ), 0, CFG.vocab_size)
  targets = jax.random.randint(jax.random.key(4), (1, ROWS, SEQ), 0, CFG.vocab_size)
  args = (params, tokens[0], targets[0])

  want = _jaxpr_of_value_and_grad(m.loss, *args)
  assert _jaxpr_of_value_and_grad(_full_loss(fns), *args) == want
  other = model_lib.build(dataclasses.replace(cfg, loss_chunk=0 if chunk else 5))
  assert _jaxpr_of_value_and_grad(other.loss, *args) != want

  loss, grads = jax.jit(jax.value_and_grad(m.loss))(*args)
  sch = make_schedule("none", fns, optax.sgd(1.0), make_mesh(1, 1), 1)
  state, metrics = sch.step(sch.init(params, tokens.shape), tokens, targets)
  assert float(metrics["loss"]) == float(loss)
  stepped = jax.jit(lambda p, g: jax.tree.map(lambda a, b: a - b, p, g))(params, grads)
  for got, w in zip(jax.tree.leaves(sch.params(state)), jax.tree.leaves(stepped)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
  # The step moved the weights: the comparison is not of the initial ones.
  assert util.max_diff(stepped, params) > 1e-3


# --- vocabulary parallel -----------------------------------------------------------


def _vocab_parallel(m: model_lib.Model, chunk: int, params, x, targets, num_stages: int = 2):
  """(loss on each stage [S], gradient w.r.t. params (natural shapes), gradient w.r.t. x).

  Each stage holds its slice of the (padded) vocabulary and runs
  `_vocab.chunked_cross_entropy` on the same hidden states, as the engine's
  head does; the gradients of the replicated norm and of x come back summed
  over stages.
  """
  fns = trainer.stage_fns(m)
  mesh = make_mesh(num_stages, 1)
  vocab = _vocab.padded_vocab(m.cfg.vocab_size, num_stages)
  local = vocab // num_stages
  is_none = lambda a: a is None
  specs = jax.tree.map(lambda a: P() if a is None else P(*([None] * a), "stage"),
                       fns.vocab_axes, is_leaf=is_none)
  specs = {k: specs[k] for k in params}

  def body(shared, x, targets):
    offset = lax.axis_index("stage") * local

    def objective(sh, h):
      return _vocab.chunked_cross_entropy(fns.logits, sh, h, targets, offset,
                                          fns.vocab_size, "stage", chunk)

    loss, pull = jax.vjp(objective, shared, x)
    g_shared, g_x = pull(jnp.ones_like(loss))
    return loss[None], g_shared, g_x

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P()),
                               out_specs=(P("stage"), specs, P()), check_vma=True))
  axes = {k: fns.vocab_axes[k] for k in params}
  loss, g_shared, g_x = step(_vocab.pad_vocab(params, axes, vocab), x, targets)
  return loss, _vocab.unpad_vocab(g_shared, axes, m.cfg.vocab_size), g_x


VOCAB_CASES = [(61, 0), (61, 7), (64, 10)]


@TIES
@pytest.mark.parametrize("vocab,chunk", VOCAB_CASES, ids=[f"V{v}-c{c}" for v, c in VOCAB_CASES])
def test_vocabulary_parallel_chunks_equal_one_device(vocab, chunk, tie):
  """Two stages, each with half of the vocabulary, chunked or not, against one device.

  61 entries pad to 62 (one padding column on the second stage); 64 split evenly.
  """
  m = _model(tie, vocab=vocab)
  params, (x, targets) = _head_params(m), _inputs(vocab)
  want, want_g = _value_and_grads(m.head_loss, params, x, targets)
  loss, g_params, g_x = _vocab_parallel(m, chunk, params, x, targets)
  np.testing.assert_allclose(np.asarray(loss), np.full(2, float(want)), **VALUE_TOL)
  _assert_grads_close((g_params, g_x), want_g)


# --- bad targets -------------------------------------------------------------------


def _bad_targets(value: int):
  """(x, targets with token 15 set to `value`, 15): inside the third chunk of 7 (tokens 14-20)."""
  x, targets = _inputs()
  return x, targets.at[1, 5].set(value), 1 * SEQ + 5


@TIES
@pytest.mark.parametrize("bad", [-1, CFG.vocab_size], ids=["negative", "vocab"])
@pytest.mark.parametrize("chunk", [0, 7])
def test_bad_target_gives_nan_loss_and_gradient(chunk, bad, tie):
  """One target outside the vocabulary: loss NaN, the head's gradients NaN, x's NaN at that token.

  On one device and on two vocabulary-parallel stages, chunked (the bad
  token in a middle chunk) or not. On the stages, id 61 is the padding
  column of the 62 the vocabulary is padded to: it exists, and must still be bad.
  """
  m = _model(tie, chunk)
  params = _head_params(m)
  x, targets, where = _bad_targets(bad)
  head = "embed" if tie else "head"

  def check(loss, g_params, g_x):
    assert np.all(np.isnan(np.asarray(loss)))
    assert np.all(np.isnan(np.asarray(g_params["head"]["norm"]["scale"])))
    w = g_params["embed"]["embedding"] if tie else g_params["head"]["out"]["kernel"]
    assert np.all(np.isnan(np.asarray(w))), head
    g_x = np.asarray(g_x).reshape(-1, CFG.dim)
    assert np.all(np.isnan(g_x[where]))
    # Every other token's own gradient is untouched by the bad one.
    assert np.all(np.isfinite(np.delete(g_x, where, axis=0)))

  loss, (g_params, g_x) = _value_and_grads(m.head_loss, params, x, targets)
  check(loss, g_params, g_x)
  check(*_vocab_parallel(m, chunk, params, x, targets))


# --- whole schedules ---------------------------------------------------------------

# 32 tokens per microbatch (16 per data shard at D=2): chunks of 5 leave a
# padded last chunk. Whole schedules trained with it: tests/test_pipeline.py
# (test_schedules_train_the_same_with_chunks, beside the runs it compares with).
CHUNKED = util.config(loss_chunk=5)


def test_pipeline_evaluation_is_the_same_with_chunks():
  """The evaluation ticks (forward only) use the chunked head too."""
  losses = []
  for cfg in (util.CONFIG, CHUNKED):
    sch = make_schedule("gpipe", util.stage_fns(cfg), util.optimizer("adamw"), make_mesh(2, 2), 3)
    state = sch.init(jax.tree.map(jnp.asarray, util.initial_params(cfg)), (3, util.ROWS, util.SEQ))
    tok, tgt = (jax.device_put(a, sch.batch_sharding()) for a in util.batches(3)[0])
    losses.append(float(sch.eval_loss(state, tok, tgt)))
  np.testing.assert_allclose(losses[1], losses[0], **VALUE_TOL)


# --- memory --------------------------------------------------------------------------

# The docs' numbers (docs/accelerators.md): a head with a large vocabulary.
MEM_VOCAB, MEM_TOKENS, MEM_DIM = 32768, 4096, 64


def head_temp_bytes(chunk: int, vocab: int = MEM_VOCAB, tokens: int = MEM_TOKENS,
                    dim: int = MEM_DIM) -> int:
  """Temporaries of the compiled gradient of the one-device head and loss, in bytes.

  Shapes only (`jax.ShapeDtypeStruct`): nothing of that size is allocated.
  """
  m = model_lib.build(dataclasses.replace(CFG, vocab_size=vocab, dim=dim, loss_chunk=chunk))
  params = jax.eval_shape(m.init, jax.random.key(0))
  head = {"embed": params["embed"], "head": params["head"]}
  x = jax.ShapeDtypeStruct((tokens // 1024, 1024, dim), jnp.float32)
  targets = jax.ShapeDtypeStruct((tokens // 1024, 1024), jnp.int32)
  grad = jax.jit(jax.grad(m.head_loss, argnums=(0, 1)))
  return grad.lower(head, x, targets).compile().memory_analysis().temp_size_in_bytes


def test_chunks_cut_the_backward_temporaries():
  """4096 tokens x 32768 entries: 512 MiB of float32 logits unchunked, a chunk's worth chunked."""
  logits = MEM_TOKENS * MEM_VOCAB * 4
  whole, chunked = head_temp_bytes(0), head_temp_bytes(512)
  # Unchunked, the logits (and their gradient) of all tokens are alive at once.
  assert whole >= logits
  # Chunked, about two chunks' [512, 32768] float32 arrays: 1/8 of the logits each.
  assert chunked < logits / 2
  assert chunked < whole / 4
