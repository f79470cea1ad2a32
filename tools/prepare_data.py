#!/usr/bin/env python3
"""Tokenises text files into a jaxpipe token directory for `data.path`.

A clone runs it as `python tools/prepare_data.py`; an installed jaxpipe as `jaxpipe-prepare-data --out DIR FILES`.
The command lives in `jaxpipe.cli.prepare_data` (see its --help).
"""

import os
import sys

try:
  import jaxpipe  # noqa: F401
except ImportError:  # run from a fresh clone without installing
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpipe.cli.prepare_data import main  # pylint: disable=g-import-not-at-top

if __name__ == "__main__":
  sys.exit(main())
