#!/usr/bin/env python3
"""Pretrains a Llama-style model with a pipeline schedule.

A clone runs it as `python train.py`; an installed jaxpipe as `jaxpipe-train --config FILE [key=value ...]`.
The command lives in `jaxpipe.cli.train` (see its --help).
"""

import os
import sys

try:
  import jaxpipe  # noqa: F401
except ImportError:  # run from a fresh clone without installing
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jaxpipe.cli.train import main  # pylint: disable=g-import-not-at-top

if __name__ == "__main__":
  sys.exit(main())
