"""The study's definition: its settings and optimizers, its cells, their run directories.

A cell is one training run (an optimizer, a setting, a seed, a rate, a
length) in a run directory of its own, marked as the study's by a marker
file that records its config, so a rerun can tell a finished cell from one
to resume, restart or refuse.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
from typing import Any, Optional, Sequence

from jaxpipe import config as config_lib
from jaxpipe import runs
from jaxpipe.errors import InputError


# The repository the study runs in: train.py, configs/ and git live there.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def say(msg: str) -> None:
  """Prints one line of the study's progress at once (flushed: the study runs for hours)."""
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
  # The marker's config was saved by an earlier invocation, perhaps before a key moved.
  changed = _diff(config_lib.upgrade_saved(mine.get("config", {})), want)
  if changed:
    raise StudyError(f"{d} was trained with another config ({'; '.join(changed[:3])}); "
                     "use another --out, or delete that directory to redo it")
  _, val, _ = read_records(d)
  if cell.steps in val:
    return "done"
  return "resume" if has_checkpoint(d) else "restart"


def write_marker(cell: Cell, config_path: str, wall_s: float, pid: Optional[int] = None) -> None:
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


def marker_wall(cell: Cell) -> float:
  """Seconds of training the cell's marker records so far; 0 without a readable marker."""
  try:
    with open(os.path.join(cell.run_dir, MARKER)) as f:
      return float(json.load(f).get("wall_s", 0.0))
  except (OSError, ValueError):
    return 0.0


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
  model = model_lib.make_model(dataclasses.replace(cfg.model, vocab_size=vocab))
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
