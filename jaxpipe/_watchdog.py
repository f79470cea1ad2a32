"""A lost process ends a run of several processes: one line, EXIT_LOST, no stack dump.

Two watchers notice that a process of the run is gone:

- `Peers`, heartbeats of our own through the key-value store of JAX's
  coordination service (which lives in process 0): each process publishes a
  counter and watches the next process's; a counter that stands still for
  `dist.heartbeat_timeout_s` means that process died or was stopped (SIGKILL,
  SIGSTOP, a crashed or frozen host). The watcher says so in the store, where
  every process reads it, and where the service itself stops answering for
  that long, process 0 is the one lost.
- `Watchdog`: no training step finished for `dist.step_timeout_s` (a
  collective that never returns while every process is still alive), or a
  checkpoint save or first evaluation, which stop that clock, ran past
  `dist.save_timeout_s`.

JAX's coordination client has heartbeats of its own, but on a loss it
aborts the process with a C++ stack dump, and the callback it takes in its
place cannot be a Python function in jaxlib 0.10.2 (the error status it is
called with has no Python conversion: std::bad_cast, then std::terminate).
So `jaxpipe.launch.start` sets JAX's heartbeat timeout well beyond ours
(`jax_heartbeat_timeout`), as a backstop that ours always beat.

Either way the process's `Guard` (one per process, made by the command and
passed to the launcher and the trainer; it holds all of this module's state)
prints one line on stderr, naming the lost process where it is known and the
command that resumes, and leaves at once with EXIT_LOST. At once (`os._exit`), because the main thread may be blocked in a
collective that will never return, and an orderly exit would wait for the
peer that is gone. Nothing is saved: the steps since the newest checkpoint
are lost. A checkpoint that was being written stays uncommitted (orbax
renames a checkpoint into place only after every process has written its
part), and the next start ignores it and resumes from the newest committed
one.

This module imports no JAX: its threads must not need anything that a hung
device could hold.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import threading
import time
from typing import Callable, Iterator, NoReturn, Optional

__all__ = ["EXIT_LOST", "Guard", "Peers", "jax_heartbeat_timeout", "Watchdog"]

# A process of the run was lost (or a step made no progress for
# dist.step_timeout_s, a save for dist.save_timeout_s), and this one stopped
# without saving: rerun the same command on every process to resume from the
# newest checkpoint. sysexits.h's EX_UNAVAILABLE ("a service is unavailable"):
# the peer this process needs is gone. Not 75 (EX_TEMPFAIL, which here promises
# that a checkpoint of the very step was saved, so nothing is redone), nor 128+N
# (this process received no signal), and below 128, so no shell or scheduler
# reads it as a death by one.
EXIT_LOST = 69

def _newest_checkpoint(run_dir: str) -> Optional[int]:
  """The newest committed checkpoint's step in run_dir (orbax names them by step), or None."""
  try:
    steps = [int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit()]
  except OSError:
    return None
  return max(steps, default=None)


