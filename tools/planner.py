#!/usr/bin/env python3
"""Plans a pipeline run before launch: memory per device, work per stage, bubbles.

A clone runs it as `python tools/planner.py`; an installed jaxpipe as `jaxpipe-plan --config FILE`.
The command lives in `jaxpipe.cli.planner` (see its --help).
"""

import os
import sys

try:
  import jaxpipe  # noqa: F401
except ImportError:  # run from a fresh clone without installing
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpipe.cli.planner import main  # pylint: disable=g-import-not-at-top

if __name__ == "__main__":
  sys.exit(main())
