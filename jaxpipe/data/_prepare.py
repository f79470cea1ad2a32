"""Tokenise users' text files into a token directory (the work of tools/prepare_data.py).

Inputs, found in the given files and (recursively) directories:
  .txt .md              a file is one document; its paragraphs (blocks separated
                        by blank lines) are the units of the train/val split
  any other name        the same, when the file is named itself and is UTF-8
                        text (LICENSE, README, notes.log)
  .jsonl .json          one JSON object per line (or a JSON array of objects); the
                        string field `text_key` of each is one document
  .parquet              FineWeb-Edu-style shards: column `text_key`, one document
                        per row (needs pyarrow)
  .txt.gz .md.gz .jsonl.gz .json.gz   the same, gzip-compressed

In an input directory only the kinds above with their extensions are read.
The other files are skipped and named in meta.json ("skipped_files"), each
with its reason in "skipped_reasons": not UTF-8 text (an image, an archive), or
UTF-8 text without one of those extensions, which is read when named itself.
A folder with images or spreadsheets beside the text thus still works and
says what it left out; hidden files and folders (.git, say) are passed over
without a word. A file named itself that is not UTF-8 text is refused.

Validation takes every k-th unit (k = round(1 / val_fraction)), counted over all
inputs in sorted order: deterministic, spread evenly through the data, and
disjoint from training text. A unit is a whole document for JSON and Parquet
rows, and a paragraph for text files, so a single book still yields a
validation split. Each document's train (and val) paragraphs are joined as in
the file and end with the end-of-text id. Both splits must hold at least one
training sequence, seq_len + 1 tokens, or nothing is written.
"""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import json
import os
import re
from typing import Any, Iterator, Sequence, TextIO

from jaxpipe.data._format import TokenData, TokenWriter, open_tokens
from jaxpipe.data._tokenizers import Tokenizer, get_tokenizer
from jaxpipe.errors import DataError

__all__ = ["prepare_files", "find_inputs"]

_KINDS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json",
          ".parquet": "parquet"}
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r]*\n")
# Why a file of an input directory was skipped (meta.json's skipped_reasons).
_NOT_TEXT = "not UTF-8 text"
_NOT_NAMED = "not a text extension (name it to include it)"
# Enough of a file's start to tell text from an image or an archive (whose
# headers hold NULs or invalid UTF-8 within the first few bytes) without
# reading a folder of large binaries whole.
_SNIFF_BYTES = 8192
# Tokenise in batches of about this many characters: big enough for the
# tokenisers' threads, small enough to bound memory on multi-GB inputs.
_BATCH_CHARS = 4 << 20


def _kind(path: str) -> str | None:
  name = path.lower()
  if name.endswith(".gz"):
    name = name[:-3]
    if name.endswith(".parquet"):
      return None
  return _KINDS.get(os.path.splitext(name)[1])


def _not_text(path: str) -> str | None:
  """Why the start of `path` is not UTF-8 text (gzip-decompressed for .gz), or None if it is."""
  try:
    with (gzip.open if path.lower().endswith(".gz") else open)(path, "rb") as f:
      head = f.read(_SNIFF_BYTES)
  except (OSError, EOFError) as e:
    return f"cannot be read ({getattr(e, 'strerror', None) or e})"
  try:
    # final=False: the sniffed bytes may end inside a multi-byte character.
    codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
  except UnicodeDecodeError:
    return _NOT_TEXT
  # Valid UTF-8, but text holds no NUL; UTF-16 and most binaries do.
  return _NOT_TEXT if b"\0" in head else None


def name_some(paths: Sequence[str], limit: int = 5) -> str:
  """Returns up to `limit` of `paths` joined by commas, then "and N more"."""
  shown = ", ".join(paths[:limit])
  return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _find_inputs(paths: Sequence[str]) -> tuple[list[str], dict[str, str]]:
  """`find_inputs`, and {file: why it was skipped} for the other files its directories held."""
  files: list[str] = []
  skipped: dict[str, str] = {}
  for path in paths:
    if os.path.isdir(path):
      found, other = [], []
      for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
          if not name.startswith("."):
            (found if _kind(name) else other).append(os.path.join(root, name))
      if not found:
        also = (f" (only {len(other)} of other types: {name_some(sorted(other))}; name a "
                "text file itself to read it whatever its extension)" if other else "")
        raise DataError(f"{path}: no .txt, .md, .jsonl, .json or .parquet files in this "
                        f"directory{also}")
      files.extend(sorted(found))
      skipped.update((f, _not_text(f) or _NOT_NAMED) for f in sorted(other))
    elif os.path.isfile(path):
      if _kind(path) is None:
        # Named itself: read as plain text whatever its name, if it is text.
        if path.lower().endswith(".parquet.gz"):
          raise DataError(f"{path}: gzip-compressed Parquet is not read; decompress it "
                          "(Parquet compresses its own columns)")
        why = _not_text(path)
        if why is not None:
          raise DataError(f"{path}: {why}; give UTF-8 text files (any name), or .jsonl, "
                          ".json or .parquet files")
      files.append(path)
    else:
      raise DataError(f"{path}: no such file or directory")
  if not files:
    raise DataError("no input files given; pass text files or directories")
  if any(_kind(f) == "parquet" for f in files) and importlib.util.find_spec("pyarrow") is None:
    first = next(f for f in files if _kind(f) == "parquet")
    raise DataError(f"{first}: reading .parquet needs pyarrow, which is not installed; "
                    "pip install pyarrow")
  return files, skipped


