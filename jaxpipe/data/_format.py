"""The on-disk token format: a JSON header plus one raw token file per split.

A dataset is a directory:

  meta.json    {"format": "jaxpipe-tokens", "version": 1, "dtype": "uint16",
                "vocab_size": 50257, "eos_id": 50256, "tokenizer": "gpt2",
                "splits": {"train": {"file": "train.bin", "num_tokens": N,
                                     "sha256": "..."},
                           "val": {...}},
                ...provenance (sources, document counts)...}
  train.bin    N token ids, little-endian `dtype`, no header
  val.bin
  tokenizer.json   only when the tokenizer is a user's tokenizer.json
  .verified.json   written by `open_tokens`: the splits it has checked against
                   their sha256 and vocab_size, so an unchanged dataset is not
                   read again on every open (optional; deleting it is harmless)

Raw files are what `np.memmap` reads without copying, so a corpus larger than
memory costs nothing to open, and a reader touches only the pages of the rows
it needs. Writers build the directory under a temporary name beside the target
and rename it into place, so a killed or concurrent build never leaves a
half-written dataset where a reader looks.

`open_tokens` reads each split once when it first sees it, computing the
sha256 that meta.json records and the largest id in the same pass; after that
the file's size, modification and change times and inode number stand for its
content. Any write to the file changes its times, and a copy (cp -a, rsync -a)
gets a new inode and change time, so either is read and checked again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from jaxpipe._files import fresh_dir
from jaxpipe.data._tokenizers import BUILTIN_TOKENIZERS
from jaxpipe.errors import DataError

if TYPE_CHECKING:
  from jaxpipe.data._tokenizers import Tokenizer

__all__ = ["FORMAT", "VERSION", "TokenData", "TokenWriter", "open_tokens", "write_tokens"]

FORMAT = "jaxpipe-tokens"
VERSION = 1
META = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# Elements per pass of the verification: 64 MiB of uint32, so a file of any size
# streams through a bounded amount of memory. The chunk size hardly matters:
# sha256 runs at about 1.3 GB/s, the max at 10-15 GB/s, for chunks of 64K-16M.
_CHUNK = 1 << 24
_REBUILD = "rebuild it with tools/prepare_data.py"
# The record of verified splits; hidden, so nothing that lists the directory
# takes it for data.
VERIFIED = ".verified.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _dtype_for(vocab_size: int) -> str:
  return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


class TokenData:
  """A validated token directory: its header and read-only memmaps of its splits.

  Attributes:
    path: the dataset directory.
    meta: the parsed `meta.json`.
    vocab_size: token ids are in [0, vocab_size).
    eos_id: the id that ends every document.
    tokenizer: the tokenizer spec (`byte`, `gpt2`, or `tokenizer.json`, which
      then lies in the dataset directory).
    dtype: the numpy dtype of the token files.
    split_names: the splits in header order.
  """

  def __init__(self, path: str, meta: dict[str, Any]):
    self.path = path
    self.meta = meta
    self.vocab_size: int = meta["vocab_size"]
    self.eos_id: int = meta["eos_id"]
    self.tokenizer: str = meta["tokenizer"]
    self.dtype: np.dtype = _DTYPES[meta["dtype"]]
    self.split_names: tuple[str, ...] = tuple(meta["splits"])
    self._maps: dict[str, np.ndarray] = {}

  def __repr__(self) -> str:
    sizes = ", ".join(f"{s}={self.num_tokens(s)}" for s in self.split_names)
    return (f"TokenData({self.path!r}, tokenizer={self.tokenizer!r}, "
            f"vocab={self.vocab_size}, {sizes})")

  def __getstate__(self) -> dict[str, Any]:
    # A memmap pickles as a full in-memory copy; worker processes reopen instead.
    state = dict(self.__dict__)
    state["_maps"] = {}
    return state

  def file(self, name: str) -> str:
    """Returns the path of split `name`'s token file."""
    if name not in self.meta["splits"]:
      raise DataError(
          f"{os.path.join(self.path, META)}: no split '{name}' (it has "
          f"{', '.join(self.split_names)}); {_REBUILD}")
    return os.path.join(self.path, self.meta["splits"][name]["file"])

  def num_tokens(self, name: str) -> int:
    """Returns the number of tokens in split `name`."""
    self.file(name)
    return self.meta["splits"][name]["num_tokens"]

  def split(self, name: str) -> np.ndarray:
    """Returns split `name` as a read-only 1-D array mapped from its file."""
    if name not in self._maps:
      file, n = self.file(name), self.num_tokens(name)
      # np.memmap refuses empty files; an empty split is still a valid split.
      self._maps[name] = (np.memmap(file, dtype=self.dtype, mode="r", shape=(n,))
                          if n else np.zeros(0, self.dtype))
    return self._maps[name]

  def num_sequences(self, name: str, seq_len: int) -> int:
    """Returns how many windows of seq_len+1 tokens at stride seq_len fit in a split.

    Raises DataError naming the file when not even one fits.
    """
    n = self.num_tokens(name)
    count = (n - 1) // seq_len if n > 0 else 0
    if n == 0:
      raise DataError(
          f"{self.file(name)}: the {name} split is empty; rebuild the dataset with text for it "
          "(tools/prepare_data.py --val-fraction > 0 for val)")
    if count < 1:
      raise DataError(
          f"{self.file(name)}: the {name} split holds {n} tokens, fewer than one "
          f"sequence of data.seq_len+1 = {seq_len + 1}; lower data.seq_len or "
          f"build the dataset from more text")
    return count

  def load_tokenizer(self) -> Tokenizer:
    """Returns the `Tokenizer` this dataset was built with."""
    from jaxpipe.data._tokenizers import get_tokenizer  # pylint: disable=g-import-not-at-top
    spec = self.tokenizer
    if spec not in BUILTIN_TOKENIZERS:
      local = os.path.join(self.path, spec)
      spec = local if os.path.exists(local) else spec
    return get_tokenizer(spec)


