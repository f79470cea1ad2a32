#!/usr/bin/env python3
"""Continues a text prompt with a trained run's model (or a Hugging Face Llama's).

A clone runs it as `python tools/generate.py`; an installed jaxpipe as `jaxpipe-generate --run RUN_DIR --prompt TEXT`.
The command lives in `jaxpipe.cli.generate` (see its --help).
"""

import os
import sys

try:
  import jaxpipe  # noqa: F401
except ImportError:  # run from a fresh clone without installing
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpipe.cli.generate import main  # pylint: disable=g-import-not-at-top

if __name__ == "__main__":
  sys.exit(main())
