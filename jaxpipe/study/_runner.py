"""Running cells: worker processes of train.py, pinned to cores, resumable.

`Runner.run(cells)` keeps `jobs` trainers running at a time, each in a
session of its own and (with one thread each) on a core of its own; on
SIGINT or SIGTERM it asks every trainer to checkpoint and stop.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

from jaxpipe.study._cells import (
    ROOT, TRAIN, SINGLE_THREAD_FLAGS, Cell, say, fmt_duration, read_records, cell_state,
    write_marker, marker_wall)

# --- running cells --------------------------------------------------------------


def child_env(threads: int, cache_dir: str) -> dict[str, str]:
  """The environment of a training process: thread flags and a shared compile cache."""
  env = dict(os.environ)
  if threads == 1 and SINGLE_THREAD_FLAGS.split("=")[0] not in env.get("XLA_FLAGS", ""):
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {SINGLE_THREAD_FLAGS}".strip()
  # Seeds of a cell compile the same programs; the cache compiles them once.
  if "JAX_COMPILATION_CACHE_DIR" not in env:
    env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
  return env


class Runner:
  """Runs cells as train.py processes, `jobs` at a time, and reports progress."""

  def __init__(self, config_path: str, *, jobs: int, threads: int, cache_dir: str,
               on_progress: Optional[Callable[[dict[str, str]], None]] = None):
    self.config_path = config_path
    self.on_progress = on_progress
    self.outcome: dict[str, str] = {}
    self.jobs = jobs
    self.threads = threads
    self.env = child_env(threads, cache_dir)
    try:
      self.cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
      self.cpus = []
    self.t0 = time.time()

  def command(self, cell: Cell) -> list[str]:
    """The train.py command line of a cell."""
    return [sys.executable, TRAIN, "--config", self.config_path, *cell.overrides]

  def run(self, cells: Sequence[Cell]) -> dict[str, str]:
    """Trains every unfinished cell; returns {cell name: done | failed | interrupted}."""
    states = {c.name: cell_state(c, self.config_path) for c in cells}
    todo = [c for c in cells if states[c.name] != "done"]
    outcome = {c.name: "done" for c in cells if states[c.name] == "done"}
    self.outcome = outcome
    counts = {s: sum(v == s for v in states.values()) for s in ("new", "resume", "restart", "done")}
    say(f"{len(cells)} runs: {counts['done']} finished already, {counts['resume']} to resume "
         f"from a checkpoint, {counts['restart']} to restart, {counts['new']} to start; "
         f"{self.jobs} job(s) x {'1 thread' if self.threads == 1 else 'all threads'}")
    running: dict[str, tuple[subprocess.Popen, Cell, float, Any, int]] = {}
    finished_walls: list[float] = []
    queue = list(todo)
    free_slots = list(range(self.jobs))
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
      del signum, frame
      raise KeyboardInterrupt

    try:
      signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
      previous = None
    try:
      while queue or running:
        while queue and free_slots:
          cell = queue.pop(0)
          slot = free_slots.pop(0)
          running[cell.name] = self._start(cell, states[cell.name], slot) + (slot,)
        time.sleep(0.2)
        for name in list(running):
          proc, cell, started, log, slot = running[name]
          if proc.poll() is None:
            continue
          del running[name]
          free_slots.append(slot)
          log.close()
          wall = time.time() - started
          write_marker(cell, self.config_path, marker_wall(cell) + wall)
          _, val, _ = read_records(cell.run_dir)
          if proc.returncode == 0 and cell.steps in val:
            outcome[name] = "done"
            finished_walls.append(wall)
            what = f"val {val[cell.steps]:.4f}"
          else:
            outcome[name] = "failed"
            what = (f"FAILED (exit {proc.returncode}): {_last_line(cell)}; "
                    f"log {os.path.join(cell.run_dir, 'study.log')}")
          done = sum(v in ("done", "failed") for v in outcome.values())
          left = len(queue) + len(running)
          eta = ""
          if finished_walls and left:
            per = sum(finished_walls) / len(finished_walls)
            eta = f", about {fmt_duration(math.ceil(left / self.jobs) * per)} left"
          say(f"[{done:>3}/{len(cells)}] {name:<24} {what} ({fmt_duration(wall)}) | "
               f"elapsed {fmt_duration(time.time() - self.t0)}{eta}")
          if self.on_progress is not None:
            self.on_progress(dict(outcome))
    except KeyboardInterrupt:
      say(f"interrupted: stopping {len(running)} run(s) at a checkpoint; "
           "run the same command to resume")
      for proc, cell, started, log, _ in running.values():
        if proc.poll() is None:
          proc.send_signal(signal.SIGTERM)  # the trainer saves a checkpoint and exits
      for proc, cell, started, log, _ in running.values():
        try:
          proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
          proc.kill()
          proc.wait()
        log.close()
        write_marker(cell, self.config_path, marker_wall(cell) + time.time() - started)
        outcome[cell.name] = "interrupted"
      raise
    finally:
      if previous is not None:
        signal.signal(signal.SIGTERM, previous)
    return outcome

  def _start(self, cell: Cell, state: str, slot: int):
    if state == "restart":
      # Only the tool's own directories get here (cell_state checks the marker):
      # metrics without a checkpoint cannot be resumed, so start over.
      shutil.rmtree(cell.run_dir)
    os.makedirs(cell.run_dir, exist_ok=True)
    write_marker(cell, self.config_path, marker_wall(cell) if state == "resume" else 0.0)
    log = open(os.path.join(cell.run_dir, "study.log"), "a")
    log.write(f"$ {shlex.join(self.command(cell))}\n")
    log.flush()
    cmd = self.command(cell)
    if self.threads == 1 and self.cpus and self.jobs > 1:
      # Pin the process to a core of its own. The child pins itself and then
      # execs train.py: a preexec_fn would run Python between fork and exec,
      # which is unsafe in this process once JAX's threads exist.
      cpu = self.cpus[slot % len(self.cpus)]
      cmd = [sys.executable, "-c", _PIN_AND_EXEC, str(cpu), *cmd]
    # A session of its own: a Ctrl-C at the terminal reaches the tool alone,
    # which then sends each trainer one SIGTERM (a second signal would stop a
    # trainer before it saves).
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                            start_new_session=True)
    write_marker(cell, self.config_path, marker_wall(cell), pid=proc.pid)
    verb = {"resume": "resume", "restart": "restart", "new": "start"}[state]
    say(f"        {verb:<7} {cell.name}")
    return proc, cell, time.time(), log


_PIN_AND_EXEC = ("import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); "
                 "os.execv(sys.argv[2], sys.argv[2:])")


def _last_line(cell: Cell) -> str:
  """The last error line of a run's log."""
  try:
    with open(os.path.join(cell.run_dir, "study.log")) as f:
      lines = [l.strip() for l in f if l.strip()]
  except OSError:
    return "no log"
  for line in reversed(lines):
    if line.startswith("error:") or "Error" in line:
      return line[:200]
  return lines[-1][:200] if lines else "empty log"