class Guard:
  """This process's part in ending a run when one of its processes is lost.

  It knows which process this is and where the run's checkpoints are (for
  the one line `lost` prints), runs this process's `Peers`, and remembers
  whether a loss has been declared (`await_loss`). One per process, and no
  state outside it: the command creates it, `jaxpipe.launch.start` fills it
  in once the processes have met (`configure`, `watch_peers`), and the
  trainer's step `Watchdog` reports through it.
  """

  def __init__(self, run_dir: str = "", process_id: int = 0, num_processes: int = 1,
               heartbeat_timeout_s: float = 0):
    self.configure(run_dir, process_id, num_processes, heartbeat_timeout_s)
    self._lock = threading.Lock()
    self._verdict = threading.Event()  # set once a loss has been declared (the exit is on its way)
    self._watchers: list[Peers] = []

  def configure(self, run_dir: str, process_id: int, num_processes: int,
                heartbeat_timeout_s: float) -> None:
    """Tells `lost` where the run's checkpoints are and which process this is."""
    self.run_dir, self.process_id, self.num_processes = run_dir, process_id, num_processes
    self.heartbeat_timeout_s = heartbeat_timeout_s

  def message(self, reason: str, who: Optional[int] = None) -> str:
    """The one line `lost` prints: who was lost and why, and the command that resumes."""
    if who is not None:
      what = f"lost process {who} of {self.num_processes} ({reason})"
    else:
      what = f"lost a process of the run ({reason})"
    newest = _newest_checkpoint(self.run_dir) if self.run_dir else None
    where = os.path.join(self.run_dir, "checkpoints")
    resume = (f"from step {newest} (the newest checkpoint in {where})" if newest is not None
              else "from step 0 (no checkpoint was committed)")
    command = shlex.join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    return (f"error: {what}; process {self.process_id} stopped without saving (exit "
            f"{EXIT_LOST}). To resume {resume}, run the same command again on every process; "
            f"this one's: {command}")

  def lost(self, reason: str, who: Optional[int] = None) -> NoReturn:
    """Prints the loss in one line on stderr and ends this process at once with EXIT_LOST.

    Callable from any thread; the first caller wins, later ones wait for the exit.
    """
    if not self._lock.acquire(blocking=False):
      while True:  # the first caller is printing and exiting
        time.sleep(60)
    self._verdict.set()
    try:
      line = self.message(reason, who)
    except Exception:  # pylint: disable=broad-except
      line = f"error: {reason}; stopped without saving (exit {EXIT_LOST})"
    try:
      sys.stdout.flush()
    except Exception:  # pylint: disable=broad-except
      pass
    # Straight to the descriptor: the stream object may be held by a thread
    # that will never finish its write. On a terminal the progress bar may be
    # mid-line: start a new one.
    start = "\n" if os.isatty(2) else ""
    os.write(2, (start + line + "\n").encode("utf-8", "replace"))
    os._exit(EXIT_LOST)  # pylint: disable=protected-access

  def watch_peers(self, client) -> "Peers":
    """Starts this process's `Peers` over the service's `client` (`stop_watching` ends it)."""
    peers = Peers(client, self.process_id, self.num_processes, self.heartbeat_timeout_s,
                  on_lost=lambda who, reason: self.lost(reason, who)).start()
    self._watchers.append(peers)
    return peers

  def stop_watching(self, done: bool = True) -> None:
    """Stops `Peers`: at the end of a run every process reached (`done`), or on the way out."""
    while self._watchers:
      self._watchers.pop().stop(done)

  def await_loss(self) -> bool:
    """In a run of several processes, waits for a loss to be declared; False if none comes.

    For an error in the main thread: a collective whose peer died fails there
    at once (gloo's connection closed) before `Peers` has noticed the peer
    gone, and the loss, not that error, is what to report. Waits twice the
    heartbeat timeout (and 5 s), time enough for `Peers` to notice; a single
    process, or a loss that never comes (a bug), returns False at once or
    after that wait, and the error goes on.
    """
    if self.num_processes <= 1:
      return False
    return self._verdict.wait(2 * self.heartbeat_timeout_s + 5)


def jax_heartbeat_timeout(heartbeat_timeout_s: int) -> int:
  """JAX's own heartbeat timeout for ours: late enough that `Peers` always acts first."""
  return 2 * heartbeat_timeout_s + 30


_PREFIX = "jaxpipe/peers/"


