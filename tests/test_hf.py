"""Hugging Face Llama import and export: jaxpipe computes transformers' logits.

The torch tests build random tiny `transformers.LlamaForCausalLM`s and
compare logits to float32 rounding; the torch-free ones check the round trip
through safetensors, the refusals, and what the trainer and the export
command do with `model.init_from` and a run's checkpoints.
"""

import dataclasses
import json
import os
import shutil
import stat

import jax
import numpy as np
import pytest

from jaxpipe import config, hf, runs, trainer
from jaxpipe import model as model_lib
from jaxpipe.cli import export_hf
from jaxpipe.errors import ConfigError, InputError
from tests import _runs

# A 2bw run on 2 stages: the byte vocabulary (257) is padded to 258 in its state.
RUN = ["pipeline.schedule=2bw", "pipeline.stages=2", "pipeline.microbatches=2",
       "checkpoint.async_save=false", "eval.batches=0"]
# tiny.yaml's model: dim 32, 4 blocks, 4 heads, 2 kv heads, SwiGLU 96, byte vocab, untied.
TINY_HF = dict(vocab_size=257, hidden_size=32, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("cache"))


def _train(run_dir, cache, *overrides):
  cfg = config.load(_runs.TINY, [f"run.dir={run_dir}", f"data.cache_dir={cache}", *RUN,
                                 *overrides])
  return trainer.train(cfg)


def _hf_model(path, seed=0, **kwargs):
  """Saves a random LlamaForCausalLM (float32) to `path`; returns it (eval mode)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
  model = model.to(torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      # Norm weights away from 1 and large matrices: a wrong weight
      # convention, transpose or head order changes the logits visibly.
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.3 * torch.randn_like(p))
      else:
        p.normal_(0, 0.2)
  model.save_pretrained(path)
  return model


def _torch_logits(model, tokens):
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def _jax_logits(cfg_model, params, tokens):
  model = model_lib.make_model(cfg_model)
  x, _ = model.apply_blocks(params["blocks"], model.embed(params, tokens))
  return np.asarray(model.logits(params, x))


def _assert_logits_close(ours, theirs):
  assert ours.shape == theirs.shape
  scale = float(np.abs(theirs).max())
  assert scale > 0.5  # logits large enough for the comparison to mean something
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * scale)


def _random_params(cfg_model, seed=0):
  """Random weights of the model's tree, drawn by numpy (an eager init compiles for seconds)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(model_lib.make_model(cfg_model).init, jax.random.key(0))
  return jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype), shapes)


# --- against transformers --------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_imported_logits_equal_transformers(tmp_path, tied):
  """Grouped-query heads (6 over 2), a large eps and an unusual theta, so each maps or fails."""
  path = str(tmp_path / "hf")
  theirs = _hf_model(path, vocab_size=101, hidden_size=48, intermediate_size=80,
                     num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                     rms_norm_eps=0.05, rope_theta=500.0, tie_word_embeddings=tied,
                     attn_implementation="eager")
  shape = hf.read_config(path)
  assert shape == {"vocab_size": 101, "dim": 48, "n_layers": 3, "n_heads": 6, "n_kv_heads": 2,
                   "ffn_dim": 80, "tie_embeddings": tied, "rope_theta": 500.0, "norm_eps": 0.05}
  cfg_model = dataclasses.replace(config.ModelConfig(), **shape)
  params = hf.load_params(path, cfg_model)
  want = jax.eval_shape(model_lib.make_model(cfg_model).init, jax.random.key(0))
  assert jax.tree.structure(params) == jax.tree.structure(want)
  assert all(p.shape == w.shape and p.dtype == w.dtype
             for p, w in zip(jax.tree.leaves(params), jax.tree.leaves(want)))
  tokens = np.random.default_rng(0).integers(0, 101, (2, 19))
  _assert_logits_close(_jax_logits(cfg_model, params, tokens), _torch_logits(theirs, tokens))


