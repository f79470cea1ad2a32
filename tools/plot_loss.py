#!/usr/bin/env python3
"""Plots the loss curves of one or several runs to a PNG.

A clone runs it as `python tools/plot_loss.py`; an installed jaxpipe as `jaxpipe-plot RUN_DIR ... --out loss.png`.
The command lives in `jaxpipe.cli.plot_loss` (see its --help).
"""

import os
import runpy
import sys

# This clone's jaxpipe first, whether or not a jaxpipe is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
runpy.run_module("jaxpipe.cli.plot_loss", run_name="__main__", alter_sys=True)
