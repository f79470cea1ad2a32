"""What the training loop says about each step, one concern a class.

- `Throughput`: the data a batch holds (tokens, passes over the training
  split), step times, and the rates they make (tokens per second, TFLOP/s
  per device, MFU).
- `Records`: the records of metrics.jsonl, training and evaluation (written
  by `jaxpipe._loop.Metrics`).
- `Progress`: progress on stderr, a bar on a terminal, else a plain line
  every `run.log_every` steps.
- `Summary`: what the end-of-run summary says, filled in as the run goes.
- `Report`: joins them (with `jaxpipe._loop.Profile`, the run's
  `NonFinitePolicy` and its step `Watchdog`) for the loop, which hands over
  each step's metrics while the next step runs (`settle`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable, Optional

import jax

from jaxpipe import _watchdog
from jaxpipe._loop import Metrics, NonFinitePolicy, Profile, kill_at, say

__all__ = ["Throughput", "Records", "Progress", "Summary", "Report"]


def _is_terminal(stream: Any) -> bool:
  """Whether `stream` is a terminal (a file, a pipe or a stream without a descriptor is not)."""
  try:
    return stream.isatty()
  except (AttributeError, ValueError, OSError):
    return False


class Throughput:
  """A batch's tokens and share of an epoch; step times; tokens/s, TFLOP/s per device and MFU.

  A step's time is the interval between two steps' completions (`finished`),
  so time the host spends between steps (and a stalled device) is counted.
  The first step of a process (`start`) includes compilation: the run's
  rates (`steady`) leave it out.
  """

  def __init__(self, cfg: Any, peak: Optional[float], start: int, epoch_sequences: int = 0):
    """`peak`: the device's dense bf16 TFLOP/s, if known (for MFU); `epoch_sequences`:
    the sequences in one pass over the training split (0: no epochs)."""
    from jaxpipe import model as model_lib  # pylint: disable=g-import-not-at-top
    self.batch_size, self.start, self.peak = cfg.data.batch_size, start, peak
    self.epoch_sequences = epoch_sequences
    self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    # Useful model FLOPs per step, spread over every device of the mesh.
    self.flops_per_device = (model_lib.flops_per_token(cfg.model, cfg.data.seq_len)
                             * self.tokens_per_step / (cfg.pipeline.stages * cfg.mesh.data))
    self.step_times: dict[int, float] = {}
    self.steady_steps, self.steady_seconds = 0, 0.0  # steps after the first, and their seconds
    self.ready: Optional[float] = None  # when the last step finished

  def tokens(self, k: int) -> int:
    """Tokens trained on once batch k is drawn."""
    return (k + 1) * self.tokens_per_step

  def epoch(self, k: int) -> Optional[float]:
    """Passes over the training split once batch k is drawn (fractional), or None."""
    if not self.epoch_sequences:
      return None
    return float(f"{(k + 1) * self.batch_size / self.epoch_sequences:.6g}")

  def finished(self, k: int, dispatched: float) -> float:
    """Step k has finished now (its host read the metrics): its seconds, kept for `take`."""
    now = time.time()
    seconds = self.step_times[k] = now - (self.ready if self.ready is not None else dispatched)
    self.ready = now
    if k > self.start:  # the first step of a process includes compilation
      self.steady_steps += 1
      self.steady_seconds += seconds
    return seconds

  def take(self, k: int) -> Optional[float]:
    """Step k's seconds (once: a record takes them), or None if not timed."""
    return self.step_times.pop(k, None)

  def speed(self, seconds: Optional[float]) -> dict[str, float]:
    """Tokens per second, TFLOP/s per device and (with a known peak) MFU of a step's time."""
    if not seconds:
      return {}
    out = {"tokens_per_s": self.tokens_per_step / seconds,
           "tflops_per_device": self.flops_per_device / seconds / 1e12}
    if self.peak:
      out["mfu"] = out["tflops_per_device"] / self.peak
    return out

  def steady(self) -> dict[str, float]:
    """The run's tokens per second after compilation (0.0 if none) and, with a peak, its MFU."""
    if not self.steady_seconds:
      return {"tokens_per_s": 0.0}
    out = {"tokens_per_s": self.steady_steps * self.tokens_per_step / self.steady_seconds}
    if self.peak:
      out["mfu"] = self.speed(self.steady_seconds / self.steady_steps)["mfu"]
    return out


