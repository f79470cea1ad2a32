"""Helpers shared by the data tests: small datasets and error checks."""

import numpy as np

from jaxpipe import data as jd
from jaxpipe.errors import DataError


def write_arange(path, n=4000, vocab=5000, val=None):
  """A dataset whose token at position i is i, so every window shows where it came from."""
  splits = {"train": np.arange(n), "val": np.arange(val if val is not None else n // 4)}
  return jd.write_tokens(path, splits, vocab_size=vocab, eos_id=0, tokenizer="byte")


def one_line(err: DataError, needle: str) -> str:
  """The error's message, checked to be one line that contains `needle`."""
  message = str(err)
  assert "\n" not in message
  assert needle in message, message
  return message


def overwrite(file, at=10, count=5):
  """Overwrites `count` tokens in place with other in-range ids: same size, new bytes."""
  ids = np.memmap(file, dtype="<u2", mode="r+")
  ids[at:at + count] = (ids[at:at + count] + 1) % 7
  ids.flush()
  del ids
