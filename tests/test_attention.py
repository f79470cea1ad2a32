"""Attention implementations: blockwise against a plain softmax, in the model, and the selection."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpipe import config as config_lib
from jaxpipe import model as model_lib
from jaxpipe.config import ModelConfig
from jaxpipe.errors import ConfigError
from jaxpipe.model import _attention
from jaxpipe.model._attention import blockwise_attention
from jaxpipe.pipeline import make_mesh
from tests import _pipeline_util as util
from tests import _runs

TOL = dict(rtol=1e-5, atol=1e-6)


def _reference(q, k, v):
  """Causal softmax attention written out: every query head against its key/value head."""
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  t = q.shape[1]
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _inputs(b, t, heads, kv_heads, d, dtype=jnp.float32, seed=0):
  """q, k, v and a cotangent w for the output, standard normal."""
  ks = jax.random.split(jax.random.key(seed), 4)
  shapes = [(b, t, heads, d), (b, t, kv_heads, d), (b, t, kv_heads, d), (b, t, heads, d)]
  q, k, v, w = (jax.random.normal(key, s) for key, s in zip(ks, shapes))
  return q.astype(dtype), k.astype(dtype), v.astype(dtype), w


def _value_and_grads(fn, q, k, v, w):
  """fn(q, k, v) and the gradient of sum(fn(q, k, v) * w) with respect to q, k and v."""
  def both(q, k, v, w):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(w.dtype) * w)
    return fn(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v)
  # Jitted: eagerly, every small operation of the references compiles on its own.
  return jax.jit(both)(q, k, v, w)


def _exact(q, k, v, w, reference=_reference):
  """`reference`'s value and gradients in float64, of the very (float32) inputs given.

  The float32 references are not exact enough to compare against at 1e-5 /
  1e-6: summing a few hundred rows of p * w in float32 leaves about 1e-6 of
  rounding in dk and dv, and jax.nn.dot_product_attention's own dv is off by
  up to 1.2 times that tolerance in the grouped-query case below. Against
  float64 the tolerance measures blockwise's rounding alone.
  """
  with jax.enable_x64(True):
    x64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, w)]
    o, grads = _value_and_grads(reference, *x64)
    return np.asarray(o), [np.asarray(g) for g in grads]


def _assert_close(got, want, **tol):
  (o1, g1), (o2, g2) = got, want
  np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), err_msg="output", **(tol or TOL))
  for name, a, b in zip("qkv", g1, g2):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), err_msg=f"d{name}", **(tol or TOL))


# (batch, seq, heads, kv heads, head_dim, block size)
CASES = [
    (2, 256, 4, 4, 8, 64),    # multi-head, seq a multiple of the block
    (2, 256, 4, 2, 8, 64),    # grouped-query, a multiple
    (1, 200, 6, 2, 8, 64),    # grouped-query, seq not a multiple: padded
    (3, 50, 4, 1, 16, 128),   # multi-query, seq shorter than one block
    (2, 300, 4, 2, 16, 128),  # the default block, padded
    (1, 7, 2, 1, 4, 2),       # many tiny blocks, odd seq
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_blockwise_matches_plain_attention_in_value_and_gradient(case):
  b, t, heads, kv_heads, d, block = case
  q, k, v, w = _inputs(b, t, heads, kv_heads, d)
  got = _value_and_grads(lambda q, k, v: blockwise_attention(q, k, v, block_size=block),
                         q, k, v, w)
  assert got[0].dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in got[1])
  _assert_close(got, _exact(q, k, v, w))


@pytest.mark.parametrize("case", CASES[1:3], ids=["-".join(map(str, c)) for c in CASES[1:3]])
def test_blockwise_in_float64_equals_the_reference_to_float64_rounding(case):
  """The algorithm itself, with rounding out of the way: float64 in, float64 statistics."""
  b, t, heads, kv_heads, d, block = case
  q, k, v, w = _inputs(b, t, heads, kv_heads, d)
  with jax.enable_x64(True):
    x64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, w)]
    got = _value_and_grads(lambda q, k, v: blockwise_attention(q, k, v, block_size=block), *x64)
    assert got[0].dtype == jnp.float64
    _assert_close(got, _value_and_grads(_reference, *x64), rtol=1e-12, atol=1e-12)


def test_the_comparison_sees_a_wrong_mask():
  """Negative control: the reference without its causal mask is far outside the tolerance."""
  q, k, v, w = _inputs(2, 200, 4, 2, 8)
  got = _value_and_grads(lambda q, k, v: blockwise_attention(q, k, v, block_size=64), q, k, v, w)
  _assert_close(got, _exact(q, k, v, w))
  full = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=False)
  with pytest.raises(AssertionError):
    _assert_close(got, _value_and_grads(full, q, k, v, w))


def test_blockwise_is_causal_across_blocks():
  """Changing key/value position p leaves every output before p unchanged, bit for bit."""
  q, k, v, _ = _inputs(1, 200, 4, 2, 8)
  p = 130  # in the third block of 64
  a = blockwise_attention(q, k, v, block_size=64)
  b = blockwise_attention(q, k.at[:, p].add(1.0), v.at[:, p].add(1.0), block_size=64)
  np.testing.assert_array_equal(np.asarray(a[:, :p]), np.asarray(b[:, :p]))
  assert np.abs(np.asarray(a[:, p:] - b[:, p:])).max() > 1e-3


def test_blockwise_in_bfloat16_is_as_accurate_as_xla():
  """bfloat16 inputs, float32 softmax statistics: no worse than XLA's bfloat16 attention.

  Both are measured against float32 attention of the same (bfloat16-rounded)
  inputs; XLA keeps its softmax in float32 too, so a blockwise version whose
  running statistics were bfloat16 would be several times worse.
  """
  q, k, v, w = _inputs(2, 512, 4, 2, 32, dtype=jnp.bfloat16)
  exact = _value_and_grads(lambda *a: _reference(*(x.astype(jnp.float32) for x in a)), q, k, v, w)
  xla = _value_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                         q, k, v, w)
  ours = _value_and_grads(blockwise_attention, q, k, v, w)
  assert ours[0].dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in ours[1])

  def errors(got):
    (o, g), (o_ref, g_ref) = got, exact
    return [float(jnp.mean(jnp.abs(a.astype(jnp.float32) - r)) / jnp.mean(jnp.abs(r)))
            for a, r in zip((o, *g), (o_ref, *g_ref))]

  for name, e_ours, e_xla in zip(("o", "dq", "dk", "dv"), errors(ours), errors(xla)):
    assert e_ours <= 1.25 * e_xla, (name, e_ours, e_xla)


def test_blockwise_under_vmap_and_checkpoint():
  # Two independent draws, stacked: [2, b, t, h, d].
  draws = _inputs(2, 150, 4, 2, 8), _inputs(2, 150, 4, 2, 8, seed=1)
  q, k, v, w = (jnp.stack(x) for x in zip(*draws))
  fn = lambda q, k, v: blockwise_attention(q, k, v, block_size=64)
  got = _value_and_grads(jax.vmap(jax.checkpoint(fn)), q, k, v, w)
  _assert_close(got, _exact(q, k, v, w, reference=jax.vmap(_reference)))


def test_blockwise_inside_shard_map():
  """Per device, no collectives: the vjp inside shard_map (as a pipeline stage runs it)."""
  mesh = make_mesh(2, 2)
  q, k, v, w = _inputs(4, 200, 4, 2, 8)

  def per_device(q, k, v, w):
    o, vjp = jax.vjp(lambda q, k, v: blockwise_attention(q, k, v, block_size=64), q, k, v)
    return (o, *vjp(w))

  spec = P(("stage", "data"))
  sharded = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec,
                                  check_vma=True))
  o, *grads = sharded(q, k, v, w)
  _assert_close((o, grads), _exact(q, k, v, w))
  hlo = sharded.lower(q, k, v, w).compile().as_text()
  for op in ("all-reduce", "all-gather", "collective-permute", "all-to-all"):
    assert op not in hlo, op


# The model: blockwise against xla, same weights, float32.
CFG = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_model_loss_and_gradient_blockwise_equal_xla(remat):
  """300 tokens: three blocks of 128, the last one padded."""
  xla = model_lib.make_model(dataclasses.replace(CFG, attention="xla", remat=remat))
  ours = model_lib.make_model(dataclasses.replace(CFG, attention="blockwise", remat=remat))
  params = jax.jit(xla.init)(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 301), 0, CFG.vocab_size)
  tok, tgt = tokens[:, :-1], tokens[:, 1:]
  l1, g1 = jax.jit(jax.value_and_grad(xla.loss))(params, tok, tgt)
  l2, g2 = jax.jit(jax.value_and_grad(ours.loss))(params, tok, tgt)
  np.testing.assert_allclose(float(l2), float(l1), **TOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL),
               g2, g1)


def test_2bw_pipeline_with_blockwise_attention_matches_one_device():
  """The real shard_map engine (2 stages x 2 replicas) runs blockwise attention."""
  cfg = util.config(attention="blockwise")
  util.assert_runs_match(util.run("2bw", 2, 2, 2, "adamw", cfg=cfg),
                         util.run("none", 1, 1, 2, "adamw", delay=1))


def _seq_by_seq_arrays(jaxpr, seq):
  """Shapes of every value in a jaxpr (sub-jaxprs included) whose last two axes are seq."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      for var in eqn.outvars:
        shape = getattr(var.aval, "shape", ())
        if len(shape) >= 2 and shape[-2:] == (seq, seq):
          found.append(shape)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          if hasattr(sub, "eqns"):
            walk(sub)
          elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            walk(sub.jaxpr)

  walk(jaxpr.jaxpr)
  return found


