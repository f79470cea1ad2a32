"""Times what verifying a token directory costs `open_tokens`, on a dataset it writes.

  python tools/bench_data_verify.py                 # 1 GiB of uint16 tokens in $TMPDIR
  python tools/bench_data_verify.py --gib 0.01 --repeat 1   # a quick check that it runs

It writes a train split of --gib GiB of random GPT-2 ids (vocab 50257, uint16)
and a val split of 1/1000 of that with `TokenWriter`, in chunks, then times:

  open_tokens, no record   checksum and ids of every split, the page cache warm
  ... file evicted         the same after posix_fadvise(DONTNEED) on the split
                           files, so the read comes from the disk (where the
                           file system honours it)
  open_tokens, recorded    a second open: the record in .verified.json vouches
  open_tokens(verify=False)  header and file sizes only
  id check alone           one pass over train.bin: the largest id
  id check + sha256        one pass: the largest id and the checksum, as open_tokens does

Each row is the median (and min) of --repeat runs, with the load average
before and after: the numbers mean little on a busy machine. The dataset is
deleted at the end unless --keep.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

try:
  import jaxpipe  # noqa: F401
except ImportError:  # run from a fresh clone without installing
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=g-import-not-at-top

from jaxpipe.cli import Parser  # pylint: disable=g-import-not-at-top
# pylint: disable-next=g-import-not-at-top
from jaxpipe.data import VERIFIED, TokenData, TokenWriter, open_tokens, scan_split

VOCAB = 50257  # GPT-2's, the largest that the shipped tokenizers use with uint16
# Tokens generated and appended per step: 32 MiB of uint16.
_WRITE_CHUNK = 1 << 24


def write_dataset(path: str, num_tokens: int, seed: int = 0) -> str:
  """Writes `num_tokens` random ids as train (and a thousandth of that as val) at `path`."""
  rng = np.random.default_rng(seed)
  with TokenWriter(path, vocab_size=VOCAB, eos_id=VOCAB - 1, tokenizer="gpt2") as w:
    for split, n in (("train", num_tokens), ("val", max(1, num_tokens // 1000))):
      for start in range(0, n, _WRITE_CHUNK):
        w.append(split, rng.integers(0, VOCAB, min(_WRITE_CHUNK, n - start), dtype=np.uint16))
  # A record is trusted only for a file modified before it was written; backdate
  # the files so that a fast first open on a coarse clock still leaves one.
  hour_ago = time.time_ns() - 3600 * 10**9
  for name in ("train.bin", "val.bin"):
    os.utime(os.path.join(path, name), ns=(hour_ago, hour_ago))
  return path


def _evict(path: str) -> None:
  """Asks the kernel to drop the split files' pages from the page cache."""
  for name in ("train.bin", "val.bin"):
    fd = os.open(os.path.join(path, name), os.O_RDONLY)
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def _forget(path: str) -> None:
  try:
    os.remove(os.path.join(path, VERIFIED))
  except FileNotFoundError:
    pass


def _time(fn: Callable[[], object], before: Callable[[], None], repeat: int) -> list[float]:
  """Seconds of `fn()` for each of `repeat` runs, `before()` untimed ahead of each."""
  times = []
  for _ in range(repeat):
    before()
    gc.collect()  # release the previous run's memmaps, so eviction can drop their pages
    start = time.perf_counter()
    result = fn()
    times.append(time.perf_counter() - start)
    del result
  return times


def _pass(data: TokenData, with_hash: bool) -> int:
  """One pass over train.bin by the code open_tokens runs, with or without the hash."""
  if not with_hash:
    # Without a checksum in the header the same pass computes the max id alone.
    splits = {k: dict(v) for k, v in data.meta["splits"].items()}
    splits["train"].pop("sha256", None)
    data = TokenData(data.path, {**data.meta, "splits": splits})
  return scan_split(data, "train")


def measure(path: str, repeat: int, evict: bool) -> list[tuple[str, list[float]]]:
  """Returns (row name, seconds per run) for every way of opening `path` in the table."""
  nothing = lambda: None
  rows = [("open_tokens, no record", _time(lambda: open_tokens(path),
                                           lambda: _forget(path), repeat))]
  if evict:
    rows.append(("... file evicted", _time(lambda: open_tokens(path),
                                           lambda: (_forget(path), _evict(path)), repeat)))
  open_tokens(path)  # leaves the record
  rows.append(("open_tokens, recorded", _time(lambda: open_tokens(path), nothing, repeat)))
  rows.append(("open_tokens(verify=False)",
               _time(lambda: open_tokens(path, verify=False), nothing, repeat)))
  data = open_tokens(path, verify=False)
  rows.append(("id check alone", _time(lambda: _pass(data, False), nothing, repeat)))
  rows.append(("id check + sha256", _time(lambda: _pass(data, True), nothing, repeat)))
  return rows


def main(argv: list[str] | None = None) -> int:
  """Writes the dataset, times the ways of opening it, prints the table, cleans up."""
  parser = Parser(prog="bench_data_verify", description=__doc__.split("\n\n")[0])
  parser.add_argument("--gib", type=float, default=1.0,
                      help="size of the train split in GiB (default 1; 0.01 for a quick check)")
  parser.add_argument("--dir", default=None,
                      help="where to make the temporary dataset (default: the system's temp "
                           "directory; pick the disk you train from)")
  parser.add_argument("--repeat", type=int, default=3, help="runs per row (default 3)")
  parser.add_argument("--no-evict", action="store_true",
                      help="skip the row that evicts the files from the page cache")
  parser.add_argument("--keep", action="store_true", help="keep the dataset and print its path")
  args = parser.parse_args(argv)
  if args.gib <= 0 or args.repeat < 1:
    parser.error("--gib must be > 0 and --repeat >= 1")
  num_tokens = max(1, int(args.gib * (1 << 30)) // 2)
  root = tempfile.mkdtemp(prefix="bench_data_verify-", dir=args.dir)
  try:
    load_before = os.getloadavg()
    start = time.perf_counter()
    path = write_dataset(os.path.join(root, "ds"), num_tokens)
    write_s = time.perf_counter() - start
    size = sum(os.path.getsize(os.path.join(path, f)) for f in ("train.bin", "val.bin"))
    rows = measure(path, args.repeat, not args.no_evict)
    load_after = os.getloadavg()
    train_bytes = os.path.getsize(os.path.join(path, "train.bin"))
    print(f"dataset: {num_tokens:,} train tokens (uint16, vocab {VOCAB}), "
          f"{size / 2**30:.3f} GiB on disk in {path}, written in {write_s:.1f}s")
    print(f"load average (1, 5, 15 min): before {', '.join(f'{x:.2f}' for x in load_before)}; "
          f"after {', '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} CPUs")
    print(f"\n| {'what':<27} | median ms |   min ms | GB/s of train.bin |")
    print(f"|{'-' * 29}|-----------|----------|-------------------|")
    for name, times in rows:
      median, best = statistics.median(times), min(times)
      # A rate only where the row reads the file; the others are a header read.
      rate = (f"{train_bytes / median / 1e9:17.2f}"
              if "recorded" not in name and "verify=False" not in name else f"{'-':>17}")
      print(f"| {name:<27} | {median * 1e3:9.1f} | {best * 1e3:8.1f} | {rate} |")
    if args.keep:
      print(f"\nkept: {path}")
      return 0
  finally:
    if not args.keep:
      shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
