"""The model on its own: causality, shapes, tying, remat, Mixture-of-Experts routing, FLOPs."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe import model as model_lib
from jaxpipe.config import ModelConfig, MoEConfig
from jaxpipe.model import output_logits

CFG = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
MOE = dataclasses.replace(CFG, moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.0))


def _logits(m, params, tokens):
  x, _ = m.apply_blocks(params["blocks"], m.embed(params, tokens))
  # The head's logits, recovered as the loss's gradient would be too indirect.
  from jaxpipe.model._llama import RMSNorm
  h = RMSNorm(m.cfg.norm_eps).apply({"params": params["head"]["norm"]}, x)
  w = params["embed"]["embedding"].T if m.cfg.tie_embeddings else params["head"]["out"]["kernel"]
  return h @ w


@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
def test_shapes_and_causality(cfg):
  m = model_lib.make_model(cfg)
  params = jax.jit(m.init)(jax.random.key(0))
  assert params["blocks"]["attn"]["q"]["kernel"].shape == (2, 32, 32)
  assert params["blocks"]["attn"]["k"]["kernel"].shape == (2, 32, 16)  # 2 kv heads of 8
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
  changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % cfg.vocab_size)
  a, b = _logits(m, params, tokens), _logits(m, params, changed)
  assert a.shape == (2, 12, cfg.vocab_size)
  # Positions before 7 cannot see position 7; position 7 and later must.
  np.testing.assert_array_equal(np.asarray(a[:, :7]), np.asarray(b[:, :7]))
  assert np.abs(np.asarray(a[:, 7:] - b[:, 7:])).max() > 1e-4


def test_initial_loss_is_near_uniform():
  m = model_lib.make_model(CFG)
  params = jax.jit(m.init)(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, CFG.vocab_size)
  # Small random logits (std about 0.1) add roughly their variance to log(V).
  assert abs(float(m.loss(params, tokens, tokens)) - np.log(CFG.vocab_size)) < 0.1


def test_tied_embeddings_share_one_matrix():
  cfg = dataclasses.replace(CFG, tie_embeddings=True)
  m = model_lib.make_model(cfg)
  params = jax.jit(m.init)(jax.random.key(0))
  assert "out" not in params["head"]
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
  g = jax.grad(m.loss)(params, tokens, tokens)
  # The embedding's gradient has the head's part: rows of tokens never seen
  # in the input still move, because every row is a logit.
  unseen = np.setdiff1d(np.arange(cfg.vocab_size), np.asarray(tokens))
  assert np.abs(np.asarray(g["embed"]["embedding"])[unseen]).max() > 0


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_policies_do_not_change_gradients(policy):
  plain, remat = model_lib.make_model(CFG), model_lib.make_model(dataclasses.replace(CFG, remat=policy))
  params = jax.jit(plain.init)(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, CFG.vocab_size)
  g1 = jax.jit(jax.grad(plain.loss))(params, tokens, tokens)
  g2 = jax.jit(jax.grad(remat.loss))(params, tokens, tokens)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g2)


def test_moe_output_of_a_sequence_does_not_depend_on_its_batch():
  """Routing groups are sequences, so microbatching and sharding cannot change the model."""
  m = model_lib.make_model(MOE)
  params = jax.jit(m.init)(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, MOE.vocab_size)
  whole = _logits(m, params, tokens)
  parts = jnp.concatenate([_logits(m, params, tokens[i:i + 1]) for i in range(4)])
  np.testing.assert_allclose(np.asarray(whole), np.asarray(parts), rtol=1e-5, atol=1e-6)


def test_moe_capacity_drops_overflowing_tokens():
  """With capacity 1 per expert and every token on the same expert, only the first passes."""
  cfg = dataclasses.replace(CFG, moe=MoEConfig(num_experts=2, top_k=1, capacity_factor=2 / 8,
                                               aux_loss_coeff=1.0))
  assert model_lib.capacity(cfg, 8) == 1
  moe = model_lib.MoE(cfg)
  x = jnp.ones((1, 8, 32))
  params = moe.init(jax.random.key(0), x)
  params = jax.tree.map(lambda p: p, params)
  params["params"]["router"]["kernel"] = jnp.zeros((32, 2)).at[:, 0].set(1.0)
  y, aux = moe.apply(params, x)
  y = np.asarray(y)
  assert np.abs(y[0, 0]).max() > 0                     # the first token got the slot
  np.testing.assert_array_equal(y[0, 1:], 0.0)          # the rest were dropped
  # All assignments on expert 0 with probability p0: loss = 2 * (1 * p0 + 0 * p1).
  p0 = float(jax.nn.softmax(jnp.array([32.0, 0.0]))[0])
  np.testing.assert_allclose(float(aux), 2 * p0, rtol=1e-6)


def test_flops_per_token_counts_what_a_token_passes_through():
  """A hand count for one small shape: 2 blocks of width 32, 4 heads of 8, 2 kv heads, T=128."""
  cfg = dataclasses.replace(CFG, vocab_size=64)
  assert model_lib.ffn_dim(cfg) == 96               # 8/3 * 32 rounded up to a multiple of 32
  # Matmul parameters a token passes through, per block: q 32x32 + k 32x16 + v 32x16 + o 32x32
  # = 3072; gate, up, down 3 x 32x96 = 9216. Two blocks: 24576; the head 32x64 = 2048.
  six_n = 6 * (2 * (3072 + 9216) + 2048)           # 159,744
  # Attention's q k^T and p v, forward and backward (x3), per block: 4 x 32 x T
  # FLOPs a token in full; a causal kernel computes half.
  full = 3 * 2 * 4 * 32 * 128                       # 98,304 = 12 L d T
  assert six_n + full // 2 == 208_896
  assert model_lib.flops_per_token(cfg, 128) == 208_896
  assert model_lib.flops_per_token(cfg, 128, causal=True) == 208_896
  assert model_lib.flops_per_token(cfg, 128, causal=False) == six_n + full == 258_048
  f = model_lib.token_flops(cfg, 128)
  assert (f.dense, f.experts, f.attention, f.attention_full, f.head) == (
      2 * 24576, 0, 16_384, 32_768, 4096)
  moe = dataclasses.replace(cfg, moe=MoEConfig(num_experts=8, top_k=2))
  dense_mlp, moe_mlp = 3 * 32 * 96, 2 * 3 * 32 * 96 + 32 * 8   # two experts and the router
  assert model_lib.flops_per_token(moe, 128) - 208_896 == 6 * 2 * (moe_mlp - dense_mlp)
  # The experts' kernels run over every slot: 8 experts x ceil(1.25 x 128 x 2 / 8) = 40
  # slots per 128 tokens, against the 2 experts of the model's count.
  assert model_lib.token_flops(moe, 128).expert_slots == 2 * 2 * 3 * 32 * 96 * 8 * 40 / 128


def test_the_output_layer_backward_runs_in_the_compute_dtype():
  """The head's float32 logits come from compute-dtype operands, and so do both backward matmuls.

  In float32 its gradients are jnp.dot's exactly; in bfloat16 its gradients
  are those of the float32 product up to bfloat16 rounding, and the compiled
  backward has no float32 matmul (differentiated as written it had two:
  the logits' float32 cotangent against a bfloat16 operand).
  """
  keys = jax.random.split(jax.random.key(0), 3)
  h = jax.random.normal(keys[0], (2, 5, 16))
  w = jax.random.normal(keys[1], (16, 24))
  g = jax.random.normal(keys[2], (2, 5, 24))
  loss = lambda fn: lambda h, w: jnp.sum(fn(h, w) * g)
  plain = lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32)
  want = jax.grad(loss(plain), (0, 1))(h, w)
  got = jax.grad(loss(output_logits), (0, 1))(h, w)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  assert output_logits(hb, wb).dtype == jnp.float32
  got = jax.grad(loss(output_logits), (0, 1))(hb, wb)
  assert [x.dtype for x in got] == [jnp.bfloat16] * 2
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0.05, atol=0.05)
  grad_hlo = jax.jit(jax.grad(loss(output_logits), (0, 1))).lower(hb, wb).as_text()
  plain_hlo = jax.jit(jax.grad(loss(plain), (0, 1))).lower(hb, wb).as_text()
  f32_dots = lambda text: [l for l in text.splitlines() if "dot_general" in l
                           and re.search(r": \(tensor<[^>]*xf32>, tensor<[^>]*xf32>\)", l)]
  assert len(f32_dots(plain_hlo)) == 2 and not f32_dots(grad_hlo)