def test_blockwise_gradient_has_no_seq_by_seq_array():
  """A 2048-token model's gradient: xla builds [b, heads, seq, seq] arrays, blockwise none."""
  seq = 2048
  tokens = jnp.zeros((1, seq), jnp.int32)
  found = {}
  for attn in ("xla", "blockwise"):
    m = model_lib.make_model(dataclasses.replace(CFG, n_layers=1, attention=attn))
    params = jax.eval_shape(m.init, jax.random.key(0))
    found[attn] = _seq_by_seq_arrays(jax.make_jaxpr(jax.grad(m.loss))(params, tokens, tokens), seq)
  assert found["xla"], "negative control: the search finds XLA's probabilities"
  assert not found["blockwise"], found["blockwise"]


def test_blockwise_loops_have_static_trip_counts():
  """The planner counts FLOPs from the jaxpr and refuses while loops of unknown length.

  Blockwise visits n(n+1)/2 block pairs, half the dense square XLA computes
  and masks, and the count says so.
  """
  from jaxpipe.pipeline import _cost  # pylint: disable=g-import-not-at-top
  q, k, v, _ = _inputs(1, 512, 4, 2, 16)
  grad = lambda fn: jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), (0, 1, 2))
  ours = _cost.flops(grad(blockwise_attention), q, k, v)["matmul"]
  dense = _cost.flops(grad(_reference), q, k, v)["matmul"]
  n = 512 // _attention.BLOCK_SIZE
  # Forward 2 matmuls per pair, backward 4 plus 1 recomputed: 7 against dense's 2 + 4.
  np.testing.assert_allclose(ours / dense, 7 / 6 * (n * (n + 1) / 2) / n ** 2, rtol=1e-6)


