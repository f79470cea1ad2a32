#!/usr/bin/env python3
"""Pretrains a Llama-style model with a pipeline schedule.

A clone runs it as `python train.py`; an installed jaxpipe as `jaxpipe-train --config FILE [key=value ...]`.
The command lives in `jaxpipe.cli.train` (see its --help).
"""

import os
import runpy
import sys

# This clone's jaxpipe first, whether or not a jaxpipe is installed.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
runpy.run_module("jaxpipe.cli.train", run_name="__main__", alter_sys=True)
