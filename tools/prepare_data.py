#!/usr/bin/env python3
"""Tokenises text files into a jaxpipe token directory for `data.path`.

A clone runs it as `python tools/prepare_data.py`; an installed jaxpipe as `jaxpipe-prepare-data --out DIR FILES`.
The command lives in `jaxpipe.cli.prepare_data` (see its --help).
"""

import os
import runpy
import sys

# This clone's jaxpipe first, whether or not a jaxpipe is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
runpy.run_module("jaxpipe.cli.prepare_data", run_name="__main__", alter_sys=True)