def test_blockwise_needs_much_less_temporary_memory():
  """XLA's compiled gradient at 2048 tokens holds seq^2 probabilities; blockwise's does not."""
  q = jax.ShapeDtypeStruct((4, 2048, 4, 16), jnp.float32)
  kv = jax.ShapeDtypeStruct((4, 2048, 2, 16), jnp.float32)
  temp = {}
  for name, fn in [("xla", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
                   ("blockwise", blockwise_attention)]:
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), (0, 1, 2)))
    temp[name] = grad.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes
  probs = 4 * 4 * 2048 * 2048 * 4  # [b, heads, seq, seq] float32: 256 MiB
  assert temp["xla"] >= probs, temp
  assert temp["blockwise"] * 20 < temp["xla"], temp


# (setting, backend, dtype, seq_len, head_dim) -> implementation
SELECTIONS = [
    ("auto", "cuda", "bfloat16", 2048, 64, "cudnn"),
    ("auto", "cuda", "float16", 128, 64, "cudnn"),
    ("auto", "cuda", "bfloat16", 2048, 12, "blockwise"),   # head size not a multiple of 8
    ("auto", "cuda", "bfloat16", 2048, 256, "blockwise"),  # above the bound that holds everywhere
    ("auto", "cuda", "bfloat16", 512, 12, "xla"),
    ("auto", "cuda", "float32", 2048, 64, "blockwise"),    # cuDNN takes half precision only
    ("auto", "cuda", "float32", 1024, 64, "xla"),
    ("auto", "cpu", "bfloat16", 1025, 64, "blockwise"),
    ("auto", "cpu", "bfloat16", 1024, 64, "xla"),
    ("auto", "cpu", "float32", 64, 8, "xla"),
    ("auto", "tpu", "bfloat16", 4096, 128, "blockwise"),
    ("auto", "rocm", "bfloat16", 4096, 64, "blockwise"),
    ("auto", "gpu", "bfloat16", 128, 64, "xla"),
    ("xla", "cuda", "bfloat16", 4096, 64, "xla"),
    ("xla", "cpu", "float32", 4096, 64, "xla"),
    ("blockwise", "cuda", "bfloat16", 64, 64, "blockwise"),
    ("blockwise", "cpu", "float32", 64, 8, "blockwise"),
    ("cudnn", "cuda", "bfloat16", 64, 64, "cudnn"),
    ("cudnn", "cuda", "float16", 4096, 256, "cudnn"),      # explicit: cuDNN judges the shape
]