def _fail(where: str, problem: str) -> DataError:
  return DataError(f"{where}: {problem}; {_REBUILD}")


def _validate_meta(meta_path: str, meta: Any) -> dict[str, Any]:
  """Checks the header's structure and types; returns it unchanged."""
  if not isinstance(meta, dict):
    raise _fail(meta_path, "expected a JSON object at the top level")
  if meta.get("format") != FORMAT:
    raise _fail(meta_path, f"format is {meta.get('format')!r}, expected '{FORMAT}' "
                "(is this a jaxpipe token directory?)")
  if meta.get("version") != VERSION:
    raise DataError(
        f"{meta_path}: version {meta.get('version')!r} is not the version {VERSION} this "
        f"jaxpipe reads; {_REBUILD} or use the jaxpipe that wrote it")
  missing = [k for k in ("dtype", "vocab_size", "eos_id", "tokenizer", "splits") if k not in meta]
  if missing:
    raise _fail(meta_path, f"missing key(s) {', '.join(missing)}")
  if meta["dtype"] not in _DTYPES:
    raise _fail(meta_path, f"dtype {meta['dtype']!r} is not one of {', '.join(_DTYPES)}")
  vocab, eos = meta["vocab_size"], meta["eos_id"]
  limit = np.iinfo(_DTYPES[meta["dtype"]]).max + 1
  if not _is_int(vocab) or not 1 <= vocab <= limit:
    raise _fail(meta_path, f"vocab_size {vocab!r} is not an integer in [1, {limit}] "
                f"for dtype {meta['dtype']}")
  if not _is_int(eos) or not 0 <= eos < vocab:
    raise _fail(meta_path, f"eos_id {eos!r} is not an integer in [0, vocab_size={vocab})")
  if not isinstance(meta["tokenizer"], str) or not meta["tokenizer"]:
    raise _fail(meta_path, f"tokenizer {meta['tokenizer']!r} is not a non-empty string")
  splits = meta["splits"]
  if not isinstance(splits, dict) or not splits:
    raise _fail(meta_path, "splits must be a non-empty object of name: {file, num_tokens}")
  for name, entry in splits.items():
    if not isinstance(entry, dict) or "file" not in entry or "num_tokens" not in entry:
      raise _fail(meta_path, f"split '{name}' needs 'file' and 'num_tokens'")
    file, n = entry["file"], entry["num_tokens"]
    # Files live inside the dataset directory; a path would let a header point anywhere.
    if (not isinstance(file, str) or file in ("", ".", "..")
        or os.path.basename(file) != file):
      raise _fail(meta_path, f"split '{name}' has file {file!r}, expected a plain file name")
    if not _is_int(n) or n < 0:
      raise _fail(meta_path, f"split '{name}' has num_tokens {n!r}, expected an integer >= 0")
    # Optional in the format; TokenWriter always writes it.
    digest = entry.get("sha256")
    if digest is not None and not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
      raise _fail(meta_path, f"split '{name}' has sha256 {digest!r}, expected 64 lowercase "
                  "hex digits")
  return meta