def test_init_from_resume_and_export_through_transformers(tmp_path, cache):
  """A 2bw run starts from a checkpoint, resumes without it, and exports to transformers."""
  transformers = pytest.importorskip("transformers")
  src = str(tmp_path / "hf")
  _hf_model(src, seed=1, **TINY_HF)
  run_dir = str(tmp_path / "run")
  # 2bw's first step applies no update, so the checkpoint after it holds v[0].
  _train(run_dir, cache, "run.steps=1", f"model.init_from={src}")
  cfg, params, step = runs.load_params(run_dir)
  assert step == 1 and cfg.model.init_from == src
  assert params["embed"]["embedding"].shape == (257, 32)  # the padding row cut back
  start = hf.load_params(src, cfg.model)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(start)):
    np.testing.assert_array_equal(np.asarray(a), b)

  # On resume the run's checkpoint wins: the directory is not needed.
  shutil.rmtree(src)
  summary = _train(run_dir, cache, "run.steps=3", f"model.init_from={src}")
  assert summary["start_step"] == 1 and sorted(_runs.train_losses(run_dir)) == [0, 1, 2]
  cfg, params, step = runs.load_params(run_dir)
  newest = summary["run"].schedule.params(summary["state"])
  assert step == 3
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(newest)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  out = str(tmp_path / "export")
  assert export_hf.main(["--run", run_dir, "--out", out]) == 0
  theirs = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager")
  assert theirs.config.vocab_size == 257 and not theirs.config.tie_word_embeddings
  tokens = np.random.default_rng(1).integers(0, 257, (2, 23))
  _assert_logits_close(_jax_logits(cfg.model, params, tokens), _torch_logits(theirs, tokens))
  # The byte tokenizer in Hugging Face form: ids 0..255 are the UTF-8 bytes.
  tok = transformers.AutoTokenizer.from_pretrained(out)
  text = "In the beginning, Gott schuf 天地 😀\n\tand tabs"
  assert tok.encode(text) == list(text.encode("utf-8"))
  assert tok.decode(list(text.encode("utf-8"))) == text and tok.eos_token_id == 256

  # A failed export leaves nothing at --out, and a full --out needs --overwrite.
  gone = str(tmp_path / "gone" / "tokenizer.json")
  assert export_hf.main(["--run", run_dir, "--out", out + "2", "--tokenizer", gone]) == 2
  assert sorted(os.listdir(tmp_path)) == ["export", "run"]
  assert export_hf.main(["--run", run_dir, "--out", out, "--step", "1"]) == 2
  assert export_hf.main(["--run", run_dir, "--out", out, "--step", "1", "--overwrite"]) == 0
  assert export_hf.main(["--run", run_dir, "--out", out, "--step", "2", "--overwrite"]) == 2
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["vocab_size"] == 257


def test_exported_gpt2_tokenizer_encodes_like_jaxpipe(tmp_path):
  transformers = pytest.importorskip("transformers")
  from jaxpipe.data import get_tokenizer  # pylint: disable=g-import-not-at-top
  cfg_model = config.ModelConfig(vocab_size=50257, dim=8, n_layers=1, n_heads=2, n_kv_heads=1,
                                 tie_embeddings=True)
  params = _random_params(cfg_model)
  out = str(tmp_path / "out")
  hf.save(out, cfg_model, params, tokenizer="gpt2")
  tok = transformers.AutoTokenizer.from_pretrained(out)
  ours = get_tokenizer("gpt2")
  text = "Hello world!  It's 2026: naïve café, 12345 tokens\n\n\tand   spaces 😀 "
  assert tok.encode(text) == ours.encode(text) and len(ours.encode(text)) > 10
  assert tok.eos_token_id == ours.eos_id == 50256


# --- without torch ---------------------------------------------------------------------




@pytest.mark.parametrize("tied,dtype", [(True, "float32"), (False, "bfloat16")],
                         ids=["tied-float32", "untied-bfloat16"])