class Records:
  """The records of metrics.jsonl: one per batch trained on, one per evaluation.

  `run.debug_kill=record:N` ends the process right after batch N's record.
  """

  def __init__(self, log: Metrics, lr_schedule: Callable[[int], float], throughput: Throughput,
               kill: Optional[tuple[str, int]] = None):
    """`lr_schedule`: the learning rate of a step, on the host (`jaxpipe._loop.host_schedule`)."""
    self.log, self.lr_schedule, self.throughput, self.kill = log, lr_schedule, throughput, kill

  def train(self, k: int, loss: float, extra: dict[str, Any]) -> dict[str, Any]:
    """Writes and returns batch k's training record (`extra`: its gradient norm, skips)."""
    # The rate comes out of float32 arithmetic: print its 7 significant digits.
    seconds = self.throughput.take(k)
    rec = {"step": k, "loss": loss, "lr": float(f"{self.lr_schedule(k):.7g}"),
           "tokens": self.throughput.tokens(k), "epoch": self.throughput.epoch(k),
           "step_time_s": seconds, **self.throughput.speed(seconds)}
    rec.update(extra)
    self.log.write(rec)
    kill_at(self.kill, "record", k)
    return rec

  def validation(self, step: int, loss: Optional[float]) -> None:
    """Writes an evaluation record, once per step (a resumed run has the earlier ones)."""
    if step not in self.log.val_steps:
      self.log.write({"step": step, "val_loss": loss})
      self.log.val_steps.add(step)


class Progress:
  """Progress on stderr (`run.progress`, process 0): a bar, or plain lines in a log.

  Where stderr is a file or a pipe, a bar's carriage-return redraws would
  fill the log, so a plain line is written every `run.log_every` steps
  instead (and at the end, and after an evaluation).
  """

  def __init__(self, cfg: Any, start: int, is_main: bool, lr_schedule: Callable[[int], float],
               throughput: Throughput):
    self.schedule, self.steps, self.every = cfg.pipeline.schedule, cfg.run.steps, cfg.run.log_every
    self.start, self.lr_schedule, self.throughput = start, lr_schedule, throughput
    self.last_val: Optional[tuple[int, float]] = None  # (after step, loss) of the newest evaluation
    self.bar = None
    self.lines = is_main and cfg.run.progress and not _is_terminal(sys.stderr)
    if is_main and cfg.run.progress and not self.lines:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      self.bar = tqdm(total=cfg.run.steps, initial=start, unit="step", dynamic_ncols=True,
                      file=sys.stderr, desc=f"{cfg.pipeline.schedule}")

  def validation(self, step: int, loss: Optional[float]) -> None:
    """An evaluation after `step` updates: shown with that step's progress."""
    if loss is not None:
      self.last_val = (step, loss)

  def after(self, k: int, j: int, loss: float, seconds: Optional[float]) -> None:
    """Step k finished in `seconds`; its metrics carry batch j's loss (j < 0: none yet)."""
    # The evaluation after step k (if any) ran before this step's metrics were read.
    val = self.last_val[1] if self.last_val and self.last_val[0] == k + 1 else None
    due = j >= 0 and ((k + 1) % self.every == 0 or k + 1 == self.steps or val is not None)
    if self.bar is not None:
      if due:
        fast = self.throughput.speed(seconds)
        self.bar.set_postfix(loss=f"{loss:.4f}",
                             **({"val": f"{val:.4f}"} if val is not None else {}),
                             tok_s=f"{fast.get('tokens_per_s', 0):.0f}",
                             **({"mfu": f"{fast['mfu']:.1%}"} if "mfu" in fast else {}))
      self.bar.update(1)
    elif self.lines and due:
      say(self.line(k, j, loss, seconds))

  def line(self, k: int, j: int, loss: float, seconds: Optional[float]) -> str:
    """The plain progress line after step k (of `seconds`), whose metrics carry batch j's loss.

    Steps are counted from 1 (step k + 1 is the (k+1)-th update); a loss that
    arrives a step late (2bw) names its own step in the same count, and the
    validation loss is shown when an evaluation ran after this step.
    """
    fast = self.throughput.speed(seconds)
    parts = [f"{self.schedule} step {k + 1}/{self.steps}",
             f"loss {loss:.4f}" + (f" (of step {j + 1})" if j != k else ""),
             f"lr {self.lr_schedule(j):.3g}"]
    if self.last_val and self.last_val[0] == k + 1:
      parts.insert(2, f"val loss {self.last_val[1]:.4f}")
    epoch = self.throughput.epoch(j)
    if epoch is not None:
      parts.append(f"epoch {epoch:.2f}")
    if k == self.start:
      parts.append(f"{seconds or 0:.1f} s with compilation")
    elif fast:
      parts.append(f"{fast['tokens_per_s']:,.0f} tokens/s"
                   + (f", MFU {fast['mfu']:.1%}" if "mfu" in fast else ""))
    return " | ".join(parts)

  def close(self) -> None:
    """Closes the bar, if one is showing."""
    if self.bar is not None:
      self.bar.close()


