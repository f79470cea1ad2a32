#!/usr/bin/env python3
"""Export a jaxpipe run as a Hugging Face Llama checkpoint (see jaxpipe/cli/export_hf.py).

  python tools/export_hf.py --run RUN_DIR --out DIR [--step N] [--overwrite]
"""

import os
import sys

try:
  import jaxpipe  # noqa: F401
except ImportError:  # run from a fresh clone without installing
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpipe.cli.export_hf import main  # pylint: disable=g-import-not-at-top

if __name__ == "__main__":
  sys.exit(main())
