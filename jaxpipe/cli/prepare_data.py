"""Tokenise text files into a jaxpipe token directory for `data.path`.

  python tools/prepare_data.py --tokenizer gpt2 --out data/mine notes/ *.jsonl
  jaxpipe-prepare-data --tokenizer gpt2 --out data/mine notes/ *.jsonl   (installed)
  python tools/prepare_data.py --tokenizer path/to/tokenizer.json --out data/fw \
      --text-key text fineweb-edu/sample/10BT/*.parquet

Inputs: .txt and .md files (one document each), .jsonl/.json with one object per
line holding the text in --text-key, .parquet shards with a --text-key column
(needs pyarrow), and any other UTF-8 text file named itself (LICENSE, README),
read as a .txt. Directories are searched recursively for those extensions;
their other files are skipped and named with the reason (not UTF-8 text, or
text without one of those extensions: name it to include it) in the summary
line and in meta.json; hidden files and folders are passed over. Every k-th
paragraph or document (k = 1 / --val-fraction, which must be in (0, 0.5])
goes to the val split. Both splits must hold one sequence of --seq-len + 1
tokens (default 2048, the seq_len of the smollm and moe-10b configs; give the
data.seq_len you will train with). The output appears only when complete. Bad
input (a file named itself that is not UTF-8 text, say) exits with status 2,
one line on stderr and nothing written.
"""

from __future__ import annotations

import os
import sys
import time

from jaxpipe.cli._common import Parser, run_reported
from jaxpipe.data import name_some, prepare_files


def _skipped(meta: dict) -> str:
  """'; skipped N files, REASON: names' for each reason the input folders' files were skipped.

  Reasons in the order of their first file; '' when nothing was skipped.
  """
  reasons = meta.get("skipped_reasons", {})
  groups: dict[str, list[str]] = {}
  for path in meta.get("skipped_files", []):
    # Named as the user can find them: relative to here when they lie below it.
    name = path if os.path.relpath(path).startswith("..") else os.path.relpath(path)
    groups.setdefault(reasons.get(path, "of unknown type"), []).append(name)
  return "".join(f"; skipped {len(names)} file{'s' if len(names) != 1 else ''}, {why}: "
                 f"{name_some(names)}" for why, names in groups.items())


def main(argv: list[str] | None = None) -> int:
  """Parses arguments, builds the dataset and prints a one-line summary."""
  parser = Parser(prog="prepare_data", description=__doc__.split("\n\n")[0])
  parser.add_argument("inputs", nargs="+", metavar="FILES_OR_DIRS")
  parser.add_argument("--out", required=True, help="dataset directory to create")
  parser.add_argument("--tokenizer", default="gpt2",
                      help="byte, gpt2, or the path of a tokenizer.json (default gpt2)")
  parser.add_argument("--val-fraction", type=float, default=0.01,
                      help="share of paragraphs/documents held out for val, in (0, 0.5] "
                           "(default 0.01)")
  parser.add_argument("--seq-len", type=int, default=2048,
                      help="the data.seq_len to train with: each split must hold seq_len+1 "
                           "tokens (default 2048)")
  parser.add_argument("--text-key", default="text",
                      help="JSON field / Parquet column with the text (default text)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace an existing dataset at --out")
  parser.add_argument("--quiet", action="store_true", help="no progress line")
  args = parser.parse_args(argv)
  start = time.perf_counter()

  def summary(data) -> str:
    sizes = ", ".join(f"{data.num_tokens(s):,} {s}" for s in data.split_names)
    return (f"prepare_data: {sizes} tokens ({data.tokenizer}, vocab {data.vocab_size}) in "
            f"{time.perf_counter() - start:.1f}s -> {data.path}{_skipped(data.meta)}")

  return run_reported("prepare_data", lambda: prepare_files(
      args.inputs, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
      seq_len=args.seq_len, text_key=args.text_key, overwrite=args.overwrite,
      progress=not args.quiet), summary, interrupted="interrupted; nothing was written")


if __name__ == "__main__":
  sys.exit(main())
