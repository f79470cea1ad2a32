"""Continues a text prompt with a trained run's model, or a Hugging Face Llama's.

  python tools/generate.py --run runs/quickstart --prompt "In the beginning"
  python tools/generate.py --hf path/to/llama_dir --prompt "Once upon a time" --top-p 0.9
  jaxpipe-generate --run runs/quickstart --prompt "..."   (installed)

Prints the prompt and its continuation as text on stdout (--only-new: the
continuation alone). It stops at the
tokenizer's end-of-text token (not printed), after --max-new-tokens tokens,
or where prompt and continuation reach the model's context length (a run's
data.seq_len, a Hugging Face config's max_position_embeddings), whichever
comes first; stopping at the context length is noted on stderr. It runs on
one device, whatever mesh the run trained on. Bad input (no such run or
step, an empty prompt, one longer than the context, a bad sampling value)
exits with status 2 and one line on stderr. See docs/generate.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from jaxpipe import accel
from jaxpipe.cli._common import Parser


def _load_run(run_dir: str, step):
  """(model config, params, tokenizer, context length, what was loaded) of a run."""
  from jaxpipe import runs  # pylint: disable=g-import-not-at-top
  from jaxpipe.data import get_tokenizer  # pylint: disable=g-import-not-at-top
  cfg, params, step = runs.load_params(run_dir, step)
  tokenizer = get_tokenizer(cfg.data.tokenizer)
  return cfg.model, params, tokenizer, cfg.data.seq_len, f"{run_dir} at step {step}"


def _load_hf(path: str):
  """(model config, params, tokenizer, context length, what was loaded) of a Llama directory."""
  from jaxpipe import hf  # pylint: disable=g-import-not-at-top
  from jaxpipe.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from jaxpipe.data import get_tokenizer  # pylint: disable=g-import-not-at-top
  from jaxpipe.errors import InputError  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(ModelConfig(), **hf.read_config(path))
  if not os.path.isfile(os.path.join(path, "tokenizer.json")):
    raise InputError(f"{path} has no tokenizer.json; generation needs the checkpoint's "
                     "tokenizer beside its weights")
  tokenizer = get_tokenizer(path)
  params = hf.load_params(path, cfg)
  with open(os.path.join(path, "config.json")) as f:
    context = json.load(f).get("max_position_embeddings")
  return cfg, params, tokenizer, context if isinstance(context, int) else None, path


def main(argv: list[str] | None = None) -> int:
  """Parses arguments, loads the model, prints prompt and continuation; returns the exit status."""
  parser = Parser(prog="generate", description=__doc__.split("\n\n")[0])
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--run", metavar="RUN_DIR", help="a run.dir that train.py wrote")
  source.add_argument("--hf", metavar="DIR",
                      help="a Hugging Face Llama directory (config.json, safetensors, "
                           "tokenizer.json)")
  parser.add_argument("--prompt", required=True, help="the text to continue")
  parser.add_argument("--step", type=int, default=None,
                      help="the run's checkpoint to read (default: the newest)")
  parser.add_argument("--max-new-tokens", type=int, default=100,
                      help="the most tokens to add (default 100)")
  parser.add_argument("--temperature", type=float, default=1.0,
                      help="0 = greedy; otherwise logits / temperature (default 1.0)")
  parser.add_argument("--top-k", type=int, default=None,
                      help="sample from the k most likely tokens only")
  parser.add_argument("--top-p", type=float, default=None,
                      help="sample from the nucleus of probability mass P, in (0, 1]")
  parser.add_argument("--seed", type=int, default=0, help="PRNG seed (default 0)")
  parser.add_argument("--only-new", action="store_true",
                      help="print the continuation alone (default: the prompt, then it)")
  args = parser.parse_args(argv)
  accel.cpu_without_driver()  # before JAX starts: a CUDA plugin without a GPU stays quiet

  from jaxpipe.errors import InputError  # pylint: disable=g-import-not-at-top
  try:
    # Everything that needs no weights is checked before they are read.
    from jaxpipe import generate as gen  # pylint: disable=g-import-not-at-top
    sampling = gen.Sampling(args.temperature, args.top_k, args.top_p)
    if not args.prompt:
      raise InputError("--prompt is empty; give some text to continue")
    if args.max_new_tokens < 0:
      raise InputError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.hf is not None and args.step is not None:
      raise InputError("--step reads a run's checkpoint; a Hugging Face directory has one set "
                       "of weights")
    if args.run is not None:
      cfg, params, tokenizer, context, what = _load_run(args.run, args.step)
    else:
      cfg, params, tokenizer, context, what = _load_hf(args.hf)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
      raise InputError("--prompt encodes to no tokens; give some text to continue")
    if context is not None and len(prompt) > context:
      raise InputError(f"--prompt is {len(prompt)} tokens, more than the context length of "
                       f"{context} tokens that {what} was trained for; shorten it")
    new = gen.decode(cfg, params, prompt, max_new_tokens=args.max_new_tokens,
                     sampling=sampling, seed=args.seed, eos_id=tokenizer.eos_id,
                     context_len=context).tokens[0]
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  ended = bool(new) and new[-1] == tokenizer.eos_id
  text = tokenizer.decode(new[:-1] if ended else new)
  print(text if args.only_new else args.prompt + text, flush=True)
  if not ended and len(new) < args.max_new_tokens and context is not None:
    print(f"note: stopped at the context length of {context} tokens (prompt {len(prompt)} + "
          f"{len(new)} new)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
