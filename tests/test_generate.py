"""Generation with a key-value cache: equal to the training forward, sampling, the command."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe import generate as gen
from jaxpipe import model as model_lib
from jaxpipe.config import ModelConfig, MoEConfig
from jaxpipe.errors import InputError
from tests import _runs

# Grouped-query attention: 4 query heads on 2 key/value heads.
CFG = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
# capacity_factor 1: training drops tokens at these lengths (see the MoE test).
MOE = dataclasses.replace(CFG, moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.0))
# Three lengths in one batch: each row's padding, positions and cache slots differ.
PROMPTS = [[5, 17, 3], [40, 2, 2, 9, 33, 1, 60], [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47]]
NEW = 6
GREEDY = gen.Sampling(temperature=0.0)


def _random_params(cfg, seed=0):
  """Parameters of the model's tree, drawn in numpy: no init program to compile.

  Matrices N(0, 0.2) (O(1) logits: clear greedy choices, and a wrong
  position or mask moves them far beyond float32 rounding), norm scales
  around 1.
  """
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(model_lib.make_model(cfg).init, jax.random.key(0))

  def draw(path, leaf):
    noise = rng.normal(0.0, 0.2, leaf.shape).astype(np.float32)
    return jnp.asarray(1 + noise if path[-1].key == "scale" else noise)

  return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="module")
def params():
  return {"dense": _random_params(CFG), "moe": _random_params(MOE)}


def _forward(cfg):
  """The training forward's logits [b, t, V] (embed, apply_blocks, logits), jitted."""
  m = model_lib.make_model(cfg)
  return jax.jit(lambda p, x: m.logits(p, m.apply_blocks(p["blocks"], m.embed(p, x))[0]))


@pytest.mark.parametrize("name,cfg", [("dense", CFG), ("moe", MOE)])
def test_greedy_with_the_cache_equals_recomputing_the_full_forward(params, name, cfg):
  """Tokens and logits of every step equal the training forward's, to float32 rounding.

  The reference decodes greedily by running the whole forward again at every
  step, all prompts at once in a right-padded buffer (causal: the padding
  after a row's last token cannot reach it); then each final sequence runs
  once more unpadded, so the reference leans on no padding at all. MoE
  blocks decode without capacity (gen.dropless): the reference is that
  model's training forward.
  """
  p = params[name]
  out = gen.decode(cfg, p, PROMPTS, max_new_tokens=NEW, sampling=GREEDY, return_logits=True)
  full = _forward(gen.dropless(cfg))
  lengths = [len(q) for q in PROMPTS]
  buffer = np.zeros((len(PROMPTS), max(lengths) + NEW), np.int32)
  for row, q in zip(buffer, PROMPTS):
    row[:len(q)] = q
  for s in range(NEW):
    logits = np.asarray(full(p, jnp.asarray(buffer)))
    for i, n in enumerate(lengths):
      ref = logits[i, n + s - 1]
      np.testing.assert_allclose(out.logits[i][s], ref, rtol=1e-5, atol=1e-5,
                                 err_msg=f"prompt {i}, step {s}")
      buffer[i, n + s] = ref.argmax()
  for i, n in enumerate(lengths):
    assert out.tokens[i] == buffer[i, n:n + NEW].tolist(), f"prompt {i}"
  # Unpadded (each length compiles anew: the MoE case checks its longest prompt only).
  for i in range(len(PROMPTS)) if name == "dense" else [2]:
    n, seq = lengths[i], jnp.asarray([PROMPTS[i] + out.tokens[i][:-1]])
    np.testing.assert_allclose(out.logits[i], np.asarray(full(p, seq))[0, n - 1:], rtol=1e-5,
                               atol=1e-5, err_msg=f"prompt {i}, unpadded")
    if name == "moe":
      # The decision matters: training's capacity (factor 1) drops tokens of
      # this sequence, and its forward then differs from the decoder's.
      trained = np.asarray(_forward(cfg)(p, seq))[0, n - 1:]
      assert np.abs(trained - out.logits[i]).max() > 1e-3


def test_rotary_at_explicit_positions_equals_the_default_and_shifts():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 3, 8)), jnp.float32)
  rotary = jax.jit(model_lib.rotary, static_argnums=1)
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  np.testing.assert_array_equal(rotary(x, 1e4, pos), rotary(x, 1e4))
  assert np.abs(np.asarray(rotary(x, 1e4, pos + 3) - rotary(x, 1e4))).max() > 1e-2