def test_round_trip_without_torch(tmp_path, tied, dtype):
  cfg_model = config.ModelConfig(vocab_size=61, dim=16, n_layers=3, n_heads=4, n_kv_heads=2,
                                 ffn_dim=24, tie_embeddings=tied, rope_theta=1234.0,
                                 norm_eps=3e-4, param_dtype=dtype)
  params = _random_params(cfg_model)
  out = str(tmp_path / "out")
  hf.save(out, cfg_model, params)
  with open(os.path.join(out, "config.json")) as f:
    saved = json.load(f)
  assert saved["architectures"] == ["LlamaForCausalLM"] and saved["torch_dtype"] == dtype
  shape = hf.read_config(out)
  assert shape == {k: getattr(cfg_model, k) for k in shape}
  back = hf.load_params(out, cfg_model)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  if dtype == "bfloat16":
    # A bfloat16 checkpoint into float32 master weights: exact.
    wide = hf.load_params(out, dataclasses.replace(cfg_model, param_dtype="float32"))
    for a, b in zip(jax.tree.leaves(wide), jax.tree.leaves(params)):
      assert a.dtype == np.float32
      np.testing.assert_array_equal(a, b.astype(np.float32))
  # Saved again from what was read: the same bytes.
  again = str(tmp_path / "again")
  hf.save(again, cfg_model, back)
  for name in ("model.safetensors", "config.json"):
    with open(os.path.join(out, name), "rb") as f, open(os.path.join(again, name), "rb") as g:
      assert f.read() == g.read()


def test_sharded_checkpoint_and_padded_vocabulary(tmp_path):
  """A model.safetensors.index.json over two shards reads like one file; padding is cut."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  cfg_model = config.ModelConfig(vocab_size=61, dim=16, n_layers=2, n_heads=4, n_kv_heads=1)
  params = _random_params(cfg_model, seed=3)
  # A pipeline's state pads the vocabulary to a multiple of the stages.
  padded = dict(params, embed={"embedding": np.pad(np.asarray(params["embed"]["embedding"]),
                                                   ((0, 3), (0, 0)))},
                head={"norm": params["head"]["norm"],
                      "out": {"kernel": np.pad(np.asarray(params["head"]["out"]["kernel"]),
                                               ((0, 0), (0, 3)))}})
  one = str(tmp_path / "one")
  hf.save(one, cfg_model, padded)
  tensors = load_file(os.path.join(one, "model.safetensors"))
  assert tensors["model.embed_tokens.weight"].shape == (61, 16)
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  two = str(tmp_path / "two")
  os.makedirs(two)
  shutil.copy(os.path.join(one, "config.json"), two)
  for file, keys in shards.items():
    save_file({k: tensors[k] for k in keys}, os.path.join(two, file), metadata={"format": "pt"})
  with open(os.path.join(two, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": {k: file for file, keys in shards.items()
                                              for k in keys}}, f)
  back = hf.load_params(two, cfg_model)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b))


# --- refusals --------------------------------------------------------------------------


def _write_config(path, **changes):
  base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 61,
          "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": True}
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({**base, **changes}, f)
  return path


@pytest.mark.parametrize("changes,needle", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling of type 'llama3'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters of type"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_local_experts": 8}, "num_local_experts=8"),
    ({"head_dim": 8}, "head_dim=8"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "MistralForCausalLM"),
])
def test_what_is_not_a_dense_llama_is_refused(tmp_path, changes, needle):
  path = _write_config(str(tmp_path / "hf"), **changes)
  with pytest.raises(InputError) as e:
    hf.read_config(path)
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_smollm_135m_config_has_the_published_shape(tmp_path):
  """SmolLM-135M's config.json (as published) against configs/smollm-135m.yaml."""
  path = _write_config(
      str(tmp_path / "smollm"), vocab_size=49152, hidden_size=576, intermediate_size=1536,
      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
      rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True, attention_bias=False,
      max_position_embeddings=2048, bos_token_id=0, eos_token_id=0, pretraining_tp=1)
  ours = config.load(os.path.join(_runs.ROOT, "configs", "smollm-135m.yaml")).model
  # The vocabulary comes from the data's tokenizer (SmolLM's gives 49152).
  hf.check_config(dataclasses.replace(ours, vocab_size=49152), hf.read_config(path), path)
  assert "model.dim=576" in hf.overrides(path) and "model.tie_embeddings=true" in hf.overrides(
      path)