def scan_split(data: TokenData, name: str) -> int:
  """Reads split `name` once in chunks and returns its largest id (0 when empty).

  In the same pass it hashes the bytes; it raises DataError at the first id
  >= vocab_size, or at the end when the sha256 differs from meta.json's. A
  split without a checksum whose dtype holds only valid ids is not read: the
  dtype's largest value is returned as the bound.
  """
  file, expected = data.file(name), data.meta["splits"][name].get("sha256")
  most = int(np.iinfo(data.dtype).max)
  if expected is None and data.vocab_size > most:
    # The bound stands in for the largest id, so a record of it vouches for
    # no smaller vocab_size.
    return most
  tokens = data.split(name)
  digest = hashlib.sha256() if expected else None
  top = 0
  for start in range(0, tokens.shape[0], _CHUNK):
    chunk = tokens[start:start + _CHUNK]
    top = max(top, int(chunk.max()))
    if top >= data.vocab_size:
      # The id is a more precise diagnosis than the checksum, so it goes first.
      pos = start + int(np.argmax(chunk >= data.vocab_size))
      raise DataError(
          f"{file}: token id {int(tokens[pos])} at position {pos} is >= "
          f"vocab_size {data.vocab_size} of {os.path.join(data.path, META)}; the file is "
          f"corrupt or was written with another tokenizer; {_REBUILD}")
    if digest is not None:
      digest.update(chunk)  # the raw little-endian bytes, as the writer hashed them
  if digest is not None and digest.hexdigest() != expected:
    raise DataError(
        f"{file}: its sha256 does not match the checksum in {os.path.join(data.path, META)}; "
        f"the file is corrupt or was changed after it was written; {_REBUILD}")
  return top


def _read_verified(path: str) -> tuple[dict[str, Any], int]:
  """Returns the verification records of a dataset and the record file's mtime_ns.

  A missing or unreadable record file is an empty one: everything is checked.
  """
  try:
    with open(os.path.join(path, VERIFIED), encoding="utf-8") as f:
      mtime_ns = os.fstat(f.fileno()).st_mtime_ns
      records = json.load(f)
  except (OSError, ValueError):
    return {}, 0
  return (records, mtime_ns) if isinstance(records, dict) else ({}, 0)