def test_sampling_is_seeded_and_top_k_1_is_greedy(params):
  p = params["dense"]
  greedy = gen.generate(CFG, p, PROMPTS, max_new_tokens=NEW, temperature=0.0)
  assert gen.generate(CFG, p, PROMPTS, max_new_tokens=NEW, top_k=1, seed=5) == greedy
  a = gen.generate(CFG, p, PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=1)
  assert gen.generate(CFG, p, PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=1) == a
  b = gen.generate(CFG, p, PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=2)
  assert a != b and all(len(t) == NEW for t in a + b)
  # Each row draws its own randomness: one prompt twice gives two samples.
  twice = gen.generate(CFG, p, [PROMPTS[0], PROMPTS[0], PROMPTS[1]], max_new_tokens=NEW, seed=1)
  assert twice[0] == a[0] and twice[1] != twice[0]
  # A temperature near 0 sharpens the distribution onto the argmax.
  assert gen.generate(CFG, p, PROMPTS, max_new_tokens=NEW, temperature=1e-4, seed=1) == greedy


def test_a_row_does_not_depend_on_the_other_prompts(params):
  p = params["dense"]
  for temperature in (0.0, 1.0):
    batch = gen.generate(CFG, p, PROMPTS, max_new_tokens=NEW, temperature=temperature, seed=4)
    others = [PROMPTS[2][::-1], PROMPTS[1], PROMPTS[0] * 3]
    assert gen.generate(CFG, p, others, max_new_tokens=NEW, temperature=temperature,
                        seed=4)[1] == batch[1]


# A hand-made distribution, stored out of order so that the filter must map
# the sorted cut back to the right ids: id -> probability.
PROBS = {3: 0.5, 0: 0.3, 4: 0.15, 1: 0.05, 2: 0.0}
LOGITS = jnp.log(jnp.asarray([PROBS[i] for i in range(5)], jnp.float32))


@pytest.mark.parametrize("top_k,top_p,kept", [
    (None, 0.45, {3}), (None, 0.75, {3, 0}), (None, 0.9, {3, 0, 4}), (None, 1.0, {3, 0, 4, 1}),
    (2, None, {3, 0}),
    # The nucleus of what top-k kept: 0.5 / 0.8 = 0.625 alone reaches 0.55 ...
    (2, 0.55, {3}),
    # ... and 0.5 + 0.3 of 0.95 (0.84) stays below 0.9, so the third one is needed.
    (3, 0.9, {3, 0, 4}),
], ids=lambda v: str(v))
def test_filter_keeps_the_top_k_and_the_nucleus(top_k, top_p, kept):
  out = np.asarray(jax.jit(gen.filter_logits)(LOGITS, top_k, top_p))
  assert {i for i in range(5) if np.isfinite(out[i])} == kept
  finite = np.isfinite(out)
  np.testing.assert_array_equal(out[finite], np.asarray(LOGITS)[finite])


def test_top_p_samples_only_the_nucleus_in_proportion():
  keys = jax.random.split(jax.random.key(0), 4000)
  ids = np.asarray(jax.jit(jax.vmap(lambda k: gen.sample(k, LOGITS, 1.0, None, 0.75)))(keys))
  assert set(ids.tolist()) == {3, 0}
  assert abs((ids == 3).mean() - 0.5 / 0.8) < 0.03


def test_eos_and_the_context_length_stop_a_row(params):
  p = params["dense"]
  greedy = gen.generate(CFG, p, PROMPTS, max_new_tokens=NEW, temperature=0.0)
  eos = greedy[0][0]
  stopped = gen.generate(CFG, p, PROMPTS, max_new_tokens=NEW, temperature=0.0, eos_id=eos)
  for row, full in zip(stopped, greedy):
    n = full.index(eos) + 1 if eos in full else NEW
    assert row == full[:n]
  assert stopped[0] == [eos]
  # Context 17: the 12-token prompt gets 5 tokens, the others all of theirs.
  cut = gen.generate(CFG, p, PROMPTS, max_new_tokens=NEW, temperature=0.0, context_len=17)
  assert cut == [greedy[0], greedy[1], greedy[2][:5]]
  assert gen.generate(CFG, p, PROMPTS, max_new_tokens=0) == [[], [], []]


@pytest.mark.parametrize("kwargs,named", [
    ({"temperature": -1.0}, "temperature must be a number >= 0"),
    ({"temperature": float("nan")}, "temperature must be a number >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": 0}, "top_k must be an integer >= 1"),
    ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0"),
    ({"prompts": []}, "no prompts given"),
    ({"prompts": [[1, 2], []]}, "prompt 1 is empty"),
    ({"prompts": [[1, 61]]}, "token id 61, outside the model's vocabulary [0, 61)"),
    ({"context_len": 10}, "prompt 2 has 12 tokens, more than the model's context length of 10"),
    ({"eos_id": 99}, "eos_id 99 is outside"),
])
def test_bad_input_is_refused(params, kwargs, named):
  kwargs = {"prompts": PROMPTS, "max_new_tokens": 4, **kwargs}
  with pytest.raises(InputError) as e:
    gen.generate(CFG, params["dense"], kwargs.pop("prompts"), **kwargs)
  assert named in str(e.value)