@dataclasses.dataclass
class Summary:
  """What the end-of-run summary says, filled in as the run goes; `finish` gives it as a dict.

  Attributes:
    start_step: the step this process started (or resumed) at.
    is_main: whether this is process 0 (which prints the summary).
    exit_code: the command's exit status (`jaxpipe.trainer`'s EXIT_*).
    skipped: updates skipped as non-finite (nan_policy=skip).
    first_val_loss: the validation loss before training (a run from step 0).
    val_loss: the final evaluation's loss, once it ran.
    train: (step, loss, epoch) of the newest training record, once one is written.
    peak_memory_gib: the devices' peak memory, where they report it.
    began: when this process's run began (`time.time()`), for the elapsed time.
  """
  start_step: int
  is_main: bool
  # The rest is filled in as the run goes: `Summary(start_step, is_main)`.
  exit_code: int = dataclasses.field(default=0, init=False)
  skipped: int = dataclasses.field(default=0, init=False)
  first_val_loss: Optional[float] = dataclasses.field(default=None, init=False)
  val_loss: Optional[float] = dataclasses.field(default=None, init=False)
  train: Optional[tuple[int, float, Optional[float]]] = dataclasses.field(default=None, init=False)
  peak_memory_gib: Optional[float] = dataclasses.field(default=None, init=False)
  began: float = dataclasses.field(default_factory=time.time, init=False)

  def finish(self, steps: int, throughput: Throughput, state: Any, run: Any) -> dict[str, Any]:
    """The summary as `jaxpipe.trainer.format_summary` reads it: these values, the time since
    the start, throughput after compilation, and the final state."""
    out = {"exit_code": self.exit_code, "skipped": self.skipped, "start_step": self.start_step,
           "is_main": self.is_main, "first_val_loss": self.first_val_loss}
    if self.train is not None:
      out["train_loss_step"], out["train_loss"], out["epoch"] = self.train
    if self.val_loss is not None:
      out["val_loss"] = self.val_loss
    out.update({"peak_memory_gib": self.peak_memory_gib, "steps": steps,
                "elapsed_s": time.time() - self.began, **throughput.steady(),
                "state": state, "run": run})
    return out


class Report:
  """Each step's record, progress and place in the summary, read one step behind the dispatch.

  The loop hands over step k's metrics while step k+1 runs (`settle`): the
  host reads them only then, so reading never stalls the device queue.
  `policy` (`run.nan_policy`) judges them; `watchdog` (the run's step
  watchdog, if any) is told of each step that finished.
  """

  def __init__(self, records: Records, progress: Progress, summary: Summary, profile: Profile,
               policy: NonFinitePolicy, watchdog: Optional[_watchdog.Watchdog] = None):
    self.records, self.progress, self.summary, self.profile = records, progress, summary, profile
    self.throughput = records.throughput
    self.policy = policy
    self.watchdog = watchdog or _watchdog.Watchdog(0)

  def validation(self, step: int, loss: Optional[float]) -> None:
    """An evaluation after `step` updates: its record (once per step), shown with the progress."""
    self.records.validation(step, loss)
    self.progress.validation(step, loss)

  def record(self, k: int, loss: float, extra: dict[str, Any]) -> None:
    """Writes batch k's training record; the summary's training loss becomes its loss."""
    rec = self.records.train(k, loss, extra)
    self.summary.train = (k, loss, rec["epoch"])

  def settle(self, k: int, met_dev: Any, dispatched: float) -> bool:
    """Reads step k's metrics (waiting for it) and records them; False: stop (non-finite)."""
    met = jax.device_get(met_dev)
    self.watchdog.beat()
    seconds = self.throughput.finished(k, dispatched)
    j = int(met["loss_step"])
    finite = self.policy.observe(met)
    self.summary.skipped = self.policy.skipped
    if j >= 0:
      self.record(j, float(met["loss"]), {"grad_norm": float(met["grad_norm"]),
                                          "skipped": self.policy.skipped})
    if not finite and not self.policy.proceed(k, met):
      return False
    self.progress.after(k, j, float(met["loss"]), seconds)
    self.profile.after(k)
    return True

  def finish(self, state: Any, run: Any) -> dict[str, Any]:
    """The summary (`Summary.finish`) once the loop has ended."""
    return self.summary.finish(run.cfg.run.steps, self.throughput, state, run)

  def close(self, *, abandon: bool = False) -> None:
    """Stops the profile, the bar and the files (`abandon`: after a failed write, see Metrics)."""
    if not abandon:
      self.profile.close()
    self.progress.close()
    self.records.log.close(abandon=abandon)
