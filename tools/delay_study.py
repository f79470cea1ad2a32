#!/usr/bin/env python3
"""The delay study: synchronous, one-step-delayed and corrected training, per optimizer.

  python tools/delay_study.py --lr-sweep          # tune each optimizer's rate, synchronously
  python tools/delay_study.py --lr from-sweep     # the study: optimizers x settings x seeds
  python tools/delay_study.py --check-2bw         # one cell against a real 2bw pipeline
  python tools/delay_study.py --report            # tables and plots from the runs on disk

Every cell is an ordinary `train.py` run of `configs/delay_study.yaml` (or
`--config`) with a fixed token budget, in its own run directory
`OUT/<optimizer>-<setting>-s<seed>`, so `tools/plot_loss.py` reads it. The
settings are `sync` (no delay), `delay` (`optimizer.delay=1`: the one-step
gradient delay of PipeDream-2BW, simulated on one device) and `delay-ef` (the
same with the error-feedback correction, `optimizer.error_feedback=1`);
`--settings` adds `delay-wp` (the delay with weight prediction,
`optimizer.weight_prediction=1`: gradients taken at w + (w - w_prev)).

The study writes OUT/results.md and OUT/results.json (final validation loss
per optimizer and setting, the gap delayed - synchronous, the corrected gap,
and the share of the gap that the correction recovers,
(delayed - corrected) / (delayed - synchronous)), OUT/val_curves.png and
OUT/gap_vs_length.png (the gap at every evaluation, against tokens per
parameter). `--lr-sweep` writes OUT/lr_sweep.json, whose best rates
`--lr from-sweep` reads. `--check-2bw` trains one cell both in the simulation
and as a `pipeline.schedule=2bw` run on 2 emulated stages and compares their
per-step losses.

Running the same command again resumes: finished runs (their final validation
record exists) are kept, runs with a checkpoint continue from it through the
trainer's own resume, and the tool's own runs that left metrics but no
checkpoint start over. Exit status: 0 done, 1 some run failed or the 2bw check
disagreed, 2 bad input (one line on stderr), 130 interrupted (rerun to resume).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxpipe import config as config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxpipe import runs  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxpipe.errors import InputError  # pylint: disable=g-import-not-at-top,wrong-import-position

TRAIN = os.path.join(ROOT, "train.py")
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "delay_study.yaml")
MARKER = "delay_study_cell.json"   # marks a run directory as this tool's own

OPTIMIZERS = ("adamw", "muon", "lion", "adan", "soap", "mars", "normuon")
# The study's default set, whose results docs/delay_study.md reports; the
# others run with --optimizers.
DEFAULT_OPTIMIZERS = ("adamw", "muon", "lion", "adan")
# Starting points of the rate sweep, all in AdamW units: Muon's and NorMuon's
# updates are RMS-matched to AdamW's, Lion's sign update has RMS 1 and wants a
# 3-10x smaller rate, Adan's, SOAP's and MARS's steps are Adam-like.
DEFAULT_LRS = {"adamw": 3e-3, "muon": 3e-3, "lion": 5e-4, "adan": 3e-3, "soap": 3e-3,
               "mars": 3e-3, "normuon": 3e-3}
# setting -> (optimizer.delay, optimizer.error_feedback, optimizer.weight_prediction)
SETTINGS = {"sync": (0, 0.0, 0.0), "delay": (1, 0.0, 0.0), "delay-ef": (1, 1.0, 0.0),
            "delay-wp": (1, 0.0, 1.0)}
DEFAULT_SETTINGS = ("sync", "delay", "delay-ef")
SETTING_LABELS = {"sync": "synchronous", "delay": "delayed", "delay-ef": "delayed + EF",
                  "delay-wp": "delayed + WP"}
# Keys the tool sets per cell; a positional override of one would be silently lost.
CONTROLLED = ("run.dir", "run.steps", "run.seed", "optimizer.name", "optimizer.lr",
              "optimizer.delay", "optimizer.error_feedback", "optimizer.weight_prediction",
              "pipeline.schedule",
              "pipeline.stages", "optimizer.warmup_steps", "eval.every")
# Keys that do not change a run's trajectory: a finished run stays valid when they change.
IGNORED_KEYS = (("run", "dir"), ("run", "progress"), ("run", "log_every"),
                ("run", "peak_tflops"), ("model", "remat"), ("checkpoint",), ("eval", "every"),
                ("dist",))
# Threads of one XLA CPU process: the flag turns Eigen's multi-threaded
# matmuls off, but XLA's CPU client keeps thread pools of its own, so
# `--threads 1` also pins each process to one core (its CPU affinity).
SINGLE_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false"


class StudyError(InputError):
  """Bad input to the study (exit status 2, one line)."""


@dataclasses.dataclass(frozen=True)
class Cell:
  """One training run of the study: an optimizer, a setting, a seed, a rate."""
  name: str
  run_dir: str
  optimizer: str
  setting: str
  seed: int
  lr: float
  steps: int
  overrides: tuple[str, ...]


# --- small helpers ------------------------------------------------------------


def _say(msg: str) -> None:
  print(msg, flush=True)


def fmt_lr(lr: float) -> str:
  """A learning rate as a short string that reads back as the same float (3e-3, 0.0005)."""
  text = f"{lr:.3g}"
  return text.replace("e-0", "e-")


def fmt_duration(seconds: float) -> str:
  """Seconds as h:mm:ss or m:ss."""
  seconds = int(round(seconds))
  h, rest = divmod(seconds, 3600)
  m, s = divmod(rest, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def parse_lrs(text: str, optimizers: Sequence[str]) -> dict[str, float]:
  """Parses `adamw=3e-3,muon=1e-2` into {optimizer: rate}; rejects unknown names."""
  out = {}
  for item in filter(None, (p.strip() for p in text.split(","))):
    name, sep, value = item.partition("=")
    if not sep:
      raise StudyError(f"--lr: '{item}' is not optimizer=rate (e.g. --lr adamw=3e-3,muon=1e-2)")
    if name not in OPTIMIZERS:
      raise StudyError(f"--lr: unknown optimizer '{name}'; choose from {', '.join(OPTIMIZERS)}")
    try:
      out[name] = float(value)
    except ValueError:
      raise StudyError(f"--lr: '{value}' is not a number (in '{item}')") from None
    if not out[name] > 0:
      raise StudyError(f"--lr: the rate of {name} must be > 0, got {value}")
  del optimizers
  return out


def parse_optimizers(text: str) -> list[str]:
  """Parses `adamw,muon` into a list; unknown names are errors."""
  names = [p.strip() for p in text.split(",") if p.strip()]
  if not names:
    raise StudyError("--optimizers: give at least one of " + ", ".join(OPTIMIZERS))
  for name in names:
    if name not in OPTIMIZERS:
      raise StudyError(f"--optimizers: unknown optimizer '{name}'; choose from "
                       f"{', '.join(OPTIMIZERS)}")
  if len(set(names)) != len(names):
    raise StudyError(f"--optimizers: '{text}' names an optimizer twice")
  return names


def parse_settings(text: str) -> list[str]:
  """Parses `sync,delay,delay-ef` into a list; unknown names are errors."""
  names = [p.strip() for p in text.split(",") if p.strip()]
  for name in names:
    if name not in SETTINGS:
      raise StudyError(f"--settings: unknown setting '{name}'; choose from {', '.join(SETTINGS)}")
  if not names:
    raise StudyError("--settings: give at least one of " + ", ".join(SETTINGS))
  return names


def sweep_grid(center: float, points: int, factor: float) -> list[float]:
  """`points` rates spaced by `factor` on a log scale, centred on `center`.

  Rates are rounded to 3 significant digits, so directory names stay short.
  """
  mid = (points - 1) / 2
  return [float(fmt_lr(center * factor ** (i - mid))) for i in range(points)]


def git_commit() -> str:
  """HEAD of the jaxpipe checkout, with '+dirty' when tracked files differ from it."""
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, timeout=10)
    if head.returncode:
      return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, timeout=10)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def machine() -> dict[str, Any]:
  """What ran the study: host, CPU model and count, load, Python and JAX versions."""
  cpu = platform.processor() or ""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  try:
    usable = len(os.sched_getaffinity(0))
  except AttributeError:
    usable = os.cpu_count() or 1
  info = {"host": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "usable_cpus": usable,
          "platform": platform.platform(), "python": platform.python_version()}
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top
    info["jax"] = metadata.version("jax")
  except Exception:  # pylint: disable=broad-except
    info["jax"] = "unknown"
  try:
    info["load_avg_1m"] = round(os.getloadavg()[0], 2)
  except OSError:
    pass
  return info


# --- run directories ----------------------------------------------------------


def read_records(run_dir: str) -> tuple[dict[int, float], dict[int, float], list[float]]:
  """(step -> training loss, step -> validation loss, step times) of a run.

  A non-finite value, which the trainer writes as null, reads as NaN, so a
  run that diverged still counts as finished. Lines cut short by a kill are
  skipped.
  """
  train, val, times = {}, {}, []
  for rec in runs.read_records(run_dir):
    if "val_loss" in rec:
      val[rec["step"]] = math.nan if rec["val_loss"] is None else float(rec["val_loss"])
    elif "loss" in rec:
      train[rec["step"]] = math.nan if rec["loss"] is None else float(rec["loss"])
      if rec.get("step_time_s") is not None:
        times.append(float(rec["step_time_s"]))
  return train, val, times


def has_checkpoint(run_dir: str) -> bool:
  """Whether run_dir holds a finished checkpoint (orbax names them by step)."""
  path = os.path.join(run_dir, "checkpoints")
  return os.path.isdir(path) and any(d.isdigit() for d in os.listdir(path))


def trajectory_config(config_path: str, overrides: Sequence[str]) -> dict[str, Any]:
  """The resolved config without the keys that leave the training trajectory alone."""
  tree = config_lib.to_dict(config_lib.load(config_path, overrides))
  for key in IGNORED_KEYS:
    node = tree
    for part in key[:-1]:
      node = node[part]
    node.pop(key[-1], None)
  return tree


def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
  """`key: old -> new` for every value that differs.

  Only keys on both sides count: a key that jaxpipe added since a run was
  made takes its default, which is what the older code did.
  """
  out = []
  for key in sorted(set(old) & set(new)):
    a, b = old[key], new[key]
    if isinstance(a, dict) and isinstance(b, dict):
      out += _diff(a, b, f"{prefix}{key}.")
    elif a != b:
      out.append(f"{prefix}{key}: {a} -> {b}")
  return out


def cell_state(cell: Cell, config_path: str) -> str:
  """'done', 'resume', 'restart' or 'new': what the tool does with a cell's directory.

  Raises StudyError when the directory belongs to another run: one the tool
  did not create, or one it created with a different config.
  """
  d = cell.run_dir
  if not os.path.isdir(d) or not os.listdir(d):
    return "new"
  marker = os.path.join(d, MARKER)
  if not os.path.exists(marker):
    raise StudyError(f"{d} exists but was not made by this tool; use another --out, or move it")
  with open(marker) as f:
    mine = json.load(f)
  if _still_training(mine.get("pid"), d):
    raise StudyError(f"{d} is still being trained by process {mine['pid']} (left by an earlier "
                     "invocation); wait for it to finish, or stop it, then run this again")
  want = trajectory_config(config_path, cell.overrides)
  changed = _diff(mine.get("config", {}), want)
  if changed:
    raise StudyError(f"{d} was trained with another config ({'; '.join(changed[:3])}); "
                     "use another --out, or delete that directory to redo it")
  _, val, _ = read_records(d)
  if cell.steps in val:
    return "done"
  return "resume" if has_checkpoint(d) else "restart"


def _write_marker(cell: Cell, config_path: str, wall_s: float, pid: Optional[int] = None) -> None:
  """Marks the directory as the tool's own: the cell, its config, its wall time, its trainer."""
  path = os.path.join(cell.run_dir, MARKER)
  with open(path + ".tmp", "w") as f:
    json.dump({"tool": "tools/delay_study.py", "cell": cell.name, "optimizer": cell.optimizer,
               "setting": cell.setting, "seed": cell.seed, "lr": cell.lr, "steps": cell.steps,
               "overrides": list(cell.overrides), "wall_s": round(wall_s, 2), "pid": pid,
               "config": trajectory_config(config_path, cell.overrides)}, f, indent=1)
  os.replace(path + ".tmp", path)


