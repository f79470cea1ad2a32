"""Export a jaxpipe run's weights as a Hugging Face Llama checkpoint (transformers loads it).

  python tools/export_hf.py --run runs/smollm-135m --out exports/smollm-135m [--step N]
  jaxpipe-export-hf --run runs/smollm-135m --out exports/smollm-135m      (installed)

Reads the newest checkpoint of --run (or --step N's), whatever mesh and
schedule trained it, and writes config.json, model.safetensors,
generation_config.json and the tokenizer files of the run's tokenizer
(docs/huggingface.md). No torch and no network are needed. The output
appears only when complete: it is written beside --out and renamed, with
jaxpipe_export.json naming the run, the step and the files written. --out
may be a new folder inside the run, never the run itself, a folder that
holds it, or its checkpoints; an existing non-empty --out is replaced only
with --overwrite, and only if it is an earlier export holding nothing but
the files its jaxpipe_export.json lists. Bad input (no checkpoint, a
Mixture-of-Experts model, a tokenizer file that is gone, an --out that must
not be written) exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

from jaxpipe import accel
from jaxpipe._files import fresh_dir
from jaxpipe.cli._common import Parser, run_reported
from jaxpipe.data import BUILTIN_TOKENIZERS
from jaxpipe.errors import InputError


# Written into every export; --overwrite replaces only a directory that holds
# this file and nothing but the files it lists, so it never deletes what
# export did not write.
MARKER = "jaxpipe_export.json"
_MARKER_FORMAT = "jaxpipe-hf-export"


def _inside(path: str, parent: str) -> bool:
  """Whether real path `path` is `parent` or lies below it."""
  return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def _is_run_dir(path: str) -> bool:
  """Whether `path` looks like a training run's directory (config.yaml beside its records)."""
  from jaxpipe.runs import METRICS  # pylint: disable=g-import-not-at-top
  return os.path.isfile(os.path.join(path, "config.yaml")) and (
      os.path.isdir(os.path.join(path, "checkpoints"))
      or os.path.isfile(os.path.join(path, METRICS)))


def _export_files(out: str) -> set[str] | None:
  """The entries a previous export wrote into `out`, from its marker; None if it is none."""
  try:
    with open(os.path.join(out, MARKER), encoding="utf-8") as f:
      marker = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(marker, dict) or marker.get("format") != _MARKER_FORMAT:
    return None
  files = marker.get("files")
  if not isinstance(files, list) or not all(isinstance(x, str) for x in files):
    return None
  return set(files) | {MARKER}


def _check_out(out: str, run_dir: str, overwrite: bool) -> None:
  """Refuses an --out that export must not write: the run, a folder holding it, or foreign files."""
  real, run = os.path.realpath(out), os.path.realpath(run_dir)
  if _inside(run, real):
    what = "is the run directory" if real == run else f"holds the run directory {run_dir}"
    raise InputError(f"--out {out} {what}; export into a new folder (e.g. {run_dir}/hf)")
  if _inside(real, os.path.join(run, "checkpoints")):
    raise InputError(f"--out {out} is inside the run's checkpoints, which training prunes; "
                     f"export into a new folder (e.g. {run_dir}/hf)")
  if os.path.exists(out) and not os.path.isdir(out):
    raise InputError(f"--out {out} is a file; give a directory")
  if not os.path.isdir(out) or not os.listdir(out):
    return
  if _is_run_dir(out):
    raise InputError(f"--out {out} is a training run's directory; export into a new folder")
  if not overwrite:
    raise InputError(f"--out {out} exists and is not empty; pass --overwrite to replace an "
                     "earlier export there, or give a new folder")
  ours = _export_files(out)
  if ours is None:
    raise InputError(f"--out {out} is not an earlier export (no {MARKER}; it holds "
                     f"{_listing(os.listdir(out))}); --overwrite replaces only an export, so "
                     "give a new folder")
  foreign = sorted(set(os.listdir(out)) - ours)
  if foreign:
    raise InputError(f"--out {out} holds files export did not write ({_listing(foreign)}); "
                     "move them away or give a new folder")