def find_inputs(paths: Sequence[str]) -> list[str]:
  """Returns the input files named by `paths`, directories expanded and sorted.

  A file named itself is read whatever its extension (as plain text when
  it has none of the known ones). In a directory, hidden files and folders
  and files without a known extension are skipped. Raises DataError for a
  missing path, a file named itself that is not UTF-8 text (or is gzipped
  Parquet), a directory with no inputs, no inputs at all, or Parquet inputs
  without pyarrow.
  """
  return _find_inputs(paths)[0]


def _open_text(path: str) -> TextIO:
  if path.lower().endswith(".gz"):
    return gzip.open(path, "rt", encoding="utf-8")
  return open(path, encoding="utf-8")


def _json_text(path: str, where: str, record: Any, text_key: str) -> str:
  if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
    fields = ", ".join(list(record)[:8]) if isinstance(record, dict) else type(record).__name__
    raise DataError(f"{path}:{where}: no string field '{text_key}' (found: {fields}); "
                    "set --text-key to the field that holds the text")
  return record[text_key]


def _documents(path: str, text_key: str) -> Iterator[list[str]]:
  """Yields each document of a file as its list of split units."""
  # A file without a known extension got here by being named: plain text.
  kind = _kind(path) or "text"
  if kind == "parquet":
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    pf = pq.ParquetFile(path)
    if text_key not in pf.schema_arrow.names:
      raise DataError(f"{path}: no column '{text_key}' (columns: "
                      f"{', '.join(pf.schema_arrow.names[:8])}); set --text-key")
    for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
      for text in batch.column(0).to_pylist():
        if text and text.strip():
          yield [text]
    return
  with _open_text(path) as f:
    if kind == "text":
      paragraphs = [p.strip() for p in _PARAGRAPH_BREAK.split(f.read())]
      paragraphs = [p for p in paragraphs if p]
      if paragraphs:
        yield paragraphs
      return
    first = True
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      if first and line.lstrip().startswith("["):  # a JSON array, not JSON lines
        try:
          records = json.loads(line + f.read())
        except json.JSONDecodeError as e:
          raise DataError(f"{path}:{lineno + e.lineno - 1}: not valid JSON ({e.msg})") from None
        for i, record in enumerate(records):
          text = _json_text(path, f"record {i}", record, text_key)
          if text.strip():
            yield [text]
        return
      first = False
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: not a JSON object ({e.msg}); expected one "
                        "object per line") from None
      text = _json_text(path, str(lineno), record, text_key)
      if text.strip():
        yield [text]


def _read_documents(path: str, text_key: str) -> Iterator[list[str]]:
  """`_documents`, with the errors of reading a file turned into DataErrors naming it."""
  try:
    yield from _documents(path, text_key)
  except UnicodeDecodeError:
    raise DataError(f"{path}: not UTF-8 text") from None
  except (OSError, EOFError) as e:
    raise DataError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
  except DataError:
    raise
  except Exception as e:  # pyarrow's errors for a damaged Parquet file
    if type(e).__module__.startswith("pyarrow"):
      raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    raise