# --- the command -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A tiny run of two steps on the embedded corpus (byte tokenizer, seq_len 32)."""
  from jaxpipe import config, trainer  # pylint: disable=g-import-not-at-top
  path = tmp_path_factory.mktemp("gen")
  cfg = config.load(_runs.TINY, [f"run.dir={path / 'run'}", "run.steps=2",
                                 f"data.cache_dir={path / 'cache'}", "model.n_layers=2",
                                 "pipeline.microbatches=1", "checkpoint.async_save=false",
                                 "eval.batches=1"])
  trainer.train(cfg)
  return str(path / "run")


def test_command_prints_the_continuation_of_a_run(run_dir, capsys):
  from jaxpipe import runs  # pylint: disable=g-import-not-at-top
  from jaxpipe.cli import generate as cli  # pylint: disable=g-import-not-at-top
  from jaxpipe.data import get_tokenizer  # pylint: disable=g-import-not-at-top
  prompt = "In the beginning"
  code = cli.main(["--run", run_dir, "--prompt", prompt, "--max-new-tokens", "12",
                   "--temperature", "0.8", "--top-k", "40", "--top-p", "0.95", "--seed", "3"])
  out = capsys.readouterr()
  assert code == 0, out.err
  cfg, params, _ = runs.load_params(run_dir)
  tok = get_tokenizer(cfg.data.tokenizer)
  new = gen.generate(cfg.model, params, tok.encode(prompt), max_new_tokens=12, temperature=0.8,
                     top_k=40, top_p=0.95, seed=3, eos_id=tok.eos_id,
                     context_len=cfg.data.seq_len)[0]
  text = tok.decode(new[:-1] if new and new[-1] == tok.eos_id else new)
  assert text and out.out == prompt + text + "\n"
  assert cli.main(["--run", run_dir, "--prompt", prompt, "--max-new-tokens", "12",
                   "--temperature", "0.8", "--top-k", "40", "--top-p", "0.95", "--seed", "3",
                   "--only-new"]) == 0
  assert capsys.readouterr().out == text + "\n"


def test_command_reads_a_hugging_face_directory(run_dir, tmp_path, capsys):
  """The run exported as a Hugging Face Llama continues a prompt as the run itself does."""
  from jaxpipe import hf, runs  # pylint: disable=g-import-not-at-top
  from jaxpipe.cli import generate as cli  # pylint: disable=g-import-not-at-top
  cfg, params, _ = runs.load_params(run_dir)
  hf.save(str(tmp_path / "hf"), cfg.model, params, cfg.data.tokenizer,
          max_position_embeddings=cfg.data.seq_len)
  outs = []
  for source in (["--run", run_dir], ["--hf", str(tmp_path / "hf")]):
    assert cli.main([*source, "--prompt", "And God said", "--temperature", "0",
                     "--max-new-tokens", "8"]) == 0
    outs.append(capsys.readouterr().out)
  assert outs[0] == outs[1] and outs[0].strip()


def test_command_runs_from_a_fresh_clone():
  """The tools/ shim finds the package without installing it (and imports no JAX for --help)."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  p = subprocess.run([sys.executable, os.path.join(_runs.ROOT, "tools", "generate.py"), "--help"],
                     capture_output=True, text=True, timeout=60, cwd="/", env=env)
  assert p.returncode == 0 and "--top-p" in p.stdout, p.stderr


@pytest.mark.parametrize("args,named", [
    (["--run", "{missing}", "--prompt", "x"], "run directory not found"),
    (["--run", "{run}", "--prompt", ""], "--prompt is empty"),
    (["--run", "{run}", "--prompt", "x" * 33], "more than the context length of 32"),
    (["--run", "{run}", "--prompt", "x", "--step", "7"], "has no checkpoint at step 7"),
    (["--run", "{run}", "--prompt", "x", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--run", "{run}", "--prompt", "x", "--temperature", "-1"], "temperature must be"),
    (["--run", "{run}", "--prompt", "x", "--top-k", "0"], "top_k must be an integer >= 1"),
    (["--run", "{run}", "--prompt", "x", "--max-new-tokens", "-2"], "--max-new-tokens must"),
    (["--run", "{run}", "--prompt", "x", "--top-k", "many"], "invalid int value"),
    (["--prompt", "x"], "one of the arguments --run --hf is required"),
    (["--hf", "{missing}", "--prompt", "x"], "no such Hugging Face checkpoint directory"),
    (["--hf", "{run}", "--prompt", "x", "--step", "2"], "--step reads a run's checkpoint"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_command_refuses_bad_input_with_one_line(run_dir, tmp_path, capsys, args, named):
  from jaxpipe.cli import generate as cli  # pylint: disable=g-import-not-at-top
  args = [a.format(run=run_dir, missing=tmp_path / "nothing") for a in args]
  try:
    code = cli.main(args)
  except SystemExit as e:  # argparse's own refusals
    code = e.code
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and named in err[0], err
