"""Writes into a run's folder that fail: caught wherever they happen, told in one line.

A run writes from three places: the loop's own thread (metrics.jsonl),
TensorBoard's writer thread, and orbax's save threads. When the disk fills,
a quota is hit, permissions change or the folder is removed, each fails its
own way: an OSError in the loop, a thread that dies (after which TensorBoard's
queue blocks the loop for ever), a checkpoint that orbax logs with its
traceback and silently does not finalize. `Watch` turns all three into one
`WriteFailed`, which the trainer lets through and `train.py` reports as one
line and exit status 74 (sysexits' EX_IOERR), without running another step
and without waiting on a writer that can no longer finish.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
import threading
from typing import Optional

__all__ = ["EXIT_IOERR", "WriteFailed", "Watch", "reason"]

EXIT_IOERR = 74

_OS_CODE = re.compile(r"os_error_code='?(\d+)")


def _errno(error: Optional[BaseException]) -> Optional[int]:
  """An error's errno: an OSError's, or the one in tensorstore's text of one."""
  if error is None:
    return None
  if isinstance(error, OSError) and error.errno is not None:
    return error.errno
  found = _OS_CODE.search(str(error))
  return int(found.group(1)) if found else None


def reason(error: BaseException) -> str:
  """Why a write failed, in a few words ('No space left on device'), from any error type.

  tensorstore (under orbax) reports an OSError as text with its errno
  (`[os_error_code='28']`); Python raises OSError with one.
  """
  if isinstance(error, OSError) and error.strerror:
    return error.strerror
  code = _errno(error)
  if code is not None:
    return os.strerror(code)
  first = (str(error).strip().splitlines() or [type(error).__name__])[0]
  return first[:200]


_IO_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
              errno.EIO, errno.ENOENT}


def io_error(error: BaseException) -> bool:
  """Whether `error` is a failed file operation (an OSError, or tensorstore's text of one)."""
  return isinstance(error, OSError) or _errno(error) is not None


def from_oserror(error: BaseException, run_dir: str) -> Optional["WriteFailed"]:
  """A WriteFailed for an OSError on a file inside `run_dir` (disk, quota, permission), or None.

  For the run folder's writes outside the loop's own checks: config.yaml,
  metrics.jsonl's rewrite on a resume, the device memory record.
  """
  name = getattr(error, "filename", None)
  if not isinstance(error, OSError) or error.errno not in _IO_ERRNOS or not name:
    return None
  root = os.path.abspath(run_dir)
  path = os.path.abspath(os.fsdecode(name))
  if os.path.commonpath([root, path]) != root:
    return None
  return WriteFailed(os.path.relpath(path, root), path, error)


def _advice(error: Optional[BaseException]) -> str:
  code = _errno(error)
  if code in (errno.ENOSPC, errno.EDQUOT):
    return "free space there (or raise the quota)"
  if code == errno.EFBIG:
    return "raise the process's file size limit (ulimit -f)"
  if code in (errno.EACCES, errno.EPERM, errno.EROFS):
    return "make the folder writable"
  return "repair the folder"


class WriteFailed(Exception):
  """A write into the run folder failed; str() is the whole one-line report."""

  def __init__(self, what: str, path: str, error: Optional[BaseException],
               newest: Optional[int] = None, checkpoint_dir: Optional[str] = None):
    self.what, self.path, self.error, self.newest = what, path, error, newest
    self.checkpoint_dir = checkpoint_dir
    super().__init__(what)

  def __str__(self) -> str:
    why = reason(self.error) if self.error is not None else "it was not written"
    if self.newest is not None:
      kept = (f"the newest intact checkpoint is step {self.newest} in {self.checkpoint_dir}; "
              f"{_advice(self.error)}, then run the same command to resume from it")
    else:
      kept = (f"there is no intact checkpoint yet; {_advice(self.error)}, then run the same "
              "command to start again")
    return f"writing {self.what} to {self.path} failed ({why}); the run stopped: {kept}"


class _OrbaxErrors(logging.Filter):
  """Keeps orbax's logged save failures off stderr (the run reports them in one line)."""

  def __init__(self):
    super().__init__()
    self.seen: list[str] = []

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
      if record.exc_info and record.exc_info[1] is not None:
        self.seen.append(str(record.exc_info[1]))
      else:
        self.seen.append(record.getMessage())
      return False
    return True


def _closed_loop(error: Optional[BaseException]) -> bool:
  """Whether an error is asyncio's 'Event loop is closed' (a callback after orbax's loop ended)."""
  return isinstance(error, RuntimeError) and "Event loop is closed" in str(error)


class Watch:
  """While entered: TensorBoard's writer thread dying of an OSError, or orbax's logged save failures, are kept.

  `thread_error()` and `orbax_error()` return the first of each, for the
  loop to raise as WriteFailed; other threads' errors go to the hook that
  was there before.
  """

  def __init__(self):
    self._errors: list[BaseException] = []
    self._orbax = _OrbaxErrors()
    self._previous = self._previous_unraisable = self._previous_except = None

  def _hook(self, args) -> None:
    # Only TensorBoard's writer thread writes into the run folder; another
    # thread's error is not a failed write and goes on as it would have.
    writer = type(args.thread).__module__.startswith("tensorboardX") if args.thread else False
    if writer and isinstance(args.exc_value, OSError):
      self._errors.append(args.exc_value)
      return
    self._previous(args)

  def _unraisable(self, args) -> None:
    # After a failed checkpoint write, tensorstore's callbacks still in
    # flight call into the event loop orbax has closed; Python would print
    # each as a bare traceback. They say nothing the run's one line does not.
    if _closed_loop(args.exc_value):
      return
    self._previous_unraisable(args)

  def _except(self, kind, value, tb) -> None:
    # The same callbacks, where tensorstore prints the error itself
    # (PyErr_Print, which goes through sys.excepthook).
    if _closed_loop(value):
      return
    self._previous_except(kind, value, tb)

  def __enter__(self) -> "Watch":
    lingering = getattr(sys.excepthook, "__self__", None)
    if isinstance(lingering, Watch):
      lingering._restore()  # pylint: disable=protected-access
    absl = logging.getLogger("absl")
    for stale in [f for f in absl.filters if isinstance(f, _OrbaxErrors)]:
      absl.removeFilter(stale)  # it would take this run's failures from it
    self._previous, self._previous_unraisable = threading.excepthook, sys.unraisablehook
    self._previous_except = sys.excepthook
    threading.excepthook, sys.unraisablehook = self._hook, self._unraisable
    sys.excepthook = self._except
    logging.getLogger("absl").addFilter(self._orbax)
    return self

  def __exit__(self, kind, value, tb) -> None:
    # Leaving on a failed write (or an OSError the trainer may take for one),
    # the filters stay: the callbacks and logs that trace back from it may
    # still come while train.py says its one line and exits. They linger
    # until the process ends or the next Watch is entered, which puts back
    # what was there before.
    if not isinstance(value, (WriteFailed, OSError)):
      self._restore()

  def _restore(self) -> None:
    threading.excepthook, sys.unraisablehook = self._previous, self._previous_unraisable
    sys.excepthook = self._previous_except
    logging.getLogger("absl").removeFilter(self._orbax)

  def thread_error(self) -> Optional[BaseException]:
    """The first OSError TensorBoard's writer thread died of, or None."""
    return self._errors[0] if self._errors else None

  def orbax_error(self) -> Optional[str]:
    """The first save failure orbax logged, as text, or None."""
    return self._orbax.seen[0] if self._orbax.seen else None
