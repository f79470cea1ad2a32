#!/usr/bin/env python3
"""Export a jaxpipe run as a Hugging Face Llama checkpoint (see jaxpipe/cli/export_hf.py).

  python tools/export_hf.py --run RUN_DIR --out DIR [--step N] [--overwrite]
"""

import os
import runpy
import sys

# This clone's jaxpipe first, whether or not a jaxpipe is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
runpy.run_module("jaxpipe.cli.export_hf", run_name="__main__", alter_sys=True)