def test_a_shape_mismatch_names_each_key_and_both_values(tmp_path, cache):
  path = _write_config(str(tmp_path / "hf"))
  cfg_model = config.ModelConfig(vocab_size=61, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                                 ffn_dim=24, tie_embeddings=True)
  with pytest.raises(InputError) as e:
    hf.load_params(path, cfg_model)
  msg = str(e.value)
  assert "model.dim: config 32, checkpoint 16" in msg
  assert "model.n_layers: config 4, checkpoint 2" in msg
  assert "model.n_heads" not in msg and "\n" not in msg

  # Through the trainer: refused before anything is written to run.dir.
  run_dir = str(tmp_path / "run")
  with pytest.raises(ConfigError, match="model.init_from: .*model.ffn_dim: config 96, "
                                        "checkpoint 24"):
    _train(run_dir, cache, "run.steps=1", f"model.init_from={path}")
  with pytest.raises(ConfigError, match="no such Hugging Face checkpoint directory"):
    _train(run_dir, cache, "run.steps=1", f"model.init_from={tmp_path / 'gone'}")
  assert not os.path.exists(run_dir)


def test_moe_export_and_bad_runs_are_refused(tmp_path, capsys):
  cfg_model = config.ModelConfig(vocab_size=61, dim=16, n_layers=2, n_heads=4, n_kv_heads=2,
                                 moe=config.MoEConfig(num_experts=4))
  params = _random_params(cfg_model)
  with pytest.raises(InputError, match="Mixture-of-Experts model has no Hugging Face Llama"):
    hf.save(str(tmp_path / "moe"), cfg_model, params)
  assert not os.path.exists(tmp_path / "moe")

  out = str(tmp_path / "out")
  assert export_hf.main(["--run", str(tmp_path / "nowhere"), "--out", out]) == 2
  assert "run directory not found" in capsys.readouterr().err
  os.makedirs(tmp_path / "empty-run")
  (tmp_path / "empty-run" / "config.yaml").write_text("run: {steps: 1}\n")
  assert export_hf.main(["--run", str(tmp_path / "empty-run"), "--out", out]) == 2
  err = capsys.readouterr().err
  assert "has no complete checkpoint" in err and err.count("\n") == 1
  assert not os.path.exists(out)


def _modes(root):
  """(mode of `root`, {file name: mode}) for a folder of files, permission bits only."""
  return (stat.S_IMODE(os.stat(root).st_mode),
          {name: stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode)
           for name in sorted(os.listdir(root))})


def test_export_takes_the_modes_the_umask_gives(tmp_path, cache):
  """An export is readable by whoever may read its neighbours: 0777/0666 & ~umask, not 0700."""
  run_dir = str(tmp_path / "run")
  _train(run_dir, cache, "run.steps=1", "checkpoint.every=1", "pipeline.schedule=none",
         "pipeline.stages=1")
  # 0o077 as well: the modes follow the umask, they are not set to fixed values.
  for umask, folder, files in ((0o022, 0o755, 0o644), (0o077, 0o700, 0o600)):
    out = tmp_path / f"hf-{umask:03o}"
    old = os.umask(umask)
    try:
      export_hf.export(run_dir, str(out))
    finally:
      os.umask(old)
    mode, modes = _modes(out)
    assert {"model.safetensors", "tokenizer.json", export_hf.MARKER} <= set(modes), modes
    assert (oct(mode), {k: oct(v) for k, v in modes.items()}) == (
        oct(folder), dict.fromkeys(modes, oct(files)))