def _still_training(pid: Optional[int], run_dir: str) -> bool:
  """Whether process `pid` is alive and is a trainer writing into run_dir.

  Trainers run in a session of their own, so one outlives a tool that was
  killed outright; a second trainer in the same directory would corrupt it.
  """
  if not pid:
    return False
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      args = f.read().split(b"\0")
  except OSError:
    return False
  return f"run.dir={run_dir}".encode() in args


def _marker_wall(cell: Cell) -> float:
  try:
    with open(os.path.join(cell.run_dir, MARKER)) as f:
      return float(json.load(f).get("wall_s", 0.0))
  except (OSError, ValueError):
    return 0.0


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
    _say(f"{len(cells)} runs: {counts['done']} finished already, {counts['resume']} to resume "
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
          _write_marker(cell, self.config_path, _marker_wall(cell) + wall)
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
          _say(f"[{done:>3}/{len(cells)}] {name:<24} {what} ({fmt_duration(wall)}) | "
               f"elapsed {fmt_duration(time.time() - self.t0)}{eta}")
          if self.on_progress is not None:
            self.on_progress(dict(outcome))
    except KeyboardInterrupt:
      _say(f"interrupted: stopping {len(running)} run(s) at a checkpoint; "
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
        _write_marker(cell, self.config_path, _marker_wall(cell) + time.time() - started)
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
    _write_marker(cell, self.config_path, _marker_wall(cell) if state == "resume" else 0.0)
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
    _write_marker(cell, self.config_path, _marker_wall(cell), pid=proc.pid)
    verb = {"resume": "resume", "restart": "restart", "new": "start"}[state]
    _say(f"        {verb:<7} {cell.name}")
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


# --- planning -------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
  """The base config and the per-run quantities every mode shares."""
  config_path: str
  base: config_lib.Config
  extra: tuple[str, ...]
  out: str

  def overrides(self, *, run_dir: str, steps: int, seed: int, optimizer: str, lr: float,
                delay: int, ef: float, evals: int, wp: float = 0.0, schedule: str = "none",
                stages: int = 1, extra: Sequence[str] = ()) -> tuple[str, ...]:
    """train.py overrides of one run (the user's first, then the cell's own)."""
    o = self.base.optimizer
    # Warmup keeps its share of the run when --steps changes the horizon.
    warmup = round(o.warmup_steps * steps / self.base.run.steps)
    return (*self.extra, *extra, f"run.dir={run_dir}", f"run.steps={steps}",
            f"run.seed={seed}", "run.progress=false", f"optimizer.name={optimizer}",
            f"optimizer.lr={lr!r}", f"optimizer.delay={delay}",
            f"optimizer.error_feedback={ef!r}", f"optimizer.weight_prediction={wp!r}",
            f"optimizer.warmup_steps={warmup}",
            # At most `evals` evenly spaced passes before the final one.
            f"eval.every={math.ceil(steps / evals)}",
            f"pipeline.schedule={schedule}", f"pipeline.stages={stages}")

  def tokens_per_step(self) -> int:
    return self.base.data.batch_size * self.base.data.seq_len


def count_params(cfg: config_lib.Config) -> int:
  """Parameters of the config's model, from shapes alone (nothing is computed).

  The vocabulary comes from the data as in the trainer (model.vocab_size 0 =
  the tokenizer's); the embedded corpus is prepared here if it is not cached
  yet, before the runs start.
  """
  import jax  # pylint: disable=g-import-not-at-top
  # This process only reads shapes; the accelerator, if any, is for the runs.
  jax.config.update("jax_platforms", "cpu")
  from jaxpipe import data as data_lib  # pylint: disable=g-import-not-at-top
  from jaxpipe import model as model_lib  # pylint: disable=g-import-not-at-top
  d = cfg.data
  path = d.path or data_lib.prepare_embedded(d.corpus, d.tokenizer, d.cache_dir)
  vocab = cfg.model.vocab_size or data_lib.open_tokens(path, verify=False).vocab_size
  model = model_lib.build(dataclasses.replace(cfg.model, vocab_size=vocab))
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)))