def _listing(names: list[str], most: int = 4) -> str:
  """'a, b, c and 3 more': a short list of directory entries for a message."""
  names = sorted(names)
  shown = ", ".join(names[:most])
  return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def export(run_dir: str, out: str, *, step: int | None = None, tokenizer: str | None = None,
           overwrite: bool = False) -> tuple[int, str]:
  """Writes checkpoint `step` (None: the newest) of `run_dir` to `out` in Hugging Face form.

  Returns (the step exported, the tokenizer whose files were written).
  `tokenizer` overrides the run's data.tokenizer ('none': no tokenizer
  files). `out` must not be the run directory or hold it; an existing
  non-empty `out` is replaced only with `overwrite` and only if it is an
  earlier export holding nothing but what that export wrote (its
  jaxpipe_export.json lists it). Raises InputError for bad input, with
  nothing left at `out` and nothing else touched.
  """
  from jaxpipe import hf, runs  # pylint: disable=g-import-not-at-top
  _check_out(out, run_dir, overwrite)
  cfg, params, step = runs.load_params(run_dir, step)
  spec = tokenizer if tokenizer is not None else cfg.data.tokenizer
  out = os.path.abspath(out)
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  # Not mkdtemp: its 0700 would make the export unreadable to the user's group.
  tmp = fresh_dir(parent, f".{os.path.basename(out)}.tmp-")
  try:
    try:
      hf.save(tmp, cfg.model, params, tokenizer=spec,
              max_position_embeddings=cfg.data.seq_len)
    except InputError as e:
      if tokenizer is None and spec not in (*BUILTIN_TOKENIZERS, "none"):
        raise InputError(f"{e} (the run's data.tokenizer; pass --tokenizer PATH, or "
                         "--tokenizer none for no tokenizer files)") from None
      raise
    written = sorted(os.listdir(tmp))
    with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
      json.dump({"format": _MARKER_FORMAT, "run": os.path.abspath(run_dir), "step": step,
                 "tokenizer": spec, "files": written}, f, indent=1)
      f.write("\n")
    _check_out(out, run_dir, overwrite)  # again: something may have appeared meanwhile
    if os.path.exists(out):
      # The old export goes only once the new one is complete.
      old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=parent)
      os.rename(out, os.path.join(old, "x"))
      os.rename(tmp, out)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return step, spec


def main(argv: list[str] | None = None) -> int:
  """Parses arguments, exports the checkpoint and prints a one-line summary."""
  parser = Parser(prog="export_hf", description=__doc__.split("\n\n")[0])
  parser.add_argument("--run", required=True, help="the run.dir of a training run")
  parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
  parser.add_argument("--step", type=int, default=None,
                      help="the checkpoint to export (default: the newest)")
  parser.add_argument("--tokenizer", default=None,
                      help="byte, gpt2, a tokenizer.json path, or none (default: the run's "
                           "data.tokenizer)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace an earlier export at --out (never other files)")
  args = parser.parse_args(argv)
  accel.cpu_without_driver()  # before JAX starts: a CUDA plugin without a GPU stays quiet
  start = time.perf_counter()

  def summary(done: tuple[int, str]) -> str:
    step, spec = done
    files = "" if spec == "none" else f", tokenizer {spec}"
    return (f"export_hf: step {step} of {args.run} -> {args.out} (LlamaForCausalLM{files}) "
            f"in {time.perf_counter() - start:.1f}s")

  return run_reported("export_hf", lambda: export(
      args.run, args.out, step=args.step, tokenizer=args.tokenizer, overwrite=args.overwrite),
      summary, interrupted="interrupted; nothing was written at --out")


if __name__ == "__main__":
  sys.exit(main())