def _checksums(root):
  """{relative path: sha256} of every file below `root`."""
  import hashlib  # pylint: disable=g-import-not-at-top
  out = {}
  for folder, _, files in os.walk(root):
    for name in files:
      path = os.path.join(folder, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
  return out


def test_export_never_deletes_what_it_did_not_write(tmp_path, cache, capsys):
  """--out is never the run or a folder holding it; --overwrite replaces only an earlier export."""
  run_dir = str(tmp_path / "runs" / "run")
  _train(run_dir, cache, "run.steps=2", "checkpoint.every=1", "pipeline.schedule=none",
         "pipeline.stages=1")
  before = _checksums(run_dir)
  assert any(k.startswith("checkpoints") for k in before) and "metrics.jsonl" in before

  def refused(out, *flags, needle):
    assert export_hf.main(["--run", run_dir, "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
    assert {k: v for k, v in _checksums(run_dir).items() if not k.startswith("hf")} == before

  for flags in ([], ["--overwrite"]):
    refused(run_dir, *flags, needle="is the run directory")
    refused(tmp_path / "runs", *flags, needle="holds the run directory")
    refused(tmp_path, *flags, needle="holds the run directory")
    refused(os.path.join(run_dir, "checkpoints", "hf"), *flags, needle="inside the run's checkpoints")
  # Another run's directory, and a folder of the user's, are never replaced.
  other = tmp_path / "other-run"
  other.mkdir()
  (other / "config.yaml").write_text("run: {steps: 1}\n")
  (other / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
  refused(other, "--overwrite", needle="is a training run's directory")
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("keep me")
  refused(mine, needle="pass --overwrite to replace an earlier export")
  refused(mine, "--overwrite", needle="is not an earlier export (no jaxpipe_export.json; it "
                                      "holds notes.txt)")
  assert (mine / "notes.txt").read_text() == "keep me"
  assert sorted(os.listdir(other)) == ["config.yaml", "metrics.jsonl"]

  # A new folder inside the run is fine, and its marker lists what was written.
  out = os.path.join(run_dir, "hf")
  assert export_hf.main(["--run", run_dir, "--out", out, "--step", "1"]) == 0
  capsys.readouterr()
  after = _checksums(run_dir)
  assert {k: v for k, v in after.items() if k in before} == before
  assert all(k.startswith("hf" + os.sep) for k in after if k not in before)
  with open(os.path.join(out, export_hf.MARKER)) as f:
    marker = json.load(f)
  assert marker["step"] == 1 and marker["run"] == os.path.abspath(run_dir)
  assert sorted(marker["files"] + [export_hf.MARKER]) == sorted(os.listdir(out))
  assert "model.safetensors" in marker["files"]
  refused(out, needle="pass --overwrite")
  # --overwrite replaces that export...
  assert export_hf.main(["--run", run_dir, "--out", out, "--step", "2", "--overwrite"]) == 0
  with open(os.path.join(out, export_hf.MARKER)) as f:
    assert json.load(f)["step"] == 2
  # ...but not once something of the user's lies in it.
  with open(os.path.join(out, "README.md"), "w") as f:
    f.write("my notes")
  exported = _checksums(out)
  refused(out, "--overwrite", needle="holds files export did not write (README.md)")
  assert _checksums(out) == exported
  # A damaged or foreign marker makes no export of a folder either.
  os.remove(os.path.join(out, "README.md"))
  with open(os.path.join(out, export_hf.MARKER), "w") as f:
    f.write("{\"format\": \"something else\", \"files\": []}")
  refused(out, "--overwrite", needle="is not an earlier export")
  assert sorted(os.listdir(tmp_path)) == ["mine", "other-run", "runs"]
