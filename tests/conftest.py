"""Test setup: eight emulated CPU devices, set before JAX starts its backend.

The two LLVM flags cut XLA's CPU compile time about fourfold, and a
persistent compilation cache lets the many train.py subprocesses that run
the same programs compile them once; the tests' models are tiny, so what
the flags cost at run time does not matter. Subprocesses inherit all of it
through the environment.
"""

import atexit
import os
import shutil
import sys
import tempfile

# The tests' own process keeps XLA's default CPU order (what the planner
# compiles with, jaxpipe.accel.xla_default_order_flags); the train.py
# processes they start get the launcher's flags on top.
_FLAGS = ("--xla_force_host_platform_device_count=8",
          "--xla_backend_optimization_level=0",
          "--xla_llvm_disable_expensive_passes=true")
_current = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_current] + [f for f in _FLAGS if f.split("=")[0] not in _current]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="jaxpipe-xla-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