@pytest.mark.parametrize("setting,backend,dtype,seq_len,head_dim,want", SELECTIONS,
                         ids=["-".join(map(str, s[:5])) for s in SELECTIONS])
def test_selection(setting, backend, dtype, seq_len, head_dim, want):
  assert _attention.select_attention(setting, backend=backend, dtype=jnp.dtype(dtype),
                                     seq_len=seq_len, head_dim=head_dim) == want


@pytest.mark.parametrize("backend,dtype,named", [
    ("cpu", "bfloat16", "backend is cpu"), ("tpu", "bfloat16", "backend is tpu"),
    ("rocm", "float16", "backend is rocm"), ("cuda", "float32", "model.compute_dtype is float32")])
def test_selection_refuses_cudnn_where_it_cannot_run(backend, dtype, named):
  with pytest.raises(ConfigError, match="model.attention=cudnn") as e:
    _attention.select_attention("cudnn", backend=backend, dtype=jnp.dtype(dtype), seq_len=64,
                                head_dim=64)
  assert named in str(e.value) and "\n" not in str(e.value)


def test_selection_refuses_an_unknown_setting():
  with pytest.raises(ConfigError, match="model.attention must be one of"):
    _attention.select_attention("flash", backend="cpu", dtype=jnp.float32, seq_len=64, head_dim=8)


def test_cudnn_on_cpu_is_refused_when_the_model_is_built():
  m = model_lib.make_model(dataclasses.replace(CFG, attention="cudnn", compute_dtype="bfloat16"))
  with pytest.raises(ConfigError) as e:
    jax.eval_shape(m.init, jax.random.key(0))  # tracing is enough: the choice is made there
  message = str(e.value)
  assert "\n" not in message and "model.attention=cudnn" in message and "backend is cpu" in message


def test_train_py_refuses_cudnn_on_cpu_with_one_line(tmp_path):
  p = _runs.run(str(tmp_path / "run"), "model.attention=cudnn", "model.compute_dtype=bfloat16",
                cache_dir=str(tmp_path / "cache"))
  assert p.returncode == 2, p.stderr
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: model.attention=cudnn"), p.stderr