def study_cells(plan: Plan, optimizers: Sequence[str], settings: Sequence[str],
                seeds: Sequence[int], lrs: dict[str, float], steps: int,
                evals: int) -> list[Cell]:
  """The study's cells, seed-major so that a partial sweep already holds whole seeds."""
  cells = []
  for seed in seeds:
    for opt in optimizers:
      for setting in settings:
        delay, ef, wp = SETTINGS[setting]
        name = f"{opt}-{setting}-s{seed}"
        run_dir = os.path.join(plan.out, name)
        cells.append(Cell(name, run_dir, opt, setting, seed, lrs[opt], steps, plan.overrides(
            run_dir=run_dir, steps=steps, seed=seed, optimizer=opt, lr=lrs[opt], delay=delay,
            ef=ef, wp=wp, evals=evals)))
  return cells


def sweep_cells(plan: Plan, optimizers: Sequence[str], centers: dict[str, float],
                points: int, factor: float, steps: int, evals: int) -> list[Cell]:
  """Synchronous runs of each optimizer at each rate of its grid (seed 0)."""
  cells = []
  for opt in optimizers:
    for lr in sweep_grid(centers[opt], points, factor):
      name = f"{opt}-lr{fmt_lr(lr)}-s0"
      run_dir = os.path.join(plan.out, "lr_sweep", name)
      cells.append(Cell(name, run_dir, opt, "sync", 0, lr, steps, plan.overrides(
          run_dir=run_dir, steps=steps, seed=0, optimizer=opt, lr=lr, delay=0, ef=0.0,
          evals=evals)))
  return cells


def check_cells(plan: Plan, optimizer: str, lr: float, steps: int,
                microbatches: int) -> tuple[Cell, Cell]:
  """The delayed, corrected cell simulated on one device and run as 2bw on 2 stages."""
  base = f"{optimizer}-delay-ef-s0"
  mb = (f"pipeline.microbatches={microbatches}",)
  sim_dir = os.path.join(plan.out, "check_2bw", base + "-sim")
  pipe_dir = os.path.join(plan.out, "check_2bw", base + "-2bw")
  sim = Cell(base + "-sim", sim_dir, optimizer, "delay-ef", 0, lr, steps, plan.overrides(
      run_dir=sim_dir, steps=steps, seed=0, optimizer=optimizer, lr=lr, delay=1, ef=1.0,
      evals=1, extra=mb))
  # The pipeline supplies the one-step delay itself: optimizer.delay stays 0.
  pipe = Cell(base + "-2bw", pipe_dir, optimizer, "delay-ef", 0, lr, steps, plan.overrides(
      run_dir=pipe_dir, steps=steps, seed=0, optimizer=optimizer, lr=lr, delay=0, ef=1.0,
      evals=1, schedule="2bw", stages=2, extra=mb))
  return sim, pipe


# --- results ----------------------------------------------------------------------


def _mean_std(values: Sequence[float]) -> tuple[Optional[float], Optional[float]]:
  if not values:
    return None, None
  mean = sum(values) / len(values)
  if len(values) < 2:
    return mean, None
  var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
  return mean, math.sqrt(var)


def recovered_share(sync: Optional[float], delayed: Optional[float],
                    corrected: Optional[float]) -> Optional[float]:
  """(delayed - corrected) / (delayed - sync): the share of the gap the correction recovers.

  None when a value is missing or non-finite, or when the delay opened no gap
  (delayed <= sync), where the share means nothing.
  """
  if sync is None or delayed is None or corrected is None:
    return None
  if not all(map(math.isfinite, (sync, delayed, corrected))):
    return None
  gap = delayed - sync
  if gap <= 0:
    return None
  return (delayed - corrected) / gap


