"""Pretrains a Llama-style model with a pipeline schedule.

  python train.py --config configs/quickstart.yaml [section.key=value ...]
  jaxpipe-train --config configs/quickstart.yaml [section.key=value ...]   (installed)

Running the same command again resumes from the newest checkpoint in run.dir;
a larger run.steps continues a finished run; --resume refuses to start one
that has no checkpoint. Exit status: 0 done; 2 bad input (one line on stderr,
nothing created); 3 stopped on a non-finite loss (nan_policy=stop); 69 a
process of a multi-process run was lost (or a step hung for
dist.step_timeout_s, a save for dist.save_timeout_s), stopped without saving
(rerun every process to resume from the newest checkpoint); 75 stopped by SIGTERM/SIGINT after saving a
checkpoint (rerun to resume); 74 a write into run.dir failed (disk full, quota,
permission), stopped at once (rerun to resume from the newest intact
checkpoint, which the error line names); 128+signal stopped at once by a
second signal, without saving (130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    print(f"error: {message} (usage: python train.py --config FILE [key=value ...])",
          file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
  """Parses the command line, trains (or resumes) and returns the exit status."""
  from jaxpipe import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe.cli import _keys  # pylint: disable=g-import-not-at-top
  # The keys are listed from the config's dataclasses, so --help never drifts from them.
  title, _, resuming = __doc__.strip().split("\n\n")[:3]
  parser = _Parser(description=f"{title}\n\n{resuming}",
                   formatter_class=argparse.RawDescriptionHelpFormatter,
                   epilog="config sections and keys, with their defaults (a YAML file sets\n"
                   "them; section.key=value overrides them):\n\n"
                   + "\n".join(_keys.describe()))
  parser.add_argument("--config", required=True, help="YAML config file (see configs/)")
  parser.add_argument("--resume", action="store_true",
                      help="refuse to start unless run.dir holds a checkpoint to resume from "
                      "(without it, a run.dir with no checkpoint starts a new run)")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=3e-4")
  args = parser.parse_args(argv)

  from jaxpipe import _watchdog, _writes, launch  # pylint: disable=g-import-not-at-top
  from jaxpipe.errors import InputError  # pylint: disable=g-import-not-at-top
  # This process's watch over the others of its run: the launcher fills it
  # in, the trainer's step watchdog reports through it, and an error below
  # asks it whether a loss is on its way.
  guard = _watchdog.Guard()
  try:
    cfg = config_lib.load(args.config, args.overrides)
    launch.prepare_devices(cfg)  # must run before JAX starts its backend
    from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
    launch.start(cfg, guard)
    summary = trainer.train(cfg, require_resume=args.resume, guard=guard)
    # Every process got here: none may now take another's exit for a loss.
    guard.stop_watching(done=True)
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except _writes.WriteFailed as e:
    # A save's collectives fail at once when a peer dies (gloo's connection
    # reset), before the heartbeats have told the peer lost: in a run of
    # several processes the loss, if one comes, is what to report (69).
    if guard.await_loss():
      while True:
        time.sleep(60)
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Without the interpreter's shutdown: orbax's and TensorBoard's writers
    # would wait on, and trace back from, the writes that failed.
    os._exit(_writes.EXIT_IOERR)  # pylint: disable=protected-access
  except KeyboardInterrupt as e:
    # A second SIGINT/SIGTERM (the loop's handler gives its number), or Ctrl-C
    # before training began: stop at once. Exiting without the interpreter's
    # shutdown leaves a save in progress unfinished (the next start ignores
    # it) instead of tracing back from it.
    signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
    print("stopped at once by an interrupt, without saving; run the same command to resume "
          "from the last checkpoint", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # trainer.EXIT_SIGNAL + the signal, written out: trainer may not be imported yet.
    os._exit(128 + signum)  # pylint: disable=protected-access
  except Exception:
    # In a run of several processes, a collective whose peer died fails here
    # at once, before the heartbeats have told the peer lost; then the loss
    # is what to report, not this error. The thread that declares the loss
    # prints its line and ends the process; raising here would race it with
    # a traceback, so this thread waits for that exit.
    if guard.await_loss():
      while True:
        time.sleep(60)
    raise
  if summary["is_main"]:
    print(trainer.format_summary(summary), flush=True)
    if summary["exit_code"] == 0:
      print(next_steps(cfg.run.dir, sample_prompt(summary["run"].data)), flush=True)
  return summary["exit_code"]


def _here(path: str) -> str:
  """`path` relative to the working directory when it lies below it, else absolute."""
  rel = os.path.relpath(path)
  return path if rel.startswith("..") else rel


def _clone_root():
  """The clone this jaxpipe runs from (it has tools/), or None for an installed package."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return root if os.path.isdir(os.path.join(root, "tools")) else None


def sample_prompt(data, words: int = 4) -> str:
  """The first few words of a dataset's validation text: a prompt in the run's own language.

  The val split begins at a paragraph or document (tools/prepare_data.py
  holds out whole ones), so its first words read as the start of a text.
  """
  tokenizer = data.load_tokenizer()
  ids = [int(i) for i in data.split("val")[:64 * words]]
  while ids and ids[0] == tokenizer.eos_id:
    ids.pop(0)
  cut = tokenizer.eos_id not in ids  # the text read may stop inside a word
  if not cut:  # the first document only
    ids = ids[:ids.index(tokenizer.eos_id)]
  found = "".join(c if c.isprintable() else " " for c in tokenizer.decode(ids)).split()
  chosen = (found[:-1] if cut else found)[:words]
  # A prompt that ends mid-sentence asks for a continuation, not a new sentence.
  return " ".join(chosen).rstrip(",;:.!?") or "The"


def next_steps(run_dir: str, prompt: str = "The") -> str:
  """What a user can do with a finished run (sample, plot, export, view), as commands.

  `prompt` is the sampling command's text to continue (`sample_prompt`).
  """
  root, bindir = _clone_root(), os.path.dirname(sys.executable)

  def command(tool: str, script: str) -> str:
    if root is None:
      return script
    return (f"{shlex.quote(_here(sys.executable))} "
            f"{shlex.quote(_here(os.path.join(root, 'tools', tool + '.py')))}")

  d, q = shlex.quote(run_dir), lambda *p: shlex.quote(os.path.join(run_dir, *p))
  tensorboard = (shlex.quote(_here(os.path.join(bindir, "tensorboard"))) if root else "tensorboard")
  extra = (f"{shlex.quote(_here(os.path.join(bindir, 'pip')))} install -e '.[tensorboard]'"
           if root else "pip install 'jaxpipe[tensorboard]'")
  return "\n".join([
      "next:",
      f"  sample  {command('generate', 'jaxpipe-generate')} --run {d} --prompt {shlex.quote(prompt)}",
      f"  plot    {command('plot_loss', 'jaxpipe-plot')} {d} --out {q('loss.png')}",
      f"  export  {command('export_hf', 'jaxpipe-export-hf')} --run {d} --out {q('hf')}"
      "   (a Hugging Face Llama directory)",
      f"  view    {tensorboard} --logdir {q('tb')}   (after {extra})",
  ])


if __name__ == "__main__":
  sys.exit(main())
