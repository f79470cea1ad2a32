"""The pieces the training loop calls, one concern each.

`trainer.train` reads top to bottom: build, begin (`jaxpipe.resume`), then per
step a batch, the step, its record, an evaluation, a checkpoint, a stop if
asked. What each of those does lives here:

- `Metrics`: metrics.jsonl (process 0) and TensorBoard scalars.
- `Profile`: a `jax.profiler` trace of a window of steps.
- `Signals`: SIGTERM/SIGINT as a request to stop after the current step.
- `NonFinitePolicy`: `run.nan_policy` (stop on, or skip, a non-finite update).
- `Evaluation`: the validation batches and when to run them.
- `CheckpointPolicy`: when to save, and never the same step twice.
- (`jaxpipe._watchdog.Watchdog`, which `jaxpipe._report.Report`,
  `Evaluation` and `CheckpointPolicy` keep informed: a run of several
  processes stops when no step finishes for `dist.step_timeout_s`, or a save
  for `dist.save_timeout_s`.)
- `Feed`: the next batch placed on the devices while the current step runs.
- `host_schedule`: the learning rate of every step, read on the host.

Each step's record, timing, progress and the run's summary are
`jaxpipe._report`'s, which joins these `Metrics` and `Profile`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
from typing import Any, Callable, Optional

import jax
import numpy as np

from jaxpipe import _watchdog
from jaxpipe import _writes
from jaxpipe import config as config_lib
from jaxpipe._writes import WriteFailed

__all__ = ["Metrics", "Profile", "Signals", "NonFinitePolicy", "Evaluation",
           "CheckpointPolicy", "Feed", "host_schedule", "say", "kill_at"]


def say(msg: str) -> None:
  """Prints a message on stderr, above the progress bar if one is showing."""
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  tqdm.write(msg, file=sys.stderr)
  sys.stderr.flush()


def kill_at(point: Optional[tuple[str, int]], moment: str, step: int) -> None:
  """`run.debug_kill`: SIGKILL this process at the named moment (for tests of kills)."""
  if point == (moment, step):
    os.kill(os.getpid(), signal.SIGKILL)


class Metrics:
  """metrics.jsonl (process 0 only) and TensorBoard scalars."""

  def __init__(self, run_dir: str, start_step: int, lag: int, enabled: bool,
               writes: Optional[_writes.Watch] = None):
    """`writes`: the run's write watch, which sees TensorBoard's writer thread die."""
    self.enabled, self.writes = enabled, writes
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self.val_steps: set[int] = set()  # evaluations already on file
    self._tb = None
    if not enabled:
      return
    self._truncate(start_step, lag)
    self._file = open(self.path, "a")
    try:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step)
    except ImportError:
      self._tb = None

  def _truncate(self, start_step: int, lag: int) -> None:
    # A resumed run rewrites what came after its checkpoint: training records
    # of batches it will report again, evaluations it will repeat; a run
    # that starts over (at step 0) rewrites everything.
    if not os.path.exists(self.path):
      return
    if start_step == 0:
      os.remove(self.path)
      return
    keep = []
    self.val_steps = set()
    with open(self.path) as f:
      for line in f:
        try:
          rec = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line cut short by a kill
        if "val_loss" in rec and rec["step"] <= start_step:
          keep.append(line)
          self.val_steps.add(rec["step"])
        elif "loss" in rec and rec["step"] < start_step - lag:
          keep.append(line)
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(l if l.endswith("\n") else l + "\n" for l in keep)
    os.replace(tmp, self.path)

  def write(self, record: dict[str, Any]) -> None:
    """Appends one record (a non-finite float becomes null) and its TensorBoard scalars."""
    if not self.enabled:
      return
    # JSON has no NaN: a non-finite value is written as null.
    record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
              for k, v in record.items()}
    try:
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()
    except OSError as e:
      raise WriteFailed("metrics.jsonl", self.path, e) from None
    if self._tb is not None:
      # TensorBoard writes in a thread; once it has died of a failed write,
      # queueing more events would block this thread for ever.
      died = self.writes.thread_error() if self.writes is not None else None
      if died is not None:
        raise WriteFailed("the TensorBoard events", os.path.join(os.path.dirname(self.path), "tb"),
                          died)
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)):
          group = "val" if key.startswith("val") else "train"
          self._tb.add_scalar(f"{group}/{key}", value, record["step"])

  def close(self, *, abandon: bool = False) -> None:
    """Closes the file and the TensorBoard writer.

    `abandon` (after a failed write): closes only what cannot block, the
    file, and ignores its error; TensorBoard's close would wait on its
    writer thread, which a failed write may have ended.
    """
    if not self.enabled:
      return
    if abandon:
      try:
        self._file.close()
      except OSError:
        pass
      return
    self._file.close()
    if self._tb is not None:
      self._tb.close()


class Profile:
  """A `jax.profiler` trace of steps START..STOP-1 (`run.profile=START:STOP`) in run.dir/profile."""

  def __init__(self, spec: str, run_dir: str, is_main: bool):
    self.window = config_lib.profile_window(spec)
    self.dir = os.path.join(run_dir, "profile")
    self.is_main = is_main
    self.active = False

  def before(self, step: int) -> None:
    """Starts the trace before step START is dispatched."""
    if self.window and step == self.window[0] and not self.active:
      jax.profiler.start_trace(self.dir)
      self.active = True

  def after(self, step: int) -> None:
    """Stops the trace once step STOP-1 has finished."""
    if self.active and step == self.window[1] - 1:
      self.close()

  def close(self) -> None:
    """Stops a trace still running."""
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      if self.is_main:
        say(f"wrote a profile of steps {self.window[0]}-{self.window[1] - 1} to {self.dir} "
            "(open it with TensorBoard's profile plugin, xprof or Perfetto)")


class Signals:
  """SIGTERM and SIGINT ask the loop to stop after the current step; a second one stops now.

  The second raises KeyboardInterrupt(its signal number), so that the command
  can exit as that signal would have ended it.

  A context manager: the handlers are installed on entry (where this is the
  main thread; elsewhere signals are left alone) and restored on exit.
  """

  def __init__(self):
    self.received: list[int] = []
    self._handlers: dict[int, Any] = {}

  def _on_signal(self, signum, frame):
    del frame
    if self.received:  # a second signal: stop now
      self.received.append(signum)
      raise KeyboardInterrupt(signum)
    self.received.append(signum)

  @property
  def stop(self) -> Optional[int]:
    """The first signal received, or None."""
    return self.received[0] if self.received else None

  def __enter__(self) -> "Signals":
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._handlers[sig] = signal.signal(sig, self._on_signal)
      except ValueError:  # not the main thread
        pass
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._handlers.items():
      signal.signal(sig, handler)


class NonFinitePolicy:
  """`run.nan_policy`: what a non-finite loss or gradient does to the run.

  'stop': step k+1 runs only if step k's update was finite. It is queued
  before the host has read step k's metrics, and the state is donated, so
  the device program itself keeps the last good state (`go`). 'skip': the
  schedule already skips a non-finite update; the policy counts and says so.
  """

  def __init__(self, policy: str, schedule: Any):
    self.halt = policy == "stop"
    self.skip = policy == "skip"
    self.go = jax.device_put(np.asarray(True), schedule.replicated()) if self.halt else None
    self.num_stages, self.lag = schedule.num_stages, schedule.loss_lag
    self.skipped = 0
    self.stopped_at: Optional[tuple[int, int, str]] = None  # (step, batch, where)

  def dispatched(self, met: dict[str, Any]) -> None:
    """After queueing a step: the next one runs only if this one is finite."""
    if self.halt:
      self.go = met["finite"]

  def observe(self, met: dict[str, Any]) -> bool:
    """Whether step metrics `met` (on the host) are finite; counts a skip."""
    finite = bool(met["finite"])
    if not finite and self.skip:
      self.skipped += 1
    return finite

  def proceed(self, k: int, met: dict[str, Any]) -> bool:
    """After a non-finite step k: False to stop (then `stopped_at` says where)."""
    where = where_nonfinite(met, self.num_stages)
    if self.halt:
      self.stopped_at = (k, k - self.lag, where)
      return False
    say(f"skipped the update of step {k}: non-finite loss or gradient of batch "
        f"{k - self.lag} {where} ({self.skipped} skipped so far)")
    return True


def where_nonfinite(met: dict[str, Any], num_stages: int) -> str:
  """Where a step's non-finite values were: which stages' blocks, the shared weights, or the loss."""
  bad = [s for s in range(num_stages) if not bool(np.asarray(met["stage_finite"])[s])]
  parts = []
  if bad:
    parts.append("in the blocks of stage " + ", ".join(map(str, bad)))
  if not bool(met["shared_finite"]):
    parts.append("in the embedding/head parameters (stage 0 / stage "
                 f"{num_stages - 1})")
  if not parts:
    parts.append("in the loss")
  return " and ".join(parts)


class Evaluation:
  """The validation batches (global arrays), their mean loss, and when it is due.

  The first evaluation of a process compiles the evaluation step: the
  `watchdog` (the run's step watchdog, if any) is paused during it.
  """

  def __init__(self, schedule: Any, batches: list[tuple[Any, Any]], every: int, steps: int,
               watchdog: Optional[_watchdog.Watchdog] = None):
    self.schedule, self.batches, self.every, self.steps = schedule, batches, every, steps
    self.watchdog = watchdog or _watchdog.Watchdog(0)
    self.compiled = False

  def __call__(self, state) -> Optional[float]:
    """Mean validation loss at the state's newest weights; None without batches."""
    if not self.batches:
      return None
    with self.watchdog.paused() if not self.compiled else contextlib.nullcontext():
      out = float(np.mean([float(self.schedule.eval_loss(state, *b)) for b in self.batches]))
    self.compiled = True
    return out

  def due(self, done: int) -> bool:
    """Whether to evaluate after `done` updates (the end of the run has its own)."""
    return bool(self.every) and done % self.every == 0 and done < self.steps


class CheckpointPolicy:
  """When the loop saves: every `every` updates before the last, on a stop, at the end.

  `save(done, ...)` writes a checkpoint unless one of step `done` is already
  on disk from this run (`saved_at`), so a stop right after a periodic save,
  or the end of a run resumed at its last step, writes nothing twice. A save
  takes as long as the disk does: the `watchdog` (the run's step watchdog,
  if any) is paused while it runs.
  """

  def __init__(self, ckpt: Any, every: int, steps: int, saved_at: Optional[int],
               payload: Callable[[int], tuple], kill: Optional[tuple[str, int]] = None,
               watchdog: Optional[_watchdog.Watchdog] = None):
    self.ckpt, self.every, self.steps = ckpt, every, steps
    self.saved_at, self.payload, self.kill = saved_at, payload, kill
    self.watchdog = watchdog or _watchdog.Watchdog(0)

  def due(self, done: int) -> bool:
    """Whether a periodic checkpoint falls after `done` updates."""
    return bool(self.every) and done % self.every == 0 and done < self.steps

  def save(self, done: int, *, wait: bool = False, crash_point: bool = True) -> None:
    """Saves step `done` (`payload(done)` gives tree, data state, meta) unless already saved.

    `wait` blocks until it is on disk; `crash_point` lets `run.debug_kill=save:N`
    kill the process right after (the periodic and final saves).
    """
    with self.watchdog.paused():
      if self.saved_at != done:
        self.ckpt.save(done, *self.payload(done))
        self.saved_at = done
        if crash_point:
          kill_at(self.kill, "save", done)
      if wait:
        self.ckpt.wait()

  def check(self) -> None:
    """Raises WriteFailed if the last save has ended without its checkpoint (a flag read)."""
    self.ckpt.check_saved()


class Feed:
  """Batches for the loop, each placed on the devices one step ahead of its use.

  `take()` returns batch k (already on the devices) and `advance()`, called
  once step k is queued, draws batch k+1 from the iterator and places it, so
  that the host prepares and transfers the next batch while the devices run
  the current step, and the next dispatch waits for nothing. `data_state()`
  is the iterator's position after the last batch taken, what a checkpoint
  of the steps done so far must resume from (the batch drawn ahead is not
  consumed yet).
  """

  def __init__(self, it: Any, place: Callable[[np.ndarray], Any],
               edit: Optional[Callable[[int, dict], dict]] = None, start: int = 0):
    """Args:
      it: the data iterator (`next`, `get_state`).
      place: host array -> global device array.
      edit: (step, host batch) -> batch, applied before placing (run.debug_nan_step).
      start: the step of the first batch the iterator yields.
    """
    self.it, self.place, self.edit = it, place, edit
    self.step = start
    self._state = it.get_state()
    self._next = None

  def _draw(self) -> tuple[Any, Any, Any]:
    batch = next(self.it)
    if self.edit is not None:
      batch = self.edit(self.step, batch)
    return self.place(batch["tokens"]), self.place(batch["targets"]), self.it.get_state()

  def take(self) -> tuple[Any, Any]:
    """(tokens, targets) of the next step, on the devices."""
    tokens, targets, state = self._next if self._next is not None else self._draw()
    self._next = None
    self._state = state
    self.step += 1
    return tokens, targets

  def advance(self) -> None:
    """Draws and places the following batch (call once the current step is queued)."""
    if self._next is None:
      self._next = self._draw()

  def data_state(self) -> Any:
    """The iterator's position after the last batch `take` returned."""
    return self._state


def host_schedule(schedule: Callable[[Any], Any], steps: int) -> Callable[[int], float]:
  """The learning rate of steps 0..steps as a host function (a NumPy table).

  Evaluated once, before training: reading a jitted schedule per record would
  queue a small program on a device behind the step just dispatched, and the
  host would wait for that step to finish before it dispatches the next.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  table = np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(steps + 1)), np.float64)

  def at(k: int) -> float:
    return float(table[min(max(int(k), 0), steps)])
  return at
