#!/usr/bin/env python3
"""Plans a pipeline run before launch: memory per device, work per stage, bubbles.

A clone runs it as `python tools/planner.py`; an installed jaxpipe as `jaxpipe-plan --config FILE`.
The command lives in `jaxpipe.cli.planner` (see its --help).
"""

import os
import runpy
import sys

# This clone's jaxpipe first, whether or not a jaxpipe is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
runpy.run_module("jaxpipe.cli.planner", run_name="__main__", alter_sys=True)