class Peers:
  """Heartbeats of our own through the coordination service's key-value store.

  Process i publishes a counter under `jaxpipe/peers/alive/i` every
  `timeout_s / 5` seconds and watches the counter of process (i + 1) mod n:
  each process reads one peer, so the service answers 3n small requests a
  round, whatever n. A watched counter that stands still for `timeout_s`
  (its process is dead or stopped) is a loss, which the watcher writes under
  `jaxpipe/peers/lost` before it exits; every process reads that key each
  round, so all of them leave within a round of each other. A process that
  has finished writes `done` in place of its counter, which is never stale.
  Where the service does not answer for `timeout_s`, its process (0) is lost.

  Two daemon threads: one talks to the service (a request to a stopped
  service may block), the other checks the times and acts (`on_lost(who,
  reason)`: `Guard.watch_peers` gives its `lost`).
  """

  def __init__(self, client, process_id: int, num_processes: int, timeout_s: float,
               on_lost: Callable[[Optional[int], str], None],
               clock: Callable[[], float] = time.monotonic):
    self.client, self.pid, self.num = client, process_id, num_processes
    self.watched = (process_id + 1) % num_processes
    self.timeout_s, self.clock = float(timeout_s), clock
    self.interval = self.timeout_s / 5
    self.on_lost = on_lost
    now = clock()
    self.answered = now    # the service's last answer
    self.moved = now       # when the watched counter last changed
    self.seen: Optional[str] = None
    self._done = threading.Event()
    self._threads: list[threading.Thread] = []

  def _exchange(self, count: int) -> Optional[tuple[Optional[int], str]]:
    """One round with the service: publish, read the loss key and the watched counter."""
    try:
      self.client.key_value_set(f"{_PREFIX}alive/{self.pid}", str(count), allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      return None  # the service did not answer: the checker counts the silence
    self.answered = self.clock()
    try:
      note = self.client.key_value_try_get(f"{_PREFIX}lost")
    except Exception:  # pylint: disable=broad-except
      note = ""  # no loss declared (the key does not exist)
    if note:
      who, _, reason = note.partition(":")
      return (int(who) if who.isdigit() else None), reason
    try:
      value = self.client.key_value_try_get(f"{_PREFIX}alive/{self.watched}")
    except Exception:  # pylint: disable=broad-except
      value = None  # not published yet
    if value is not None and value != self.seen:
      self.seen, self.moved = value, self.clock()
    return None

  def _talk(self) -> None:
    count = 0
    while not self._done.wait(self.interval):
      count += 1
      declared = self._exchange(count)
      if declared is not None and not self._done.is_set():
        self.on_lost(*declared)
        return

  def check(self) -> Optional[tuple[Optional[int], str]]:
    """(the lost process, the reason) if the service or the watched process went quiet."""
    now = self.clock()
    if now - self.answered > self.timeout_s and self.pid != 0:
      return 0, (f"the coordination service in process 0 did not answer for "
                 f"{now - self.answered:.0f} s")
    if self.seen != "done" and now - self.moved > self.timeout_s:
      return self.watched, f"no heartbeat for {now - self.moved:.0f} s"
    return None

  def _check(self) -> None:
    while not self._done.wait(self.interval):
      found = self.check()
      if found is None or self._done.is_set():
        continue
      who, reason = found
      if who != 0 or self.pid == 0:
        # Tell the others, without waiting long on a service that may be slow.
        tell = threading.Thread(target=self._declare, args=(who, reason), daemon=True)
        tell.start()
        tell.join(min(2.0, self.timeout_s))
      self.on_lost(who, reason)
      return

  def _declare(self, who: Optional[int], reason: str) -> None:
    try:
      self.client.key_value_set(f"{_PREFIX}lost", f"{'' if who is None else who}:{reason}",
                                allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      pass

  def start(self) -> "Peers":
    """Starts the two threads."""
    for target, name in ((self._talk, "jaxpipe-peers"), (self._check, "jaxpipe-peers-check")):
      thread = threading.Thread(target=target, name=name, daemon=True)
      thread.start()
      self._threads.append(thread)
    return self

  def stop(self, done: bool) -> None:
    """Stops watching; `done`: this process finished, so its watcher must not count it lost."""
    self._done.set()
    if done:
      try:
        self.client.key_value_set(f"{_PREFIX}alive/{self.pid}", "done", allow_overwrite=True)
      except Exception:  # pylint: disable=broad-except
        pass


class Watchdog:
  """Ends the run (`Guard.lost`) when no training step finishes for `timeout_s` seconds.

  `beat()` marks a finished step; the first one arms the watchdog, since the
  first step of a process compiles, which takes as long as it takes. Inside
  `paused()` (a checkpoint save, a first evaluation, whose time depends on
  the disk or the compiler rather than on the peers) the step clock stops
  and restarts on exit; the paused section has a bound of its own,
  `pause_timeout_s`, since a save waits at barriers for every process and
  a peer that hangs there while its heartbeats go on would hold it forever.
  A context manager: the checking thread (a daemon) runs inside it. A
  timeout of 0 turns that bound off.
  """

  def __init__(self, timeout_s: float, on_timeout: Optional[Callable[[float], None]] = None,
               clock: Callable[[], float] = time.monotonic, pause_timeout_s: float = 0,
               guard: Optional[Guard] = None):
    """`on_timeout(seconds)` replaces ending the run (for tests); `clock` gives the time;
    `pause_timeout_s` bounds each paused section (0: unbounded); `guard`: the
    process's `Guard`, whose `lost` ends the run (a lone process's by default)."""
    self.guard = guard or Guard()
    self.timeout_s, self.clock = float(timeout_s), clock
    self.pause_timeout_s = float(pause_timeout_s)
    self.on_timeout = on_timeout or self._lost
    self._last: Optional[float] = None  # when the clock last restarted; None: not armed
    self._pauses = 0
    self._paused_at: Optional[float] = None  # when the outermost pause began
    self._late_in_pause = False
    self._mu = threading.Lock()
    self._done = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def _lost(self, seconds: float) -> None:
    if self._late_in_pause:
      self.guard.lost(f"a checkpoint save or first evaluation did not finish in {seconds:.0f} s "
           f"(dist.save_timeout_s={self.pause_timeout_s:g}): a process stopped or a "
           "collective hung")
    else:
      self.guard.lost(f"no training step finished for {seconds:.0f} s (dist.step_timeout_s="
           f"{self.timeout_s:g}): a process stopped or a collective hung")

  def beat(self) -> None:
    """A step finished: restart the clock (and arm it on the first call)."""
    with self._mu:
      self._last = self.clock()

  @contextlib.contextmanager
  def paused(self) -> Iterator[None]:
    """Stops the step clock inside the block (where `pause_timeout_s` bounds it instead);
    the step clock restarts from zero when the block ends."""
    with self._mu:
      if not self._pauses:
        self._paused_at = self.clock()
      self._pauses += 1
    try:
      yield
    finally:
      with self._mu:
        self._pauses -= 1
        if not self._pauses:
          self._paused_at = None
        if self._last is not None:
          self._last = self.clock()

  def overdue(self) -> Optional[float]:
    """Seconds since the clock restarted (or the pause began), if past its bound (and armed)."""
    with self._mu:
      if self._last is None:
        return None
      if self._pauses:
        limit, since = self.pause_timeout_s, self._paused_at
      else:
        limit, since = self.timeout_s, self._last
      if not limit:
        return None
      waited = self.clock() - since
      late = waited > limit
      if late:
        self._late_in_pause = bool(self._pauses)
    return waited if late else None

  def _watch(self) -> None:
    # Checks several times per bound, so the run ends at most a quarter
    # late (and at least once a second for long bounds).
    interval = min(1.0, min(t for t in (self.timeout_s, self.pause_timeout_s) if t) / 4)
    while not self._done.wait(interval):
      waited = self.overdue()
      if waited is not None:
        self.on_timeout(waited)
        return

  def __enter__(self) -> "Watchdog":
    if self.timeout_s or self.pause_timeout_s:
      self._thread = threading.Thread(target=self._watch, name="jaxpipe-watchdog", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._done.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
