#!/usr/bin/env python3
"""Pretrains a Llama-style model with a pipeline schedule.

  python train.py --config configs/quickstart.yaml [section.key=value ...]

Running the same command again resumes from the newest checkpoint in run.dir;
a larger run.steps continues a finished run. Exit status: 0 done, 2 bad input
(one line on stderr), 3 stopped on a non-finite loss (nan_policy=stop),
128+signal when SIGTERM/SIGINT stopped it after saving a checkpoint, 130 when
a second signal stopped it at once.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    print(f"error: {message} (usage: python train.py --config FILE [key=value ...])",
          file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
  parser = _Parser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True, help="YAML config file (see configs/)")
  parser.add_argument("--resume", action="store_true",
                      help="require a checkpoint in run.dir to resume from")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=3e-4")
  args = parser.parse_args(argv)

  from jaxpipe import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe import launch  # pylint: disable=g-import-not-at-top
  from jaxpipe.errors import InputError  # pylint: disable=g-import-not-at-top
  try:
    cfg = config_lib.load(args.config, args.overrides)
    launch.prepare_devices(cfg)  # must run before JAX starts its backend
    from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
    launch.start(cfg)
    summary = trainer.train(cfg, require_resume=args.resume)
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    # A second SIGINT/SIGTERM, or Ctrl-C before training began: stop at once.
    # Exiting without the interpreter's shutdown leaves a save in progress
    # unfinished (the next start ignores it) instead of tracing back from it.
    print("stopped at once by an interrupt, without saving; run the same command to resume "
          "from the last checkpoint", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)  # pylint: disable=protected-access
  if summary["is_main"]:
    print(trainer.format_summary(summary), flush=True)
  return summary["exit_code"]


if __name__ == "__main__":
  sys.exit(main())
