"""A lost process ends a run of several processes: one line, EXIT_LOST, no stack dump.

Two things notice that a process of the run is gone:

- JAX's coordination service (it lives in process 0): every process sends it
  heartbeats; after `dist.heartbeat_timeout_s` without one it declares that
  process dead and tells the others, and where process 0 itself is gone the
  others' heartbeats fail. The client then calls its missed-heartbeat
  callback, whose default aborts the process with a C++ stack dump;
  `jaxpipe.launch.start` gives it `on_missed_heartbeat` instead. This covers
  a process that died (SIGKILL, a crashed host) and one that was stopped
  (SIGSTOP, a hung host): neither sends heartbeats.
- `Watchdog`, a thread of our own: no training step finished for
  `dist.step_timeout_s` (a collective that never returns while every
  process is still alive, which no heartbeat reveals).

Either way the process prints one line on stderr, naming the lost process
where it is known and the command that resumes, and leaves at once with
EXIT_LOST. At once (`os._exit`), because the main thread may be blocked in a
collective that will never return, and an orderly exit would wait for the
peer that is gone (and meet the service's abort on the way). Nothing is
saved: the steps since the newest checkpoint are lost. A checkpoint that
was being written stays uncommitted (orbax renames a checkpoint into place
only after every process has written its part), and the next start ignores
it and resumes from the newest committed one.

This module imports no JAX: the callback runs on a thread of the
coordination client, and the watchdog must not need anything that a hung
device could hold.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
import threading
import time
from typing import Callable, Iterator, NoReturn, Optional

__all__ = ["EXIT_LOST", "configure", "lost", "on_missed_heartbeat", "lost_process",
           "Watchdog", "await_loss"]

# A process of the run was lost (or a step made no progress for
# dist.step_timeout_s), and this one stopped without saving: rerun the same
# command on every process to resume from the newest checkpoint. sysexits.h's
# EX_UNAVAILABLE ("a service is unavailable"): the peer this process needs is
# gone. Not 75 (EX_TEMPFAIL, which here promises that a checkpoint of the very
# step was saved, so nothing is redone), nor 128+N (this process received no
# signal), and below 128, so no shell or scheduler reads it as a death by one.
EXIT_LOST = 69

_lock = threading.Lock()
_context = {"run_dir": "", "process_id": 0, "num_processes": 1, "heartbeat_timeout_s": 0}
_verdict = threading.Event()  # set once a loss has been declared (the exit is on its way)


def configure(run_dir: str, process_id: int, num_processes: int,
              heartbeat_timeout_s: float) -> None:
  """Tells `lost` where the run's checkpoints are and which process this is."""
  _context.update(run_dir=run_dir, process_id=process_id, num_processes=num_processes,
                  heartbeat_timeout_s=heartbeat_timeout_s)


def _newest_checkpoint(run_dir: str) -> Optional[int]:
  """The newest committed checkpoint's step in run_dir (orbax names them by step), or None."""
  try:
    steps = [int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit()]
  except OSError:
    return None
  return max(steps, default=None)


def message(reason: str, who: Optional[int] = None) -> str:
  """The one line `lost` prints: who was lost and why, and the command that resumes."""
  pid, num, run_dir = (_context["process_id"], _context["num_processes"], _context["run_dir"])
  if who is not None:
    what = f"lost process {who} of {num} ({reason})"
  else:
    what = f"lost a process of the run ({reason})"
  newest = _newest_checkpoint(run_dir) if run_dir else None
  where = os.path.join(run_dir, "checkpoints")
  resume = (f"from step {newest} (the newest checkpoint in {where})" if newest is not None
            else "from step 0 (no checkpoint was committed)")
  command = shlex.join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
  return (f"error: {what}; process {pid} stopped without saving (exit {EXIT_LOST}). To resume "
          f"{resume}, run the same command again on every process; this one's: {command}")


def lost(reason: str, who: Optional[int] = None) -> NoReturn:
  """Prints the loss in one line on stderr and ends this process at once with EXIT_LOST.

  Callable from any thread; the first caller wins, later ones wait for the exit.
  """
  if not _lock.acquire(blocking=False):
    while True:  # the first caller is printing and exiting
      time.sleep(60)
  _verdict.set()
  try:
    line = message(reason, who)
  except Exception:  # pylint: disable=broad-except
    line = f"error: {reason}; stopped without saving (exit {EXIT_LOST})"
  try:
    sys.stdout.flush()
  except Exception:  # pylint: disable=broad-except
    pass
  # Straight to the descriptor: the stream object may be locked by a thread
  # that will never finish writing (one blocked in a collective holds nothing,
  # but a progress bar might be mid-line).
  os.write(2, ("\n" + line + "\n").encode("utf-8", "replace"))
  os._exit(EXIT_LOST)  # pylint: disable=protected-access