def summarize(cells: Sequence[Cell], optimizers: Sequence[str], seeds: Sequence[int],
              params: int, tokens_per_step: int) -> dict[str, Any]:
  """Per optimizer: final validation loss per setting, gaps, recovered share, gap curves.

  Gaps are paired by seed (same initialisation and data order): the gap of
  seed s is delayed_s - sync_s, and its mean equals the difference of means.
  """
  by_key = {(c.optimizer, c.setting, c.seed): c for c in cells}
  table = {}
  for opt in optimizers:
    row: dict[str, Any] = {"lr": None, "settings": {}, "curves": {}}
    finals: dict[str, dict[int, float]] = {}
    curves: dict[str, dict[int, dict[int, float]]] = {}
    for setting in SETTINGS:
      finals[setting], curves[setting] = {}, {}
      for seed in seeds:
        cell = by_key.get((opt, setting, seed))
        if cell is None:
          continue
        row["lr"] = cell.lr
        train, val, times = read_records(cell.run_dir)
        if cell.steps in val:
          finals[setting][seed] = val[cell.steps]
          curves[setting][seed] = val
      vals = list(finals[setting].values())
      mean, std = _mean_std(vals)
      row["settings"][setting] = {"mean": mean, "std": std, "n": len(vals),
                                  "per_seed": {str(s): v for s, v in finals[setting].items()}}
      # The mean curve over the seeds that finished, at the steps they share.
      if curves[setting]:
        steps = sorted(set.intersection(*(set(c) for c in curves[setting].values())))
        row["curves"][setting] = {
            k: sum(c[k] for c in curves[setting].values()) / len(curves[setting])
            for k in steps}

    def paired(a: str, b: str) -> tuple[Optional[float], Optional[float], int]:
      common = sorted(set(finals[a]) & set(finals[b]))
      diffs = [finals[a][s] - finals[b][s] for s in common]
      m, sd = _mean_std(diffs)
      return m, sd, len(diffs)

    gap, gap_std, _ = paired("delay", "sync")
    cgap, cgap_std, _ = paired("delay-ef", "sync")
    pgap, pgap_std, _ = paired("delay-wp", "sync")
    s = row["settings"]
    row["gap"], row["gap_std"] = gap, gap_std
    row["corrected_gap"], row["corrected_gap_std"] = cgap, cgap_std
    row["predicted_gap"], row["predicted_gap_std"] = pgap, pgap_std
    row["recovered"] = recovered_share(s["sync"]["mean"], s["delay"]["mean"],
                                       s["delay-ef"]["mean"])
    row["recovered_wp"] = recovered_share(s["sync"]["mean"], s["delay"]["mean"],
                                          s["delay-wp"]["mean"])
    # The gap at every evaluation both curves share: how it changes with the horizon.
    gap_curve = {}
    sync_curve = row["curves"].get("sync", {})
    for setting in ("delay", "delay-ef", "delay-wp"):
      other = row["curves"].get(setting, {})
      gap_curve[setting] = {k: other[k] - sync_curve[k] for k in sync_curve if k in other}
    row["gap_curve"] = gap_curve
    table[opt] = row
  return {"params": params, "tokens_per_step": tokens_per_step,
          "tokens_per_param_per_step": tokens_per_step / params if params else None,
          "optimizers": table}


def _cell_text(entry: dict[str, Any]) -> str:
  mean, std = entry["mean"], entry["std"]
  if mean is None:
    return "—"
  if not math.isfinite(mean):
    return "diverged"
  return f"{mean:.4f}" + (f" ± {std:.4f}" if std is not None else "")


def _gap_text(gap: Optional[float], std: Optional[float]) -> str:
  if gap is None:
    return "—"
  if not math.isfinite(gap):
    return "n/a"
  return f"{gap:+.4f}" + (f" ± {std:.4f}" if std is not None else "")


def _recovered_text(rec: Optional[float], gap: Optional[float]) -> str:
  no_gap = gap is not None and math.isfinite(gap) and gap <= 0
  return f"{100 * rec:.0f}%" if rec is not None else ("n/a (no gap)" if no_gap else "—")