def test_config_key_is_parsed_and_validated():
  assert config_lib.load(None).model.attention == "auto"
  for setting in _attention.SETTINGS:
    assert config_lib.load(None, [f"model.attention={setting}"]).model.attention == setting
  with pytest.raises(ConfigError, match="model.attention must be auto, xla, blockwise or cudnn"):
    config_lib.load(None, ["model.attention=flash"])
  with pytest.raises(ConfigError, match="model.attention"):
    config_lib.load(None, ["model.attention=1"])


# --- auto tries cuDNN once at start-up and falls back on any failure ---------------

BF16 = dataclasses.replace(CFG, compute_dtype="bfloat16")


@pytest.fixture
def fake_cuda(monkeypatch):
  """An NVIDIA GPU as `select` sees it, on this CPU; the probe's memory cleared around the test."""
  monkeypatch.setattr(_attention, "attention_backend", lambda: "cuda")
  _attention.cudnn_failure.cache_clear()
  yield
  _attention.cudnn_failure.cache_clear()


def test_auto_falls_back_to_blockwise_when_cudnn_fails(fake_cuda):
  # On a CPU the cuDNN kernel really fails, not JAX's shape checks: without
  # jaxlib's CUDA plugin JAX raises RuntimeError ("cuDNN is not detected");
  # with it (the cuda extra), the CPU has no lowering of cuDNN's kernel.
  cfg, note = _attention.resolve_attention(BF16, rows=2, seq_len=64)
  assert cfg.attention == "blockwise" and cfg == dataclasses.replace(BF16, attention="blockwise")
  assert note.startswith("model.attention=auto: cuDNN attention failed on 2 x 64 tokens, "
                         f"{CFG.n_heads} heads of {CFG.dim // CFG.n_heads}, bfloat16 (")
  real = ("RuntimeError" in note
          or "'dot_product_attention_fwd' not found for platform cpu" in note)
  assert real and note.endswith("using blockwise attention"), note
  assert "\n" not in note


def test_any_failure_of_the_probe_counts(fake_cuda, monkeypatch):
  calls = []

  def failing(q, k, v):
    calls.append(q.shape)
    raise ValueError("CUDNN_STATUS_EXECUTION_FAILED\n  at some\n  long place")
  monkeypatch.setattr(_attention, "cudnn_attention", failing)
  cfg, note = _attention.resolve_attention(BF16, rows=2, seq_len=64)
  assert cfg.attention == "blockwise"
  assert "ValueError: CUDNN_STATUS_EXECUTION_FAILED at some long place" in note
  _attention.resolve_attention(BF16, rows=2, seq_len=64)
  assert len(calls) == 1                    # tried once for these shapes
  with pytest.raises(ConfigError, match="model.attention=cudnn cannot run on 2 x 64 tokens") as e:
    _attention.resolve_attention(dataclasses.replace(BF16, attention="cudnn"), rows=2,
                                 seq_len=64)
  assert "\n" not in str(e.value)


def test_a_working_cudnn_keeps_auto(fake_cuda, monkeypatch):
  xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                      implementation="xla")
  monkeypatch.setattr(_attention, "cudnn_attention", xla)
  assert _attention.resolve_attention(BF16, rows=2, seq_len=64) == (BF16, None)


def test_nothing_is_tried_where_cudnn_is_not_chosen(monkeypatch):
  monkeypatch.setattr(_attention, "cudnn_failure", lambda *a: pytest.fail("probed"))
  assert _attention.resolve_attention(BF16, rows=2, seq_len=64) == (BF16, None)    # a CPU
  assert _attention.resolve_attention(CFG, rows=2, seq_len=64) == (CFG, None)


def test_the_trainer_says_why_it_fell_back(fake_cuda, capsys):
  from jaxpipe import trainer
  cfg = config_lib.load(_runs.TINY, ["model.compute_dtype=bfloat16", "model.vocab_size=64"])
  out = trainer.resolve_attention(cfg)
  assert out.model.attention == "blockwise"
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("model.attention=auto: cuDNN attention failed")