def _write_verified(path: str, records: Mapping[str, Any]) -> None:
  """Replaces the record file atomically; does nothing where it cannot be written.

  No fsync: a record lost in a crash only costs one more read of the data.
  """
  tmp = os.path.join(path, f"{VERIFIED}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
  try:
    with open(tmp, "x", encoding="utf-8") as f:
      json.dump(records, f, indent=1, sort_keys=True)
      f.write("\n")
    os.replace(tmp, os.path.join(path, VERIFIED))
  except OSError:  # a read-only dataset, or a full disk: verify again next time
    try:
      os.unlink(tmp)
    except OSError:
      pass


def _verify(data: TokenData, name: str, st: os.stat_result, cached: Any,
            cached_mtime_ns: int) -> dict[str, Any]:
  """Checks split `name` (whose file has stat `st`) unless `cached` vouches for it.

  Returns the record to keep for it: `cached` itself on a hit, else a new one
  after `scan_split`.
  """
  record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino, "dtype": data.meta["dtype"],
            "sha256": data.meta["splits"][name].get("sha256")}
  # A write in the same clock tick as the record file could leave the file's
  # mtime unchanged (the timestamps are coarse), so only a file last modified
  # before the record was written is trusted; the rest is read again (as git
  # does with its index).
  if (isinstance(cached, dict) and all(cached.get(k) == v for k, v in record.items())
      and st.st_mtime_ns < cached_mtime_ns and _is_int(cached.get("max_id"))
      and cached["max_id"] < data.vocab_size):
    return cached
  record["max_id"] = scan_split(data, name)
  return record


def open_tokens(path: str | os.PathLike[str], *, verify: bool = True) -> TokenData:
  """Opens and validates a token directory written by `write_tokens`.

  Checks the header and that every split file exists with exactly
  num_tokens * itemsize bytes. With `verify` it also checks that each split's
  bytes have the sha256 that meta.json records and that every id is below
  vocab_size, reading each file once in bounded chunks; a split verified
  before and unchanged since (same size, times and inode, as recorded in
  `.verified.json`) is not read again.

  Args:
    path: the dataset directory (or its meta.json).
    verify: check every split's checksum and ids (off: header and sizes only,
      for a reader that needs no more than the header).

  Returns:
    A `TokenData` with memmaps of the splits.

  Raises:
    DataError: naming the file at fault and the fix.
  """
  path = os.fspath(path)
  if os.path.basename(path) == META and os.path.isfile(path):
    path = os.path.dirname(path) or "."
  if os.path.exists(path) and not os.path.isdir(path):
    raise DataError(f"{path}: is a file, not a token directory; give the directory that holds "
                    "meta.json")
  if not os.path.isdir(path):
    raise DataError(
        f"{path}: no such token directory; build one with tools/prepare_data.py, or leave "
        "data.path empty to use the embedded corpus")
  meta_path = os.path.join(path, META)
  try:
    with open(meta_path, encoding="utf-8") as f:
      meta = json.load(f)
  except FileNotFoundError:
    raise DataError(f"{meta_path}: missing, so {path} is not a jaxpipe token directory; "
                    f"{_REBUILD}") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise _fail(meta_path, f"not valid JSON ({e})") from None
  except OSError as e:
    raise DataError(f"{meta_path}: cannot be read ({e.strerror})") from None
  data = TokenData(path, _validate_meta(meta_path, meta))
  cached, cached_mtime_ns = _read_verified(path) if verify else ({}, 0)
  records = {}
  for name in data.split_names:
    file, n = data.file(name), data.num_tokens(name)
    expected = n * data.dtype.itemsize
    try:
      st = os.stat(file)
    except OSError:
      raise DataError(f"{file}: missing, but {meta_path} lists it as the {name} split; "
                      f"{_REBUILD}") from None
    if st.st_size != expected:
      raise DataError(
          f"{file}: {st.st_size} bytes, but {meta_path} says {n} {meta['dtype']} tokens = "
          f"{expected} bytes; the file is truncated or corrupt; {_REBUILD}")
    if verify:
      key = os.path.basename(file)
      records[key] = _verify(data, name, st, cached.get(key), cached_mtime_ns)
  # Rewritten only when something was read; records of files no longer in the
  # header are dropped.
  if verify and any(records[k] is not cached.get(k) for k in records):
    _write_verified(path, records)
  return data


def _identity(meta: Mapping[str, Any]) -> Any:
  """The part of a header that decides whether two datasets are the same."""
  splits = meta.get("splits") or {}
  return (meta.get("format"), meta.get("version"), meta.get("dtype"), meta.get("vocab_size"),
          meta.get("eos_id"), meta.get("tokenizer"),
          sorted((k, v.get("file"), v.get("num_tokens"), v.get("sha256"))
                 for k, v in splits.items() if isinstance(v, dict)))