def lost_process(status: str, process_id: int) -> tuple[Optional[int], str]:
  """(the lost process if the status names one, a short reason) from the service's status.

  The coordination service names a task `/job:jax_worker/replica:0/task:N`;
  a status that names none (process 0's service unreachable: its heartbeats
  fail) means the lost one is process 0, unless this is process 0.
  """
  tasks = [int(t) for t in re.findall(r"/task:(\d+)", status)]
  others = [t for t in tasks if t != process_id]
  if others:
    return others[0], "its heartbeats stopped"
  if process_id != 0 and re.search(r"heartbeat|unavailable|deadline|connect|socket|closed",
                                    status, re.I):
    return 0, "the coordination service in process 0 stopped answering"
  first = status.strip().splitlines()[0][:200] if status.strip() else "no detail"
  return None, f"the coordination service reported: {first}"


def on_missed_heartbeat(*args) -> None:
  """The coordination client's missed-heartbeat callback: a peer (or the service) is gone.

  Called on a client thread with the error's status (its type and number of
  arguments vary between jaxlib versions, so all are read as text).
  """
  status = " ".join(str(a) for a in args)
  who, reason = lost_process(status, _context["process_id"])
  lost(reason, who)


def await_loss() -> bool:
  """In a run of several processes, waits for a loss to be declared; False if none comes.

  For an error in the main thread: a collective whose peer died may fail
  there (gloo's connection closed) before the service has declared the peer
  dead, and the loss, not that error, is what to report. Waits twice the
  heartbeat timeout (and 5 s), time enough for the service to notice; a
  single process, or a loss that never comes (a bug), returns False at once
  or after that wait, and the error goes on.
  """
  if _context["num_processes"] <= 1:
    return False
  return _verdict.wait(2 * _context["heartbeat_timeout_s"] + 5)


class Watchdog:
  """Ends the run (`lost`) when no training step finishes for `timeout_s` seconds.

  `beat()` marks a finished step; the first one arms the watchdog, since the
  first step of a process compiles, which takes as long as it takes. Inside
  `paused()` (a checkpoint save, a first evaluation, whose time depends on
  the disk or the compiler rather than on the peers) the clock stops and
  restarts on exit. A context manager: the checking thread (a daemon) runs
  inside it. `timeout_s` 0 turns it off.
  """

  def __init__(self, timeout_s: float, on_timeout: Optional[Callable[[float], None]] = None,
               clock: Callable[[], float] = time.monotonic):
    """`on_timeout(seconds)` replaces `lost` (for tests); `clock` gives the time."""
    self.timeout_s, self.clock = float(timeout_s), clock
    self.on_timeout = on_timeout or (lambda s: lost(
        f"no training step finished for {s:.0f} s (dist.step_timeout_s={self.timeout_s:g}): a "
        "process stopped or a collective hung"))
    self._last: Optional[float] = None  # when the clock last restarted; None: not armed
    self._pauses = 0
    self._mu = threading.Lock()
    self._done = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def beat(self) -> None:
    """A step finished: restart the clock (and arm it on the first call)."""
    with self._mu:
      self._last = self.clock()

  @contextlib.contextmanager
  def paused(self) -> Iterator[None]:
    """Stops the clock inside the block; it restarts from zero when the block ends."""
    with self._mu:
      self._pauses += 1
    try:
      yield
    finally:
      with self._mu:
        self._pauses -= 1
        if self._last is not None:
          self._last = self.clock()

  def overdue(self) -> Optional[float]:
    """Seconds since the clock restarted, if past the timeout (and armed, not paused)."""
    with self._mu:
      if not self.timeout_s or self._last is None or self._pauses:
        return None
      waited = self.clock() - self._last
    return waited if waited > self.timeout_s else None

  def _watch(self) -> None:
    # Checks several times per timeout, so the run ends at most a quarter
    # late (and at least once a second for long timeouts).
    interval = min(1.0, self.timeout_s / 4)
    while not self._done.wait(interval):
      waited = self.overdue()
      if waited is not None:
        self.on_timeout(waited)
        return

  def __enter__(self) -> "Watchdog":
    if self.timeout_s:
      self._thread = threading.Thread(target=self._watch, name="jaxpipe-watchdog", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._done.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
