#!/usr/bin/env python3
"""Continues a text prompt with a trained run's model (or a Hugging Face Llama's).

A clone runs it as `python tools/generate.py`; an installed jaxpipe as `jaxpipe-generate --run RUN_DIR --prompt TEXT`.
The command lives in `jaxpipe.cli.generate` (see its --help).
"""

import os
import runpy
import sys

# This clone's jaxpipe first, whether or not a jaxpipe is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
runpy.run_module("jaxpipe.cli.generate", run_name="__main__", alter_sys=True)