def markdown_table(summary: dict[str, Any]) -> str:
  """The results table: final validation loss per setting, gaps and recovered share.

  Columns for weight prediction (delay-wp) appear when any optimizer has them.
  """
  wp = any(row["settings"].get("delay-wp", {}).get("n") for row in summary["optimizers"].values())
  head = ("| optimizer | lr | synchronous | delayed | delayed + EF | gap (delayed − sync) "
          "| corrected gap (EF − sync) | recovered |")
  lines = [head + (" delayed + WP | WP − sync | recovered by WP |" if wp else ""),
           "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if wp else "")]
  for opt, row in summary["optimizers"].items():
    s = row["settings"]
    lr = fmt_lr(row["lr"]) if row["lr"] is not None else "—"
    line = (f"| {opt} | {lr} | {_cell_text(s['sync'])} | {_cell_text(s['delay'])} | "
            f"{_cell_text(s['delay-ef'])} | {_gap_text(row['gap'], row['gap_std'])} | "
            f"{_gap_text(row['corrected_gap'], row['corrected_gap_std'])} | "
            f"{_recovered_text(row['recovered'], row['gap'])} |")
    if wp:
      line += (f" {_cell_text(s['delay-wp'])} | "
               f"{_gap_text(row['predicted_gap'], row['predicted_gap_std'])} | "
               f"{_recovered_text(row['recovered_wp'], row['gap'])} |")
    lines.append(line)
  return "\n".join(lines)


def gap_length_table(summary: dict[str, Any], columns: int = 6) -> str:
  """The gap (delayed − sync / corrected − sync) at a few points of the horizon."""
  per_step = summary["tokens_per_param_per_step"] or 0.0
  steps = set()
  for row in summary["optimizers"].values():
    steps |= set(row["gap_curve"].get("delay", {}))
  steps = sorted(k for k in steps if k > 0)
  if not steps:
    return ""
  pick = sorted({steps[round(i * (len(steps) - 1) / max(1, columns - 1))]
                 for i in range(min(columns, len(steps)))})
  head = " | ".join(f"step {k} ({k * per_step:.1f} tok/param)" for k in pick)
  lines = [f"| optimizer | gap | {head} |", "|---|---|" + "---|" * len(pick)]
  for opt, row in summary["optimizers"].items():
    for setting, label in (("delay", "delayed − sync"), ("delay-ef", "EF − sync"),
                           ("delay-wp", "WP − sync")):
      curve = row["gap_curve"].get(setting, {})
      if setting == "delay-wp" and not curve:
        continue
      cells = " | ".join(f"{curve[k]:+.4f}" if k in curve else "—" for k in pick)
      lines.append(f"| {opt} | {label} | {cells} |")
  return "\n".join(lines)


def plot_results(summary: dict[str, Any], out: str) -> list[str]:
  """val_curves.png (a panel per optimizer) and gap_vs_length.png; returns their paths."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  per_step = summary["tokens_per_param_per_step"] or 1.0
  opts = list(summary["optimizers"])
  colors = {"sync": "tab:blue", "delay": "tab:red", "delay-ef": "tab:green",
            "delay-wp": "tab:purple"}
  cols = 2 if len(opts) > 1 else 1
  rows = math.ceil(len(opts) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), dpi=110, squeeze=False)
  for i, opt in enumerate(opts):
    ax = axes[i // cols][i % cols]
    row = summary["optimizers"][opt]
    tops, lows = [], []
    for setting, curve in row["curves"].items():
      xs = [int(k) * per_step for k in curve]
      ys = list(curve.values())
      ax.plot(xs, ys, marker="o", markersize=3, color=colors[setting],
              label=SETTING_LABELS[setting])
      finite = [y for x, y in zip(xs, ys) if math.isfinite(y)]
      lows += finite
      # Leave the first tenth of training off the y range: its losses dwarf the gaps.
      late = [y for x, y in zip(xs, ys) if math.isfinite(y) and x >= 0.1 * max(xs)]
      tops += late or finite
    if lows and tops:
      lo, hi = min(lows), max(tops)
      ax.set_ylim(lo - 0.05 * (hi - lo + 1e-3), hi + 0.05 * (hi - lo + 1e-3))
    lr = fmt_lr(row["lr"]) if row["lr"] is not None else "?"
    ax.set_title(f"{opt} (lr {lr})")
    ax.set_xlabel("tokens per parameter")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
  for j in range(len(opts), rows * cols):
    axes[j // cols][j % cols].axis("off")
  fig.tight_layout()
  curves_png = os.path.join(out, "val_curves.png")
  fig.savefig(curves_png)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
  palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, opt in enumerate(opts):
    for setting, style, label in (("delay", "-", "delayed − sync"),
                                  ("delay-ef", "--", "delayed+EF − sync"),
                                  ("delay-wp", ":", "delayed+WP − sync")):
      curve = summary["optimizers"][opt]["gap_curve"].get(setting, {})
      ks = sorted(k for k in curve if k > 0)
      if ks:
        ax.plot([k * per_step for k in ks], [curve[k] for k in ks], style, marker="o",
                markersize=3, color=palette[i % len(palette)], label=f"{opt}: {label}")
  gap_png = os.path.join(out, "gap_vs_length.png")
  _save_gap_plot(plt, fig, ax, "tokens per parameter", "validation-loss gap to synchronous",
                 "The delay's gap against training length", gap_png)
  return [curves_png, gap_png]


def _run_info(cells: Sequence[Cell], tokens_per_step: int) -> list[dict[str, Any]]:
  out = []
  for c in cells:
    _, val, times = read_records(c.run_dir)
    steady = sorted(times[1:])  # the first step of a process includes compilation
    median = steady[len(steady) // 2] if steady else None
    out.append({"name": c.name, "optimizer": c.optimizer, "setting": c.setting, "seed": c.seed,
                "lr": c.lr, "steps": c.steps, "final_val_loss": val.get(c.steps),
                "wall_s": round(_marker_wall(c), 1),
                "tokens_per_s": round(tokens_per_step / median) if median else None,
                "run_dir": os.path.relpath(c.run_dir, ROOT)})
  return out


def write_json(path: str, data: dict[str, Any]) -> None:
  """Writes JSON atomically; non-finite floats become null."""
  def clean(x):
    if isinstance(x, float) and not math.isfinite(x):
      return None
    if isinstance(x, dict):
      return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [clean(v) for v in x]
    return x
  with open(path + ".tmp", "w") as f:
    json.dump(clean(data), f, indent=1)
  os.replace(path + ".tmp", path)


# --- modes ------------------------------------------------------------------------


def _invocation(args: argparse.Namespace, t0: float, outcome: dict[str, str],
                finished: bool) -> dict[str, Any]:
  """What this invocation of the tool was and did: command, time, machine, commit, runs."""
  return {"command": shlex.join([os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "",
                                 *sys.argv[1:]]),
          "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t0)),
          "t0": t0, "elapsed_s": round(time.time() - t0, 1), "finished": finished,
          "jaxpipe_commit": git_commit(), "machine": machine(), "jobs": args.jobs,
          "threads": args.threads,
          "runs": {s: sum(v == s for v in outcome.values())
                   for s in ("done", "failed", "interrupted")}}


def journal_path(result_path: str) -> str:
  """The file beside a result file that lists the invocations behind it as they run."""
  head, name = os.path.split(result_path)
  return os.path.join(head, f".{os.path.splitext(name)[0]}.invocations.json")


def read_history(result_path: str) -> list[dict[str, Any]]:
  """The invocations behind a result file: its journal, else the result file's own list."""
  for path, from_meta in ((journal_path(result_path), False), (result_path, True)):
    try:
      with open(path) as f:
        data = json.load(f)
    except (OSError, ValueError):
      continue
    return list((data.get("meta", {}) if from_meta else data).get("invocations", []))
  return []


def journal_update(result_path: str, args: argparse.Namespace, t0: float,
                   outcome: dict[str, str], finished: bool) -> list[dict[str, Any]]:
  """Records this invocation (identified by its start time) in the journal; returns the list.

  Written when the invocation starts and after every run that ends, so one that
  is killed outright (SIGKILL, a machine restart) still leaves its command and
  its elapsed time up to its last finished run, marked as not finished.
  """
  history = [h for h in read_history(result_path) if h.get("t0") != t0]
  history.append(_invocation(args, t0, outcome, finished))
  os.makedirs(os.path.dirname(result_path) or ".", exist_ok=True)
  write_json(journal_path(result_path), {"invocations": history})
  return history


def _epochs(cfg: config_lib.Config, tokens: int) -> Optional[float]:
  """Passes over the training split that `tokens` make (None if the data cannot be read)."""
  from jaxpipe import trainer  # pylint: disable=g-import-not-at-top
  try:
    return round(tokens / trainer.open_data(cfg).num_tokens("train"), 3)
  except (InputError, OSError):
    return None


def _meta(args: argparse.Namespace, t0: float, outcome: dict[str, str], plan: Plan,
          params: int, steps: int, path: str) -> dict[str, Any]:
  """The study's scale and every invocation that trained into it.

  A sweep finished over several invocations (interrupted and resumed) keeps
  each one's command and elapsed time, from the journal beside `path`;
  `--report` adds none, as it trains nothing.
  """
  if args.report:
    history = read_history(path)
  else:
    history = journal_update(path, args, t0, outcome, finished=True)
  return {"config": os.path.relpath(plan.config_path, ROOT), "overrides": list(plan.extra),
          "params": params, "steps": steps, "tokens_per_step": plan.tokens_per_step(),
          "tokens_per_param": round(steps * plan.tokens_per_step() / params, 2) if params else None,
          "epochs": _epochs(plan.base, steps * plan.tokens_per_step()),
          "invocations": history,
          "elapsed_total_s": round(sum(h["elapsed_s"] for h in history), 1)}


def _how_it_ran(meta: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
  """Markdown lines: the command, times, jobs, machine and commit behind a result."""
  history = meta["invocations"]
  if not history:
    return ["- no training invocation is recorded (the runs were made elsewhere)"]
  last = history[-1]
  m = last["machine"]
  wall = sum(r["wall_s"] for r in runs)
  # Records from before the journal existed have no "finished" key; they were written at the end.
  cut = sum(not h.get("finished", True) for h in history)
  note = (f", {cut} of them stopped before the end (counted up to their last finished run)"
          if cut else "")
  lines = [f"- command: `{last['command']}`",
           f"- elapsed: {fmt_duration(meta['elapsed_total_s'])} over {len(history)} "
           f"invocation(s){note} (the last one {fmt_duration(last['elapsed_s'])}); the runs' "
           f"own wall time sums to {fmt_duration(wall)} over {len(runs)} runs",
           f"- jobs: {last['jobs']} x {'1 thread' if last['threads'] == 1 else 'all threads'}",
           f"- machine: {m['cpu']}, {m['usable_cpus']} usable CPUs, {m['platform']}, "
           f"jax {m['jax']}; load average {m.get('load_avg_1m', '?')} at the end",
           f"- jaxpipe commit: {last['jaxpipe_commit']}"]
  return lines


def report_study(args, plan: Plan, cells: Sequence[Cell], optimizers, seeds, params: int,
                 steps: int, t0: float, outcome: dict[str, str]) -> dict[str, Any]:
  """Writes results.json, results.md and the two PNGs of the study under plan.out."""
  summary = summarize(cells, optimizers, seeds, params, plan.tokens_per_step())
  meta = _meta(args, t0, outcome, plan, params, steps, os.path.join(plan.out, "results.json"))
  check_path = os.path.join(plan.out, "check_2bw.json")
  check = None
  if os.path.exists(check_path):
    with open(check_path) as f:
      check = json.load(f)
  result = {"meta": meta, "seeds": list(seeds), "summary": summary,
            "runs": _run_info(cells, plan.tokens_per_step()), "check_2bw": check}
  os.makedirs(plan.out, exist_ok=True)
  write_json(os.path.join(plan.out, "results.json"), result)
  pngs = plot_results(summary, plan.out)
  text = [
      "# Delay study results", "",
      f"{len(optimizers)} optimizers x {len({c.setting for c in cells})} settings x "
      f"{len(seeds)} seed(s); "
      f"{params:,} parameters, {steps} steps x {plan.tokens_per_step():,} tokens = "
      f"{meta['tokens_per_param']} tokens per parameter, {meta.get('epochs')} epochs of the "
      "training split. Final validation loss "
      "(nats per byte-token)" + (", mean ± std over seeds" if len(seeds) > 1 else "") + ".", "",
      markdown_table(summary), "",
      "Recovered = (delayed − corrected) / (delayed − synchronous); WP = weight prediction "
      "(`optimizer.weight_prediction=1`).", "",
      "## Gap against training length", "", gap_length_table(summary), "",
      f"![validation curves]({os.path.basename(pngs[0])})", "",
      f"![gap against length]({os.path.basename(pngs[1])})", "",
      "## How it was run", "",
      *_how_it_ran(meta, result["runs"]),
  ]
  if check is not None:
    text.append(f"- 2bw check ({check['optimizer']}, delayed + EF, {check['steps']} steps): "
                f"max relative difference {check['max_rel_diff']:.2e}, "
                f"{'passed' if check['passed'] else 'FAILED'}")
  with open(os.path.join(plan.out, "results.md"), "w") as f:
    f.write("\n".join(text) + "\n")
  return result


def report_sweep(args, plan: Plan, cells: Sequence[Cell], optimizers, params: int, steps: int,
                 t0: float, outcome: dict[str, str]) -> dict[str, Any]:
  """Writes lr_sweep.json and lr_sweep.md: final val loss per rate, best rate per optimizer."""
  losses: dict[str, dict[str, Optional[float]]] = {}
  best, edge = {}, {}
  for opt in optimizers:
    mine = [c for c in cells if c.optimizer == opt]
    losses[opt] = {}
    for c in mine:
      _, val, _ = read_records(c.run_dir)
      losses[opt][fmt_lr(c.lr)] = val.get(c.steps)
    finite = [(v, c.lr) for c in mine
              if (v := losses[opt][fmt_lr(c.lr)]) is not None and math.isfinite(v)]
    if finite:
      _, lr = min(finite)
      best[opt] = lr
      grid = [c.lr for c in mine]
      edge[opt] = len(grid) > 1 and lr in (min(grid), max(grid))
  meta = _meta(args, t0, outcome, plan, params, steps, os.path.join(plan.out, "lr_sweep.json"))
  data = {"meta": meta, "steps": steps, "val_loss": losses, "best": best, "at_edge": edge,
          "runs": _run_info(cells, plan.tokens_per_step())}
  os.makedirs(plan.out, exist_ok=True)
  write_json(os.path.join(plan.out, "lr_sweep.json"), data)
  lines = ["# Learning-rate sweep (synchronous, seed 0)", "",
           f"{steps} steps = {meta['tokens_per_param']} tokens per parameter. The study reads "
           "the best rates with `--lr from-sweep`.", "",
           "| optimizer | lr | final val loss | |", "|---|---|---|---|"]
  for opt in optimizers:
    for lr, v in losses[opt].items():
      mark = "best" if opt in best and fmt_lr(best[opt]) == lr else ""
      if mark and edge.get(opt):
        mark += " (at the grid's edge: widen the grid)"
      text = "—" if v is None else ("diverged" if not math.isfinite(v) else f"{v:.4f}")
      lines.append(f"| {opt} | {lr} | {text} | {mark} |")
  lines += ["", "## How it was run", "", *_how_it_ran(meta, data["runs"])]
  with open(os.path.join(plan.out, "lr_sweep.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  for opt in optimizers:
    if opt in best:
      note = "  <- at the grid's edge; widen the grid" if edge[opt] else ""
      _say(f"best lr {opt}: {fmt_lr(best[opt])}{note}")
  return data


def size_summary(results: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
  """Per optimizer that every study has, smallest model first: parameters, rate, finals,
  gaps, shares."""
  order = sorted(range(len(results)), key=lambda i: results[i]["summary"]["params"])
  common = [o for o in results[order[0]]["summary"]["optimizers"]
            if all(o in r["summary"]["optimizers"] for r in results)]
  rows: dict[str, list[dict[str, Any]]] = {}
  for i in order:
    res = results[i]
    summary, meta = res["summary"], res.get("meta", {})
    for opt in common:
      row = summary["optimizers"][opt]
      s = row["settings"]
      rows.setdefault(opt, []).append({
          "study": names[i], "params": summary["params"], "lr": row["lr"],
          "tokens_per_param": meta.get("tokens_per_param"),
          "epochs": meta.get("epochs"),
          "sync": s["sync"]["mean"], "delay": s["delay"]["mean"],
          "delay_ef": s["delay-ef"]["mean"], "gap": row["gap"],
          "corrected_gap": row["corrected_gap"], "recovered": row["recovered"]})
  return {"optimizers": rows}


def size_table(summary: dict[str, Any]) -> str:
  """The gap-against-size table: one row per optimizer and model size."""
  lines = ["| optimizer | parameters | tokens/param | lr | synchronous | delayed | delayed + EF "
           "| gap | corrected gap | recovered |", "|---|---|---|---|---|---|---|---|---|---|"]
  num = lambda x: "—" if x is None else f"{x:.4f}"
  for opt, rows in summary["optimizers"].items():
    for r in rows:
      tpp = "—" if r["tokens_per_param"] is None else f"{r['tokens_per_param']:.1f}"
      lines.append(f"| {opt} | {r['params']:,} | {tpp} | "
                   f"{fmt_lr(r['lr']) if r['lr'] else '—'} | {num(r['sync'])} | "
                   f"{num(r['delay'])} | {num(r['delay_ef'])} | {_gap_text(r['gap'], None)} | "
                   f"{_gap_text(r['corrected_gap'], None)} | "
                   f"{_recovered_text(r['recovered'], r['gap'])} |")
  return "\n".join(lines)


def plot_sizes(summary: dict[str, Any], path: str) -> None:
  """gap_vs_size.png: the delayed and corrected gaps against parameters (log axis)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
  palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (opt, rows) in enumerate(summary["optimizers"].items()):
    for key, style, label in (("gap", "-", "delayed − sync"),
                              ("corrected_gap", "--", "delayed+EF − sync")):
      pts = [(r["params"], r[key]) for r in rows if r[key] is not None]
      if pts:
        ax.plot(*zip(*pts), style, marker="o", color=palette[i % len(palette)],
                label=f"{opt}: {label}")
  ax.set_xscale("log")
  _save_gap_plot(plt, fig, ax, "parameters", "final validation-loss gap to synchronous",
                 "The delay's gap against model size", path)


def _save_gap_plot(plt, fig, ax, xlabel: str, ylabel: str, title: str, path: str) -> None:
  """Finishes a plot of gaps (a zero line, labels, a legend if any) and writes it."""
  ax.axhline(0.0, color="black", linewidth=0.8)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def report_sizes(args: argparse.Namespace) -> int:
  """The --size-report mode: reads each study's results.json, writes sizes.{md,json,png}."""
  dirs = [d for d in args.size_report.split(",") if d.strip()]
  if len(dirs) < 2:
    raise StudyError("--size-report: give at least two study directories, comma-separated")
  results = []
  for d in dirs:
    path = os.path.join(d, "results.json")
    try:
      with open(path) as f:
        results.append(json.load(f))
    except (OSError, ValueError) as e:
      raise StudyError(f"--size-report: cannot read {path} ({e}); run the study there first")
  summary = size_summary(results, dirs)
  os.makedirs(args.out, exist_ok=True)
  write_json(os.path.join(args.out, "sizes.json"), summary)
  plot_sizes(summary, os.path.join(args.out, "gap_vs_size.png"))
  table = size_table(summary)
  with open(os.path.join(args.out, "sizes.md"), "w") as f:
    f.write("# The delay's gap against model size\n\n" + table +
            "\n\n![gap against size](gap_vs_size.png)\n\nStudies: " + ", ".join(dirs) + "\n")
  _say(table)
  _say(f"wrote {os.path.join(args.out, 'sizes.md')}, sizes.json, gap_vs_size.png")
  return 0


def _num(x: Optional[float]) -> str:
  return "missing" if x is None else f"{x:.8f}"


def compare_check(sim: Cell, pipe: Cell, rtol: float) -> dict[str, Any]:
  """Per-step training losses of the simulated and the 2bw run, and their largest difference."""
  a, va, _ = read_records(sim.run_dir)
  b, vb, _ = read_records(pipe.run_dir)
  steps = list(range(sim.steps))
  missing = [k for k in steps if k not in a or k not in b]
  rel = [abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in steps if k in a and k in b]
  worst = max(rel) if rel else math.inf
  passed = not missing and all(math.isfinite(a[k]) for k in steps) and worst <= rtol
  return {"optimizer": sim.optimizer, "lr": sim.lr, "steps": sim.steps, "rtol": rtol,
          "max_rel_diff": worst, "passed": passed, "missing_steps": missing,
          "sim_losses": [a.get(k) for k in steps], "pipe_losses": [b.get(k) for k in steps],
          "sim_val_loss": va.get(sim.steps), "pipe_val_loss": vb.get(pipe.steps),
          "sim_dir": os.path.relpath(sim.run_dir, ROOT),
          "pipe_dir": os.path.relpath(pipe.run_dir, ROOT)}


# --- command line -------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise StudyError(f"{message} (usage: python tools/delay_study.py [--lr-sweep | "
                     "--check-2bw | --report] [options] [key=value ...])")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  """The command line; see the module docstring."""
  p = _Parser(description=__doc__.split("\n\n")[0])
  mode = p.add_mutually_exclusive_group()
  mode.add_argument("--lr-sweep", action="store_true",
                    help="sweep each optimizer's rate (synchronous, seed 0, --sweep-steps)")
  mode.add_argument("--check-2bw", action="store_true",
                    help="compare one delayed+EF cell with a real 2bw run on 2 emulated stages")
  mode.add_argument("--report", action="store_true",
                    help="only rebuild the tables and plots from the runs on disk")
  mode.add_argument("--size-report", default="", metavar="OUT1,OUT2,...",
                    help="the gap against model size, from the results.json of studies of "
                         "several sizes (each its own --out); writes OUT/sizes.md, "
                         "sizes.json and gap_vs_size.png")
  p.add_argument("--config", default=DEFAULT_CONFIG, help="base config (model, data, schedule)")
  p.add_argument("--out", default=os.path.join("runs", "delay_study"),
                 help="directory of the run directories and results")
  p.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS),
                 help=f"comma-separated, of {', '.join(OPTIMIZERS)} (default "
                      f"{','.join(DEFAULT_OPTIMIZERS)})")
  p.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                 help="comma-separated, of sync, delay, delay-ef, delay-wp (weight prediction); "
                      f"default {','.join(DEFAULT_SETTINGS)}")
  p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 of every cell")
  p.add_argument("--steps", type=int, default=0, help="steps of a study run; 0 = the config's")
  p.add_argument("--evals", type=int, default=15,
                 help="validation passes per run (the points of the gap-vs-length curve)")
  p.add_argument("--lr", "--lrs", dest="lr", default="",
                 help="'from-sweep' (the best rates of --sweep-json) or optimizer=rate,... "
                      "(the others keep their defaults; in --lr-sweep mode, the grid centres)")
  p.add_argument("--sweep-json", default="", help="the sweep's JSON; default OUT/lr_sweep.json")
  p.add_argument("--sweep-points", type=int, default=5, help="rates per optimizer in the sweep")
  p.add_argument("--sweep-factor", type=float, default=2.0,
                 help="ratio between neighbouring rates of the sweep's log grid")
  p.add_argument("--sweep-steps", type=int, default=0,
                 help="steps of a sweep run; 0 = half the study's")
  p.add_argument("--check-steps", type=int, default=30, help="steps of the 2bw check")
  p.add_argument("--check-optimizer", default="muon", help="optimizer of the 2bw check")
  p.add_argument("--check-microbatches", type=int, default=2,
                 help="microbatches of both check runs (2bw on 2 stages needs >= 2)")
  p.add_argument("--check-rtol", type=float, default=1e-5,
                 help="largest relative difference of per-step losses that passes")
  p.add_argument("--jobs", type=int, default=2, help="training processes at a time")
  p.add_argument("--threads", type=int, default=-1, choices=(-1, 0, 1),
                 help="1 = each process single-threaded on its own core, 0 = XLA's default "
                      "(all cores); -1 = 1 when --jobs > 1, else 0")
  p.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. model.dim=32")
  args = p.parse_args(argv)
  if args.threads == -1:
    args.threads = 1 if args.jobs > 1 else 0
  for key, low in (("jobs", 1), ("seeds", 1), ("evals", 1), ("sweep_points", 1),
                   ("check_steps", 1), ("check_microbatches", 1)):
    if getattr(args, key) < low:
      raise StudyError(f"--{key.replace('_', '-')} must be >= {low}, got {getattr(args, key)}")
  if args.steps < 0 or args.sweep_steps < 0:
    raise StudyError("--steps and --sweep-steps must be >= 0")
  if not args.sweep_factor > 1:
    raise StudyError(f"--sweep-factor must be > 1, got {args.sweep_factor}")
  for item in args.overrides:
    key = item.split("=", 1)[0].strip()
    if key in CONTROLLED:
      raise StudyError(f"{key} is set by the study for every run; use the tool's own options "
                       "(--steps, --seeds, --lr, --optimizers, --evals) instead")
  return args


def resolve_lrs(args: argparse.Namespace, optimizers: Sequence[str], out: str) -> dict[str, float]:
  """The rate of each optimizer: defaults, explicit --lr, or the sweep's best."""
  lrs = dict(DEFAULT_LRS)
  if args.lr == "from-sweep":
    path = args.sweep_json or os.path.join(out, "lr_sweep.json")
    if not os.path.exists(path):
      raise StudyError(f"--lr from-sweep: {path} does not exist; run --lr-sweep first, "
                       "or pass --sweep-json")
    with open(path) as f:
      best = json.load(f).get("best", {})
    missing = [o for o in optimizers if o not in best]
    if missing:
      raise StudyError(f"--lr from-sweep: {path} has no best rate for {', '.join(missing)}; "
                       "sweep them too, or give --lr explicitly")
    lrs.update({o: float(best[o]) for o in optimizers})
  elif args.lr:
    lrs.update(parse_lrs(args.lr, optimizers))
  return lrs


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the mode that the command line asks for; returns the exit status."""
  t0 = time.time()
  try:
    args = parse_args(argv)
    if args.size_report:
      return report_sizes(args)
    optimizers = parse_optimizers(args.optimizers)
    settings = parse_settings(args.settings)
    config_path = os.path.abspath(args.config)
    base = config_lib.load(config_path, args.overrides)
    out = os.path.abspath(args.out)
    plan = Plan(config_path, base, tuple(args.overrides), out)
    steps = args.steps or base.run.steps
    if args.check_2bw and args.check_optimizer not in OPTIMIZERS:
      raise StudyError(f"--check-optimizer: unknown optimizer '{args.check_optimizer}'; "
                       f"choose from {', '.join(OPTIMIZERS)}")
    lrs = resolve_lrs(args, [args.check_optimizer] if args.check_2bw else optimizers, out)
    if args.check_2bw:
      cells = list(check_cells(plan, args.check_optimizer, lrs[args.check_optimizer],
                               args.check_steps, args.check_microbatches))
    elif args.lr_sweep:
      steps = args.sweep_steps or max(1, steps // 2)
      cells = sweep_cells(plan, optimizers, lrs, args.sweep_points, args.sweep_factor, steps,
                          args.evals)
    else:
      cells = study_cells(plan, optimizers, settings, range(args.seeds), lrs, steps, args.evals)
    for cell in cells:  # every run's config must load before anything starts
      config_lib.load(config_path, cell.overrides)
      cell_state(cell, config_path)
    params = count_params(base)
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  tokens = steps * plan.tokens_per_step()
  _say(f"model: {params:,} parameters; {'sweep' if args.lr_sweep else 'study'} runs of "
       f"{steps} steps x {plan.tokens_per_step():,} tokens = {tokens / 1e6:.2f}M tokens = "
       f"{tokens / params:.1f} tokens per parameter" if not args.check_2bw else
       f"2bw check: {args.check_optimizer} lr {fmt_lr(lrs[args.check_optimizer])}, delayed + EF, "
       f"{args.check_steps} steps, M={args.check_microbatches}, simulated vs 2 emulated stages")
  outcome: dict[str, str] = {}
  result_path = os.path.join(out, "check_2bw.json" if args.check_2bw else
                             "lr_sweep.json" if args.lr_sweep else "results.json")
  if not args.report:
    journal_update(result_path, args, t0, {}, finished=False)
    runner = Runner(config_path, jobs=args.jobs, threads=args.threads,
                    cache_dir=os.path.join(out, ".jax_cache"),
                    on_progress=lambda o: journal_update(result_path, args, t0, o, False))
    try:
      outcome = runner.run(cells)
    except KeyboardInterrupt:
      journal_update(result_path, args, t0, runner.outcome, finished=False)
      return 130
    except InputError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  else:
    outcome = {c.name: "done" if c.steps in read_records(c.run_dir)[1] else "missing"
               for c in cells}
  failed = sorted(n for n, v in outcome.items() if v != "done")

  if args.check_2bw:
    sim, pipe = cells
    result = compare_check(sim, pipe, args.check_rtol)
    result["meta"] = _meta(args, t0, outcome, plan, params, args.check_steps, result_path)
    os.makedirs(out, exist_ok=True)
    write_json(result_path, result)
    verdict = "PASS" if result["passed"] else "FAIL"
    _say(f"2bw check: {args.check_steps} steps, largest relative difference of the per-step "
         f"losses {result['max_rel_diff']:.2e} (tolerance {args.check_rtol:.0e}); final val "
         f"{_num(result['sim_val_loss'])} (simulated) vs {_num(result['pipe_val_loss'])} (2bw): "
         f"{verdict}")
    return 0 if result["passed"] else 1
  if args.lr_sweep:
    report_sweep(args, plan, cells, optimizers, params, steps, t0, outcome)
    _say(f"wrote {os.path.join(args.out, 'lr_sweep.json')} and lr_sweep.md in "
         f"{fmt_duration(time.time() - t0)}")
  else:
    result = report_study(args, plan, cells, optimizers, range(args.seeds), params, steps, t0,
                          outcome)
    _say(markdown_table(result["summary"]))
    _say(f"wrote {os.path.join(args.out, 'results.md')}, results.json, val_curves.png, "
         f"gap_vs_length.png in {fmt_duration(time.time() - t0)}")
  if failed and args.report:
    _say(f"{len(failed)} run(s) not finished yet: {', '.join(failed[:6])}"
         + (" ..." if len(failed) > 6 else ""))
  elif failed:
    print(f"error: {len(failed)} run(s) did not finish: {', '.join(failed[:6])}"
          + (" ..." if len(failed) > 6 else ""), file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