def prepare_files(inputs: Sequence[str], out_dir: str, *, tokenizer: str = "gpt2",
                  val_fraction: float = 0.01, seq_len: int = 2048, text_key: str = "text",
                  overwrite: bool = False, progress: bool = True) -> TokenData:
  """Tokenises text, JSON-lines and Parquet files into a new token directory.

  Args:
    inputs: files and directories (searched recursively).
    out_dir: the dataset directory to create; written atomically.
    tokenizer: `byte`, `gpt2`, or the path of a tokenizer.json (copied in).
    val_fraction: share of units (paragraphs or documents) held out, in
      (0, 0.5]; the trainer evaluates on this val split and refuses a dataset
      without one.
    seq_len: the data.seq_len the dataset is meant for; each split must hold
      one sequence of seq_len + 1 tokens, as the trainer requires. The
      default, 2048, is that of the shipped configs that train on prepared
      data (smollm-135m, smollm-360m, moe-10b); the small configs use 32-128.
    text_key: the JSON field or Parquet column that holds the text.
    overwrite: replace an existing dataset at `out_dir`.
    progress: show a progress line on stderr when it is a terminal.

  Returns:
    The opened dataset; its meta.json lists the files that the input
    directories held but that were not read under "skipped_files", and why
    each was skipped under "skipped_reasons" ({path: reason}).

  Raises:
    DataError: bad inputs, an unknown tokenizer, an occupied `out_dir`, or a
      split without a full sequence; nothing is left at `out_dir` then.
  """
  if not 0.0 < val_fraction <= 0.5:
    raise DataError(f"val fraction {val_fraction} is not in (0, 0.5]; training needs a val "
                    "split (0.01 holds out every 100th paragraph or document)")
  if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
    raise DataError(f"seq_len {seq_len!r} is not an integer >= 1; give the data.seq_len of "
                    "the config that will train on the dataset")
  tok = get_tokenizer(tokenizer)
  files, skipped = _find_inputs(inputs)
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):
    if not overwrite:
      raise DataError(f"{out_dir}: already exists; choose another output directory or "
                      "pass --overwrite to replace it")
    if not os.path.isfile(os.path.join(out_dir, "meta.json")):
      raise DataError(f"{out_dir}: exists and is not a jaxpipe token directory; choose "
                      "another output directory")
  every = round(1 / val_fraction)
  try:
    return _tokenise(files, skipped, out_dir, tok, every, seq_len, text_key, overwrite,
                     progress)
  except OSError as e:  # reading errors are DataErrors by now; this is the output side
    raise DataError(f"{out_dir}: cannot be written ({e.strerror or e})") from None


def _tokenise(files: list[str], skipped: dict[str, str], out_dir: str, tok: Tokenizer, every: int,
              seq_len: int, text_key: str, overwrite: bool, progress: bool) -> TokenData:
  """Streams every document of `files` through `tok` into a new dataset."""
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  docs = {"train": 0, "val": 0}
  pending: dict[str, list[str]] = {"train": [], "val": []}
  pending_chars = 0
  units = 0
  with TokenWriter(out_dir, vocab_size=tok.vocab_size, eos_id=tok.eos_id, tokenizer=tok.name,
                   overwrite=overwrite) as writer, \
       tqdm(desc="tokenising", unit="tok", unit_scale=True,
            # None: only on a terminal, where leave=False erases it, so a log
            # or a pipe gets the one-line summary or error and nothing else.
            disable=None if progress else True, mininterval=0.5, leave=False) as bar:

    def flush() -> None:
      nonlocal pending_chars
      for split, texts in pending.items():
        if texts:
          ids = tok.encode_documents(texts)
          writer.append(split, ids)
          bar.update(len(ids))
          texts.clear()
      pending_chars = 0

    for i, path in enumerate(files):
      bar.set_postfix_str(f"file {i + 1}/{len(files)}", refresh=False)
      for document in _read_documents(path, text_key):
        parts: dict[str, list[str]] = {"train": [], "val": []}
        for unit in document:
          held_out = units % every == every - 1
          parts["val" if held_out else "train"].append(unit)
          units += 1
        for split, chosen in parts.items():
          if chosen:
            text = "\n\n".join(chosen)
            pending[split].append(text)
            pending_chars += len(text)
            docs[split] += 1
        if pending_chars >= _BATCH_CHARS:
          flush()
    flush()
    # Raising inside the writer's block deletes everything it wrote.
    train, val = writer.num_tokens["train"], writer.num_tokens["val"]
    if not train:
      raise DataError(f"no text for the train split in {len(files)} input file(s); "
                      "are the files empty?")
    if not val:
      raise DataError(f"the inputs hold only {units} paragraphs/documents, too few to hold out "
                      f"every {every}th for validation; raise --val-fraction or add text")
    # The trainer's minimum (TokenData.num_sequences): a window of seq_len
    # inputs plus the target after the last.
    need = seq_len + 1
    if val < need:
      raise DataError(f"the val split would hold {val} tokens, fewer than one sequence of "
                      f"seq_len+1 = {need}; raise --val-fraction (1 in {every} "
                      "paragraphs/documents is held out now), add text, or lower --seq-len to "
                      "the config's data.seq_len")
    if train < need:
      raise DataError(f"the train split would hold {train} tokens, fewer than one sequence of "
                      f"seq_len+1 = {need}; add text or lower --seq-len to the config's "
                      "data.seq_len")
    writer.update_meta({
        "sources": [os.path.abspath(f) for f in files],
        "skipped_files": [os.path.abspath(f) for f in skipped],
        "skipped_reasons": {os.path.abspath(f): why for f, why in skipped.items()},
        "num_documents": docs,
        "val_rule": f"every {every}th paragraph (text files) or document (JSON, Parquet)",
        "text_key": text_key,
    })
  return open_tokens(out_dir)
