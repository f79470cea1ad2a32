"""Helpers to run train.py in a subprocess and read what it wrote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from jaxpipe import runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def command(run_dir: str, *overrides: str, config: str = TINY) -> list[str]:
  """The train.py command line for the tiny config writing into run_dir."""
  return [sys.executable, TRAIN, "--config", config, f"run.dir={run_dir}", *overrides]


def env(cache_dir: str) -> dict[str, str]:
  """The environment for a run: the shared corpus cache, the test XLA flags."""
  out = dict(os.environ)
  out["JAXPIPE_CACHE"] = cache_dir
  return out


def run(run_dir: str, *overrides: str, cache_dir: str, timeout: float = 300,
        config: str = TINY) -> subprocess.CompletedProcess:
  """Runs train.py to completion and returns the finished process."""
  return subprocess.run(command(run_dir, *overrides, config=config), env=env(cache_dir),
                        capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def start(run_dir: str, *overrides: str, cache_dir: str) -> subprocess.Popen:
  """Starts train.py in the background."""
  return subprocess.Popen(command(run_dir, *overrides), env=env(cache_dir),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def wait_for(predicate, timeout: float = 120.0, interval: float = 0.01) -> bool:
  """Polls predicate() until it is true or the timeout passes."""
  end = time.time() + timeout
  while time.time() < end:
    if predicate():
      return True
    time.sleep(interval)
  return False


def stopped(proc: subprocess.Popen) -> bool:
  """Whether the process has stopped: every thread stopped (T or t in /proc), a zombie, or gone."""
  try:
    states = []
    for tid in os.listdir(f"/proc/{proc.pid}/task"):
      with open(f"/proc/{proc.pid}/task/{tid}/stat") as f:
        states.append(f.read().rsplit(")", 1)[1].split()[0])
  except OSError:
    return True
  return all(s in ("T", "t", "Z") for s in states)


def records(run_dir: str) -> list[dict]:
  """Every record of metrics.jsonl (a line that is not JSON fails the test)."""
  return runs.read_records(run_dir, strict=True)


def train_losses(run_dir: str) -> dict[int, float]:
  """step -> training loss."""
  return runs.losses(run_dir, "loss", strict=True)


def val_losses(run_dir: str) -> dict[int, float]:
  """step -> validation loss."""
  return runs.losses(run_dir, "val_loss", strict=True)


def checkpoints(run_dir: str) -> list[int]:
  """Steps of the complete checkpoints in run_dir (orbax names them by step)."""
  path = os.path.join(run_dir, "checkpoints")
  if not os.path.isdir(path):
    return []
  return sorted(int(d) for d in os.listdir(path) if d.isdigit())


def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
  proc.send_signal(sig)