def _read_meta(path: str) -> dict[str, Any] | None:
  try:
    with open(os.path.join(path, META), encoding="utf-8") as f:
      meta = json.load(f)
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None
  except (OSError, ValueError):
    return None


def _fsync_dir(path: str) -> None:
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


class TokenWriter:
  """Streams token ids into a new dataset directory and commits it atomically.

  Everything goes to a hidden temporary directory beside `out_dir`; `commit`
  writes meta.json and renames the directory into place. If `out_dir` already
  holds the same dataset (same header and checksums), the new copy is dropped
  and the existing one kept; a different dataset there is an error unless
  `overwrite`, and a directory that is not a jaxpipe dataset is never replaced.
  Used as a context manager it commits on success and deletes the temporary
  directory on an exception.

  Example:
    with TokenWriter("data/mine", vocab_size=257, eos_id=256, tokenizer="byte") as w:
      w.append("train", ids)
  """

  def __init__(self, out_dir: str | os.PathLike[str], *, vocab_size: int, eos_id: int,
               tokenizer: str, splits: Sequence[str] = ("train", "val"),
               meta_extra: Mapping[str, Any] | None = None, overwrite: bool = False):
    self.out_dir = os.path.abspath(os.fspath(out_dir))
    if not _is_int(vocab_size) or not 1 <= vocab_size <= 1 << 32:
      raise ValueError(f"vocab_size must be an integer in [1, 2**32], got {vocab_size!r}")
    if not _is_int(eos_id) or not 0 <= eos_id < vocab_size:
      raise ValueError(f"eos_id must be in [0, vocab_size={vocab_size}), got {eos_id!r}")
    if not splits or len(set(splits)) != len(splits):
      raise ValueError(f"splits must be distinct names, got {list(splits)}")
    self.vocab_size, self.eos_id = vocab_size, eos_id
    self.dtype_name = _dtype_for(vocab_size)
    self.dtype = _DTYPES[self.dtype_name]
    self.overwrite = overwrite
    self._extra = dict(meta_extra or {})
    parent, base = os.path.split(self.out_dir)
    os.makedirs(parent, exist_ok=True)
    # Not mkdtemp: its 0700 would make the dataset unreadable to the user's group.
    self._tmp = fresh_dir(parent, f".{base}.tmp-")
    self._files: dict[str, Any] = {}
    self._done = False
    try:
      self._tokenizer = tokenizer
      if tokenizer not in BUILTIN_TOKENIZERS and os.path.isfile(tokenizer):
        # Keep a user's tokenizer with the tokens, so the dataset decodes anywhere.
        shutil.copyfile(tokenizer, os.path.join(self._tmp, TOKENIZER_FILE))
        self._extra.setdefault("tokenizer_source", os.path.abspath(tokenizer))
        self._tokenizer = TOKENIZER_FILE
      for s in splits:
        self._files[s] = open(os.path.join(self._tmp, f"{s}.bin"), "wb")
    except BaseException:
      self.abort()
      raise
    self._hashes = {s: hashlib.sha256() for s in splits}
    self._counts = {s: 0 for s in splits}

  @property
  def num_tokens(self) -> dict[str, int]:
    """Tokens written so far, per split."""
    return dict(self._counts)

  def update_meta(self, extra: Mapping[str, Any]) -> None:
    """Adds provenance to meta.json (format keys always keep their values)."""
    self._extra.update(extra)

  def append(self, split: str, ids: Any) -> None:
    """Appends token ids (any integer array-like) to `split`."""
    if split not in self._files:
      raise ValueError(f"unknown split {split!r}; this writer has {', '.join(self._files)}")
    ids = np.asarray(ids)
    if ids.size == 0:
      return
    if not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= self.vocab_size:
      raise DataError(f"{self.out_dir}: token id {hi if hi >= self.vocab_size else lo} is outside "
                      f"[0, vocab_size={self.vocab_size}); the tokenizer and vocab_size disagree")
    raw = np.ascontiguousarray(ids.reshape(-1), dtype=self.dtype).tobytes()
    self._files[split].write(raw)
    self._hashes[split].update(raw)
    self._counts[split] += ids.size

  def commit(self) -> str:
    """Writes meta.json, moves the dataset into place and returns its path."""
    if self._done:
      raise RuntimeError("this TokenWriter is already committed or aborted")
    try:
      for f in self._files.values():
        f.flush()
        os.fsync(f.fileno())
        f.close()
      meta = {
          "format": FORMAT, "version": VERSION, "dtype": self.dtype_name,
          "vocab_size": self.vocab_size, "eos_id": self.eos_id, "tokenizer": self._tokenizer,
          "splits": {s: {"file": f"{s}.bin", "num_tokens": self._counts[s],
                         "sha256": self._hashes[s].hexdigest()} for s in self._files},
      }
      for key, value in self._extra.items():
        meta.setdefault(key, value)
      with open(os.path.join(self._tmp, META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
      self._place(meta)
    except BaseException:
      self.abort()
      raise
    self._done = True
    return self.out_dir

  def _place(self, meta: dict[str, Any]) -> None:
    out = self.out_dir
    if not os.path.lexists(out):
      try:
        os.rename(self._tmp, out)
        _fsync_dir(os.path.dirname(out))
        return
      except OSError:
        pass  # another writer got there first; fall through and compare
    existing = _read_meta(out) if os.path.isdir(out) else None
    if existing is not None and _identity(existing) == _identity(meta):
      shutil.rmtree(self._tmp, ignore_errors=True)
      return
    if os.path.isdir(out) and not os.listdir(out):
      os.rmdir(out)
    elif existing is not None and self.overwrite:
      trash = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
      os.rename(out, os.path.join(trash, "old"))
      os.rename(self._tmp, out)
      shutil.rmtree(trash, ignore_errors=True)
      _fsync_dir(os.path.dirname(out))
      return
    elif existing is not None:
      raise DataError(f"{out}: already holds a different dataset; remove it, write to another "
                      "directory, or pass overwrite")
    else:
      raise DataError(f"{out}: exists and is not a jaxpipe token directory; choose another "
                      "output directory")
    os.rename(self._tmp, out)
    _fsync_dir(os.path.dirname(out))

  def abort(self) -> None:
    """Deletes everything written so far; the target directory is untouched."""
    for f in self._files.values():
      f.close()
    shutil.rmtree(self._tmp, ignore_errors=True)
    self._done = True

  def __enter__(self) -> TokenWriter:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if self._done:
      return
    if exc_type is None:
      self.commit()
    else:
      self.abort()


def write_tokens(out_dir: str | os.PathLike[str], splits: Mapping[str, Any], *,
                 vocab_size: int, eos_id: int, tokenizer: str,
                 meta_extra: Mapping[str, Any] | None = None, overwrite: bool = False) -> str:
  """Writes in-memory token arrays as a dataset directory, atomically.

  Args:
    out_dir: the directory to create.
    splits: split name -> 1-D integer array of token ids (e.g. train, val).
    vocab_size: ids must lie in [0, vocab_size); picks uint16 up to 65536, else uint32.
    eos_id: the end-of-document id.
    tokenizer: `byte`, `gpt2` or the path of a tokenizer.json (copied in).
    meta_extra: provenance merged into meta.json (never replaces format keys).
    overwrite: replace a different dataset already at `out_dir`.

  Returns:
    The absolute path of the dataset.
  """
  with TokenWriter(out_dir, vocab_size=vocab_size, eos_id=eos_id, tokenizer=tokenizer,
                   splits=tuple(splits), meta_extra=meta_extra, overwrite=overwrite) as w:
    for name, ids in splits.items():
      w.append(name, ids)
  return w.out_dir
