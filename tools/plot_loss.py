#!/usr/bin/env python3
"""Plots the loss curves of one or several runs to a PNG.

A clone runs it as `python tools/plot_loss.py`; an installed jaxpipe as `jaxpipe-plot RUN_DIR ... --out loss.png`.
The command lives in `jaxpipe.cli.plot_loss` (see its --help).
"""

import os
import sys

try:
  import jaxpipe  # noqa: F401
except ImportError:  # run from a fresh clone without installing
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpipe.cli.plot_loss import main  # pylint: disable=g-import-not-at-top

if __name__ == "__main__":
  sys.exit(main())
