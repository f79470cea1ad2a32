#!/usr/bin/env python3
"""Checks jaxpipe on one NVIDIA GPU in a few minutes and writes what it measured.

A clone runs it as `python tools/device_check.py --out DIR` (or `--dry-run` on a CPU).
The command lives in `jaxpipe.cli.device_check` (see its --help).
"""

import os
import runpy
import sys

# This clone's jaxpipe first, whether or not a jaxpipe is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
runpy.run_module("jaxpipe.cli.device_check", run_name="__main__", alter_sys=True)
