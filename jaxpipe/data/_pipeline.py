"""The grain input pipeline: shuffled, sharded [microbatch, batch, seq] windows.

A split of N tokens holds (N-1) // seq_len training examples: non-overlapping
windows of seq_len+1 tokens at stride seq_len, so every token is a target
exactly once per epoch (tokens = w[:-1], targets = w[1:]). Windows cross
document boundaries; the end-of-text id between documents tells the model
where one ends.

Global batch k is the shuffled window stream's positions [k*B, (k+1)*B):

  grain.MapDataset.range(num_windows).shuffle(seed).repeat().batch(B).map(read)

so a batch is a pure function of (seed, k). That makes iterator state one
integer (grain's {"next_index": k}), exact to resume in any process, and lets
every data-parallel replica compute the same global batch of window indices
and read only its own rows. The B windows form M microbatches of B/M rows;
each microbatch is cut into shard_count contiguous row blocks and shard s
reads block s of every microbatch, so the shards are disjoint and their
concatenation along the row axis is the global batch. grain reshuffles each
epoch (the seed is combined with the epoch number); epochs flow into one
another without a partial batch, so a batch may straddle two epochs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from jaxpipe.data._format import TokenData, open_tokens

if TYPE_CHECKING:
  import grain

__all__ = ["train_dataset", "train_iterator", "eval_batches"]


def _as_data(data: str | os.PathLike[str] | TokenData) -> TokenData:
  return data if isinstance(data, TokenData) else open_tokens(data)


def _local_rows(batch_size: int, num_microbatches: int, shard_index: int,
                shard_count: int) -> int:
  """Rows per microbatch on one shard; checks the batch arithmetic."""
  if batch_size < 1 or num_microbatches < 1 or shard_count < 1:
    raise ValueError(f"batch_size={batch_size}, num_microbatches={num_microbatches} and "
                     f"shard_count={shard_count} must all be >= 1")
  if batch_size % num_microbatches:
    raise ValueError(f"batch_size={batch_size} is not divisible by "
                     f"num_microbatches={num_microbatches}")
  micro = batch_size // num_microbatches
  if micro % shard_count:
    raise ValueError(f"the microbatch of {micro} sequences is not divisible by "
                     f"shard_count={shard_count}")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index} is not in [0, shard_count={shard_count})")
  return micro // shard_count


def _shuffle_seed(seed: int) -> int:
  # grain shuffles epoch e with seed + e, so seeds s and s+1 would share all but
  # one epoch's order; hashing the run seed first keeps different runs apart.
  if seed < 0:
    raise ValueError(f"seed must be >= 0, got {seed}")
  return int(np.random.SeedSequence([seed, 0x6A70]).generate_state(1, np.uint32)[0])


class _ReadWindows:
  """Maps a global batch of window indices [B] to this shard's token/target rows.

  Holds only the dataset's path between calls; the memmap is opened on first
  use in whichever process runs the map, so the transform pickles cheaply.
  """

  def __init__(self, data: TokenData, split: str, seq_len: int, num_microbatches: int,
               rows: int, first_row: int):
    self._data = data
    self._split = split
    self._seq_len = seq_len
    self._micro = num_microbatches
    self._rows = slice(first_row, first_row + rows)

  def __call__(self, windows: np.ndarray) -> dict[str, np.ndarray]:
    tokens = self._data.split(self._split)
    # [B] -> [micro, B/micro] -> this shard's row block of each microbatch.
    local = np.asarray(windows).reshape(self._micro, -1)[:, self._rows]
    span = self._seq_len + 1
    out = np.empty(local.shape + (span,), np.int32)  # [micro, rows, seq+1]
    for idx in np.ndindex(local.shape):
      start = int(local[idx]) * self._seq_len
      out[idx] = tokens[start:start + span]
    return {"tokens": np.ascontiguousarray(out[..., :-1]),
            "targets": np.ascontiguousarray(out[..., 1:])}


def train_dataset(data: str | os.PathLike[str] | TokenData, *, seq_len: int, batch_size: int,
                  num_microbatches: int, seed: int, shard_index: int = 0,
                  shard_count: int = 1, split: str = "train") -> grain.MapDataset:
  """Returns an infinite grain MapDataset whose element k is global batch k.

  Each element is {'tokens', 'targets'}: int32 [M, B/M/shard_count, seq_len]
  with M = num_microbatches and B = batch_size; targets are tokens shifted by
  one. Shards with the same seed and different shard_index are disjoint and
  together form the global batch; only this shard's rows are read from disk.

  Args:
    data: a token directory or an opened `TokenData`.
    seq_len: tokens per sequence.
    batch_size: the global batch in sequences, over all microbatches and shards.
    num_microbatches: M.
    seed: the shuffle seed (>= 0); each epoch is shuffled differently.
    shard_index: this data-parallel replica.
    shard_count: the number of data-parallel replicas.
    split: which split to draw from.

  Raises:
    DataError: the split is missing or shorter than one sequence.
    ValueError: the batch does not divide into microbatches and shards.
  """
  import grain  # pylint: disable=g-import-not-at-top
  rows = _local_rows(batch_size, num_microbatches, shard_index, shard_count)
  data = _as_data(data)
  num_windows = data.num_sequences(split, seq_len)
  ds = grain.MapDataset.range(num_windows).shuffle(seed=_shuffle_seed(seed)).repeat()
  return ds.batch(batch_size).map(
      _ReadWindows(data, split, seq_len, num_microbatches, rows, shard_index * rows))


def train_iterator(data: str | os.PathLike[str] | TokenData, *, seq_len: int,
                   batch_size: int, num_microbatches: int, seed: int, shard_index: int = 0,
                   shard_count: int = 1, split: str = "train",
                   prefetch: int = 2) -> grain.DatasetIterator:
  """Returns an iterator over `train_dataset` batches that can save and restore its place.

  `get_state()` is a small JSON-serialisable dict ({"next_index": k}) and
  `set_state(state)` on a fresh iterator with the same arguments continues with
  exactly the batch that would have come next, in this process or another.

  Args:
    data, seq_len, batch_size, num_microbatches, seed, shard_index, shard_count,
    split: as for `train_dataset`.
    prefetch: batches read ahead in one background thread; 0 reads on demand.
  """
  import grain  # pylint: disable=g-import-not-at-top
  ds = train_dataset(data, seq_len=seq_len, batch_size=batch_size,
                     num_microbatches=num_microbatches, seed=seed, shard_index=shard_index,
                     shard_count=shard_count, split=split)
  options = grain.ReadOptions(num_threads=1 if prefetch > 0 else 0,
                              prefetch_buffer_size=max(prefetch, 0))
  return iter(ds.to_iter_dataset(options))


def eval_batches(data: str | os.PathLike[str] | TokenData, *, seq_len: int, batch_size: int,
                 num_microbatches: int, num_batches: int, shard_index: int = 0,
                 shard_count: int = 1, split: str = "val") -> list[dict[str, np.ndarray]]:
  """Returns the first num_batches batches of the validation split, in order.

  Batch j holds windows j*B .. (j+1)*B-1 of the split, laid out and sharded as in
  `train_dataset`, so every call (and every process) sees the same batches.
  When the split has fewer than num_batches*B windows, the window index wraps
  around to the start, and some windows are evaluated more than once.

  Raises:
    DataError: the split is missing or shorter than one sequence.
  """
  rows = _local_rows(batch_size, num_microbatches, shard_index, shard_count)
  data = _as_data(data)
  num_windows = data.num_sequences(split, seq_len)
  read = _ReadWindows(data, split, seq_len, num_microbatches, rows, shard_index * rows)
  return [read(np.arange(j * batch_size, (j + 1) * batch_size) % num_windows)
          for j in range(num_batches)]
