"""A run's folder: that it can be written, and that one run at a time writes it.

`check_writable(run_dir)` refuses, creating nothing, a `run.dir` that cannot
be created or written (a path below a file, a read-only or virtual file
system, no permission), so that such a run stops before anything is
compiled. `hold(run_dir)` takes the folder for this process: a second
`train.py` pointed at it is refused in one line naming the holder's process
id and host.

The hold is an advisory `flock` on `run.dir/.jaxpipe.lock`: the kernel
releases it when the holding process ends, however it ends, so a lock left
by a killed run never blocks the next one, and nothing has to guess whether
a recorded process is still alive. The file's text (process id, host,
start time, command) only says who holds it. Where the file system has no
`flock` (some network mounts), the text is the lock: a holder recorded on
this host whose process is gone is stale and taken over; one recorded on
another host is refused, with the file named so that a user who knows that
run has ended can delete it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from typing import Optional

from jaxpipe.errors import ConfigError

__all__ = ["LOCK_NAME", "RunLock", "check_free", "check_writable", "hold", "holder"]

LOCK_NAME = ".jaxpipe.lock"

# flock(2) answers these where a file system does not implement it.
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def check_writable(run_dir: str) -> None:
  """Raises ConfigError unless `run_dir` exists as a writable folder or can be created.

  Nothing is left behind: the probe is a temporary folder made and removed
  in `run_dir`, or in its nearest existing ancestor when `run_dir` does not
  exist yet (permission bits alone do not tell: root may write anywhere
  except where the file system refuses, as /proc does).
  """
  path = os.path.abspath(run_dir)
  probe = path
  while not os.path.lexists(probe):
    probe = os.path.dirname(probe)
  what = "written" if probe == path else "created"
  if not os.path.isdir(probe):
    raise ConfigError(f"run.dir={run_dir} cannot be {what}: {probe} is not a folder; "
                      "choose another run.dir")
  try:
    os.rmdir(tempfile.mkdtemp(prefix=".jaxpipe-probe-", dir=probe))
  except OSError as e:
    raise ConfigError(f"run.dir={run_dir} cannot be {what}: no folder can be made in {probe} "
                      f"({e.strerror}); choose another run.dir or fix that folder's "
                      "permissions") from None


def _describe(text: str) -> tuple[str, Optional[dict]]:
  """A lock file's text as words ('process 12 on host h since ...'), and as read."""
  try:
    info = json.loads(text)
    words = f"process {info['pid']} on host {info['host']}"
  except (ValueError, KeyError, TypeError, AttributeError):
    return "another process", None
  if info.get("started"):
    words += f" (since {info['started']})"
  return words, info


def _busy(run_dir: str, words: str, advice: str = "") -> ConfigError:
  return ConfigError(f"run.dir={run_dir} is in use by {words}: a run writes its folder alone; "
                     f"wait for that run to end or give this one another run.dir{advice}")


def _unreadable(run_dir: str, lock_path: str) -> ConfigError:
  return ConfigError(f"run.dir={run_dir} is another user's: its lock file {lock_path} cannot be "
                     "opened (permission denied); give this run another run.dir")


def _alive_here(info: Optional[dict]) -> bool:
  """Whether a lock's recorded holder is a live process of this host (no flock case)."""
  if not info or info.get("host") != socket.gethostname():
    return info is not None  # another host's holder cannot be checked: assume it runs
  try:
    os.kill(int(info["pid"]), 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return int(info["pid"]) != os.getpid()


def holder(run_dir: str) -> Optional[str]:
  """Who holds `run_dir` ('process 12 on host h ...'), or None; creates and changes nothing."""
  lock_path = os.path.join(run_dir, LOCK_NAME)
  try:
    fd = os.open(lock_path, os.O_RDONLY)
  except FileNotFoundError:
    return None
  except PermissionError:
    raise _unreadable(run_dir, lock_path) from None
  try:
    text = os.read(fd, 4096).decode(errors="replace")
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
      return _describe(text)[0]
    except OSError as e:
      if e.errno not in _NO_FLOCK:
        raise
      words, info = _describe(text)
      return words if _alive_here(info) else None
    return None
  finally:
    os.close(fd)  # closing drops the shared lock, if one was taken


def check_free(run_dir: str) -> None:
  """Raises ConfigError naming the holder if another process holds `run_dir`; creates nothing."""
  words = holder(run_dir)
  if words:
    raise _busy(run_dir, words)


class RunLock:
  """This process's hold on a run folder; `release()` (or the process's end) lets it go."""

  def __init__(self, path: str, fd: int):
    self.path, self._fd = path, fd

  def release(self) -> None:
    """Empties the lock file and releases it (a second call does nothing)."""
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)
    except OSError:
      pass  # a full or vanished disk: the kernel still drops the flock below
    os.close(fd)


def hold(run_dir: str) -> RunLock:
  """Takes `run_dir` (which must exist) for this process; ConfigError if another holds it.

  The lock file stays after release (empty): removing it would let two
  processes lock two different files of the same name.
  """
  lock_path = os.path.join(run_dir, LOCK_NAME)
  try:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
  except PermissionError:
    raise _unreadable(run_dir, lock_path) from None
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise _busy(run_dir, _describe(os.pread(fd, 4096, 0).decode(errors="replace"))[0]) from None
    except OSError as e:
      if e.errno not in _NO_FLOCK:
        raise
      words, info = _describe(os.pread(fd, 4096, 0).decode(errors="replace"))
      if _alive_here(info):
        raise _busy(run_dir, words,
                    f" (this file system has no file locks; if that run has ended, delete "
                    f"{lock_path})") from None
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
  except BaseException:
    os.close(fd)
    raise
  return RunLock(lock_path, fd)
