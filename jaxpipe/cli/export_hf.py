"""Export a jaxpipe run's weights as a Hugging Face Llama checkpoint (transformers loads it).

  python tools/export_hf.py --run runs/smollm-135m --out exports/smollm-135m [--step N]
  jaxpipe-export-hf --run runs/smollm-135m --out exports/smollm-135m      (installed)

Reads the newest checkpoint of --run (or --step N's), whatever mesh and
schedule trained it, and writes config.json, model.safetensors,
generation_config.json and the tokenizer files of the run's tokenizer
(docs/huggingface.md). No torch and no network are needed. The output
appears only when complete: it is written beside --out and renamed. An
existing non-empty --out is refused unless --overwrite. Bad input (no
checkpoint, a Mixture-of-Experts model, a tokenizer file that is gone)
exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

from jaxpipe.cli._common import Parser, run_reported
from jaxpipe.errors import InputError


def _check_out(out: str, overwrite: bool) -> None:
  if os.path.exists(out) and not os.path.isdir(out):
    raise InputError(f"--out {out} is a file; give a directory")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise InputError(f"--out {out} exists and is not empty; pass --overwrite to replace it")


def export(run_dir: str, out: str, *, step: int | None = None, tokenizer: str | None = None,
           overwrite: bool = False) -> tuple[int, str]:
  """Writes checkpoint `step` (None: the newest) of `run_dir` to `out` in Hugging Face form.

  Returns (the step exported, the tokenizer whose files were written).
  `tokenizer` overrides the run's data.tokenizer ('none': no tokenizer
  files). Raises InputError for bad input, with nothing left at `out`.
  """
  from jaxpipe import hf, runs  # pylint: disable=g-import-not-at-top
  _check_out(out, overwrite)
  cfg, params, step = runs.load_params(run_dir, step)
  spec = tokenizer if tokenizer is not None else cfg.data.tokenizer
  out = os.path.abspath(out)
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
  try:
    try:
      hf.save(tmp, cfg.model, params, tokenizer=spec,
              max_position_embeddings=cfg.data.seq_len)
    except InputError as e:
      if tokenizer is None and spec not in ("byte", "gpt2", "none"):
        raise InputError(f"{e} (the run's data.tokenizer; pass --tokenizer PATH, or "
                         "--tokenizer none for no tokenizer files)") from None
      raise
    _check_out(out, overwrite)  # again: something may have appeared meanwhile
    if os.path.exists(out):
      # The old directory goes only once the new one is complete.
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
                      help="replace an existing non-empty --out")
  args = parser.parse_args(argv)
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
