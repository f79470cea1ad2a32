"""Typed run configuration: YAML files plus dotted `key=value` overrides.

One frozen dataclass per section is the single source of truth for every knob;
a field's comment is its documentation. `load(path, overrides)` reads a YAML
file, applies overrides such as `optimizer.lr=3e-4`, rejects unknown keys and
mistyped values with a `ConfigError` that names the key, and checks the
arithmetic between sections (layers per stage, microbatch sizes). Each layer
owns its section's dataclass where it has one (`ModelConfig` is the model's,
`jaxpipe/model/_config.py`, `OptimizerConfig` the optimizers',
`jaxpipe/optim/_config.py`); this module composes them. It imports no JAX,
so tools can read configs cheaply.

A section may hold sections (`model.moe`, `optimizer.muon`): YAML nests
them, an override names them with dots (`optimizer.muon.ns_steps=6`), and
each level's keys and `Literal` choices are checked as the top level's are.
A key that moved (`optimizer.mars_gamma`, now `optimizer.mars.gamma`) is
refused in one line naming its new place (`MOVED_KEYS`); a config that a
run saved before the move is read in the new keys (`upgrade_saved`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Mapping, Sequence

import yaml

from jaxpipe.errors import ConfigError
from jaxpipe.errors import check_config as _check
# The model owns its section, its choices and its checks; this module composes the sections.
from jaxpipe.model import DTYPE_NAMES, ModelConfig, MoEConfig, validate as validate_model
# The optimizers' section, their choices and checks, read without JAX (as the model's).
from jaxpipe.optim import (ADAN_FORMS, LR_SCHEDULES, MOVED as OPTIMIZER_MOVED, NS_PRESETS,
                           OPTIMIZERS, OptimizerConfig, saved_section,
                           validate as validate_optimizer)
# The pipeline's choices and rules, read without JAX (its plans are plain Python).
from jaxpipe.pipeline import (LAYOUTS, PIPELINED, SCHEDULE_NAMES, Layout, ScheduleName, StashMode,
                              experts_split, min_microbatches, vocab_parallel as split_vocab)

__all__ = [
    "RunConfig", "DataConfig", "MoEConfig", "ModelConfig", "PipelineConfig",
    "MeshConfig", "OptimizerConfig", "CheckpointConfig", "EvalConfig",
    "DistConfig", "Config", "SCHEDULES", "load", "from_dict", "to_dict", "experts_split",
    "OPTIMIZERS", "LR_SCHEDULES", "NAN_POLICIES", "ADAN_FORMS", "NS_PRESETS", "apply_overrides",
    "validate", "profile_window", "kill_point", "KILL_MOMENTS", "MOVED_KEYS", "upgrade_saved",
    "MESH_LAYOUTS", "device_ids", "vocab_parallel", "HEAD_CHOICES",
]

# The config's own choices; the pipeline's, the model's and the optimizers' are theirs,
# imported above.
Head = Literal["auto", "vocab_parallel", "last_stage"]
NanPolicy = Literal["skip", "stop"]

SCHEDULES = SCHEDULE_NAMES
MESH_LAYOUTS = LAYOUTS
HEAD_CHOICES: tuple[str, ...] = typing.get_args(Head)
NAN_POLICIES: tuple[str, ...] = typing.get_args(NanPolicy)

# Keys that moved, by their old dotted name, and where each went: a config
# or an override that gives one is refused in one line naming the new key;
# a saved config has them replaced (`upgrade_saved`). Each section's owner
# lists its own.
MOVED_KEYS: dict[str, tuple[str, ...]] = {
    f"optimizer.{old}": tuple(f"optimizer.{new}" for new in targets)
    for old, targets in OPTIMIZER_MOVED.items()}
# The CPU tuning's keys, now the environment of its launch hooks
# (tools/cpu/tuning.py): a saved config drops them (they changed how a run
# ran on a CPU, never what it computed).
_CPU_TUNING = "with run.launch_hooks=tools.cpu.tuning"
MOVED_KEYS.update({
    "run.cpu_malloc_arenas": (f"the environment variable JAXPIPE_CPU_ARENAS {_CPU_TUNING}",),
    "run.cpu_split_ops": (f"the environment variable JAXPIPE_CPU_SPLIT_OPS {_CPU_TUNING}",),
    "dist.idle_io_thread": (f"the environment variable JAXPIPE_CPU_IO_THREAD (=normal: off) "
                            f"{_CPU_TUNING}",),
})
DROPPED_WHEN_SAVED = ("run.cpu_malloc_arenas", "run.cpu_split_ops", "dist.idle_io_thread")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  dir: str = "runs/default"      # metrics.jsonl, config, checkpoints go here
  steps: int = 100               # optimizer steps (batches) in the whole run
  seed: int = 0                  # parameter init and data order
  log_every: int = 1             # steps between progress updates (bar refreshes, or lines)
  progress: bool = True          # progress on stderr: a bar on a terminal, else a line every log_every steps
  nan_policy: NanPolicy = "skip" # non-finite loss/grad: skip the update, or stop
  debug_nan_step: int = -1       # fault injection: make batch k's loss NaN (-1 = never)
  peak_tflops: float = 0.0       # per-device peak for MFU; 0 = known accelerators' bf16 peak
  profile: str = ""              # START:STOP = a jax.profiler trace of those steps in run.dir/profile
  debug_kill: str = ""           # fault injection: SIGKILL itself at MOMENT:STEP (see kill_point)
  # NVIDIA GPUs: XLA's deterministic ops (--xla_gpu_deterministic_ops), so a
  # rerun on the same GPUs and mesh repeats bit for bit; false trades that for speed.
  deterministic: bool = True
  compile_cache: str = ""        # a directory for JAX's persistent compilation cache; "" = none
  # A module imported at launch whose functions prepare the process
  # (jaxpipe.launch.Hooks), e.g. tools.cpu.tuning from a clone: the CPU
  # tuning the two-core benchmark runs with. "" = none.
  launch_hooks: str = ""


@dataclasses.dataclass(frozen=True)
class DataConfig:
  path: str = ""                 # prepared token dir (tools/prepare_data.py); "" = embedded corpus
  corpus: str = "kjv"            # embedded corpus used when path is ""
  tokenizer: str = "byte"        # for the embedded corpus: byte | gpt2 | path/to/tokenizer.json
  cache_dir: str = ""            # where the embedded corpus is tokenised; "" = ~/.cache/jaxpipe
  batch_size: int = 16           # global batch in sequences per step, whatever the mesh
  seq_len: int = 64              # tokens per sequence


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  schedule: ScheduleName = "none"  # which pipeline schedule runs a step
  stages: int = 1                # S: devices along the `stage` mesh axis
  # M: microbatches per step. GPipe, 1F1B and pipedream idle (S-1)/(M+S-1)
  # of a step; 2bw idles only in the very first step and needs M >= 2(S-1);
  # interleaved idles (S-1)/(vM+S-1) and needs M a multiple of S.
  # With `none` this is plain gradient accumulation.
  microbatches: int = 1
  # v: chunks of blocks per device for schedule interleaved (>= 2; 1 for
  # every other schedule). Device s holds chunks s, s+S, ..., s+(v-1)S of
  # L/(S v) blocks each; a microbatch goes round the stages v times: v times
  # the transfers for a bubble of (S-1)/(vM+S-1). Needs S*v to divide n_layers.
  virtual_stages: int = 1
  # What a forward keeps for its backward: `inputs` (the stage input; the
  # backward recomputes the stage's forward: 4 units of work per microbatch
  # where 3 suffice) or `residuals` (what jax.vjp saves, as model.remat
  # decides: no recomputation, more memory per stash slot).
  stash: StashMode = "inputs"
  # Where the embedding and the output layer live in a pipelined schedule:
  # `vocab_parallel` (split over the stages by vocabulary: every stage does
  # 1/S of each lookup and head; per tick, the last block's output is sent to
  # every stage and the head's input gradient summed over them, and the
  # softmax statistics gathered; the lookup and its gradient once per step), `last_stage`
  # (whole on every stage; the first looks up, the last computes the head,
  # nothing exchanged per tick; the last stage does the head's work on top of
  # its blocks), or `auto`: last_stage when the head costs at most
  # jaxpipe.pipeline.HEAD_ON_LAST_STAGE (5%) of a stage's block work, else vocab_parallel.
  head: Head = "auto"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = 1                  # D: data-parallel replicas; the mesh is stage x data
  shard_optimizer: bool = True   # ZeRO-1: optimizer state split over the D replicas
  # MoE in a pipelined schedule: each replica holds E/D of the experts and the
  # tokens are exchanged by all-to-all (needs D to divide model.moe.num_experts).
  expert_parallel: bool = True
  # Which axis spans nodes when the devices are on several: stage (stages
  # across nodes, each node's data all-reduce inside it; only activations
  # cross nodes) or data (replicas across nodes, the pipeline inside a node).
  layout: Layout = "stage"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 0                 # steps between checkpoints; 0 = only at the end
  keep: int = 2                  # checkpoints kept (the newest)
  async_save: bool = True        # write in a background thread while training goes on


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every: int = 0                 # steps between validation passes; 0 = only at the end
  batches: int = 4               # validation batches (of data.batch_size sequences)


@dataclasses.dataclass(frozen=True)
class DistConfig:
  coordinator: str = ""          # host:port of process 0; "" = single process (or env vars)
  # This process's GPUs, e.g. "0" or "0,1"; "" = from the launcher (SLURM_LOCALID,
  # LOCAL_RANK with their per-node task counts; jaxpipe.launch.local_device_ids).
  local_device_ids: str = ""
  num_processes: int = 1
  process_id: int = 0
  # Seconds a process may go without a heartbeat before it counts as lost and
  # every other process stops, exit 69 (jaxpipe's heartbeats, through the
  # coordination service in process 0; JAX's own, which abort with a stack
  # dump, get 2x + 30 s as a backstop). A killed or stopped peer ends the
  # others about this long after.
  heartbeat_timeout_s: int = 15
  # Seconds the processes wait for each other at start-up (JAX's initialization_timeout).
  init_timeout_s: int = 300
  # Seconds a finished process waits at exit for the others to finish (JAX's
  # shutdown_timeout_seconds).
  shutdown_timeout_s: int = 300
  # Seconds without a finished training step after which the run stops as if a
  # process were lost (exit 69): a collective that hangs while every process
  # still sends heartbeats. Counted from the first finished step (compilation
  # excluded), paused during checkpoint saves and the first evaluation; 0 = never.
  step_timeout_s: int = 600
  # Seconds the loop may wait in a checkpoint save or a first evaluation
  # (which stop the step clock) before the run stops as if a process were
  # lost (exit 69): a save waits at barriers for every process, and a peer
  # that hangs there while it still sends heartbeats would hold it forever.
  # Counted, as the step clock, once the first step has finished (a fresh
  # run's first evaluation comes before it); 0 = never.
  save_timeout_s: int = 3600


@dataclasses.dataclass(frozen=True)
class Config:
  run: RunConfig = dataclasses.field(default_factory=RunConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  dist: DistConfig = dataclasses.field(default_factory=DistConfig)


def _choices(typ: Any) -> tuple[str, ...]:
  """The values of a `Literal` annotation; () for any other type."""
  return typing.get_args(typ) if typing.get_origin(typ) is Literal else ()


def _describe(value: Any) -> str:
  return f"{value!r} ({type(value).__name__})"


def _coerce(key: str, value: Any, typ: Any) -> Any:
  """Checks `value` against the annotated type; ints are accepted as floats.

  A `Literal` field takes one of its choices, and only that: a bad value is
  refused here, naming the key, the value and the choices, so `validate`
  need not check membership again.
  """
  if dataclasses.is_dataclass(typ):
    if not isinstance(value, Mapping):
      raise ConfigError(f"{key}: expected a section (mapping), got {_describe(value)}")
    return _build(typ, value, key + ".")
  origin = typing.get_origin(typ)
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if value is None:
      return None
    return _coerce(key, value, args[0])
  if typ is bool:
    if isinstance(value, bool):
      return value
    raise ConfigError(f"{key}: expected true or false, got {_describe(value)}")
  if typ is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    raise ConfigError(f"{key}: expected an integer, got {_describe(value)}")
  if typ is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    raise ConfigError(f"{key}: expected a number, got {_describe(value)}")
  choices = _choices(typ)
  if choices:
    if isinstance(value, str) and value in choices:
      return value
    near = _closest(value, choices) if isinstance(value, str) else None
    raise ConfigError(f"{key} must be {_or(choices)}, got {value!r}"
                      + (f" (did you mean '{near}'?)" if near else ""))
  if typ is str:
    if isinstance(value, str):
      return value
    raise ConfigError(f"{key}: expected a string, got {_describe(value)} (quote it in YAML: "
                      "unquoted 2:4 is the number 124)")
  raise TypeError(f"unsupported config field type {typ!r} for {key}")


def _closest(name: str, choices: Sequence[str]) -> str | None:
  """The choice nearest to `name` in spelling (difflib's ratio >= 0.6, any case), or None."""
  lowered = {c.lower(): c for c in choices}
  near = difflib.get_close_matches(name.lower(), list(lowered), n=1)
  return lowered[near[0]] if near else None


def _corrected(parts: Sequence[str], schema: Mapping[str, Any]) -> str | None:
  """The valid dotted key nearest to `parts`, corrected one part at a time.

  `schema` is `to_dict(Config())`. None when some part has no near match,
  or when the key it leads to is a section rather than a setting, since an
  override sets one value.
  """
  out = []
  for part in parts:
    if not isinstance(schema, Mapping):
      return None
    name = part if part in schema else _closest(part, list(schema))
    if name is None:
      return None
    out.append(name)
    schema = schema[name]
  return None if isinstance(schema, Mapping) else ".".join(out)


def _refuse_moved(dotted: str) -> None:
  """Raises the one-line ConfigError naming where a moved key went; nothing for other keys."""
  targets = MOVED_KEYS.get(dotted)
  if targets:
    raise ConfigError(f"{dotted} moved: it is {' or '.join(targets)}")


def _build(cls: type, values: Mapping[str, Any], prefix: str = "") -> Any:
  """A `cls` from a mapping of its fields, sections built in turn (`prefix` names them)."""
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  kwargs = {}
  for key, value in values.items():
    if key not in hints:
      _refuse_moved(prefix + key)
      where = prefix[:-1] or "the top level"
      near = _closest(key, names)
      hint = f" (did you mean '{prefix}{near}'?)" if near else ""
      raise ConfigError(
          f"unknown config key '{prefix}{key}'{hint}; valid keys in {where}: "
          f"{', '.join(names)}")
    kwargs[key] = _coerce(prefix + key, value, hints[key])
  return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
  """Returns the config as nested plain dicts (for YAML and JSON)."""
  return dataclasses.asdict(cfg)


def _parse_scalar(text: str) -> Any:
  # YAML rules, so `lr=3e-4`, `remat=true` and `dir=runs/a` mean what they say
  # in a config file. YAML 1.1 reads `3e-4` as a string; accept it as a float.
  try:
    value = yaml.safe_load(text)
  except yaml.YAMLError:
    return text
  if isinstance(value, str):
    try:
      return float(value)
    except ValueError:
      return value
  return value


def apply_overrides(tree: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
  """Sets dotted `key=value` overrides in a nested dict (a deep copy)."""
  tree = yaml.safe_load(yaml.safe_dump(tree)) or {}
  valid = to_dict(Config())
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override '{item}' is not of the form section.key=value")
    dotted, text = item.split("=", 1)
    _refuse_moved(dotted.strip())
    parts = dotted.strip().split(".")
    node, schema = tree, valid
    for depth, part in enumerate(parts):
      if not isinstance(schema, dict) or part not in schema:
        known = ", ".join(schema) if isinstance(schema, dict) else ""
        near = _corrected(parts, valid)
        raise ConfigError(
            f"unknown config key '{dotted}'"
            + (f" (did you mean '{near}'?)" if near else "")
            + (f"; valid keys in '{'.'.join(parts[:depth]) or 'the top level'}': {known}"
               if known else ""))
      schema = schema[part]
      if depth == len(parts) - 1:
        if isinstance(schema, dict):
          raise ConfigError(f"'{dotted}' is a section; set one of its keys: {', '.join(schema)}")
        # A string key takes the text as written: YAML would read `2:4` as 124.
        node[part] = text if isinstance(schema, str) else _parse_scalar(text)
      else:
        child = node.get(part)
        if child is None:
          child = node[part] = {}
        if not isinstance(child, dict):
          raise ConfigError(f"{'.'.join(parts[:depth + 1])}: expected a section, got {_describe(child)}")
        node = child
  return tree


def from_dict(tree: Mapping[str, Any] | None) -> Config:
  """Builds a typed `Config` from nested mappings; missing keys take defaults."""
  return _build(Config, tree or {})


def upgrade_saved(tree: Mapping[str, Any] | None) -> dict[str, Any]:
  """A config as a run saved it (config.yaml, a checkpoint's meta), in today's keys.

  For configs that jaxpipe wrote, never for a user's: a run saved before a
  key moved (`MOVED_KEYS`) must still resume, compare, export and sample,
  while a user who gives an old key is told its new name. Each section's
  owner says where its keys went (`jaxpipe.optim.saved_section`); the CPU
  tuning's keys are dropped (`DROPPED_WHEN_SAVED`). The result is a new
  dict; `tree` is left as it is.
  """
  out = dict(tree or {})
  if isinstance(out.get("optimizer"), Mapping):
    out["optimizer"] = saved_section(out["optimizer"])
  for dotted in DROPPED_WHEN_SAVED:
    section, key = dotted.split(".")
    if isinstance(out.get(section), Mapping) and key in out[section]:
      out[section] = {k: v for k, v in out[section].items() if k != key}
  return out


def load(path: str | None, overrides: Sequence[str] = ()) -> Config:
  """Reads a YAML config, applies overrides, and returns a validated `Config`.

  A file that is not UTF-8 text, or that holds no settings at all (empty, or
  only comments), is refused: a config file naming nothing is far more often
  the wrong file, or one cut short, than a wish to train on every default,
  and a run on all defaults would start without a word. An explicit empty
  mapping (`{}`) says that wish, and is accepted; so is `path=None`, which
  is how code asks for the defaults.
  """
  tree: Any = {}
  if path is not None:
    try:
      with open(path) as f:
        tree = yaml.safe_load(f)
    except FileNotFoundError:
      raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
      raise ConfigError(f"--config {path} is a directory; give a YAML file "
                        "(see configs/)") from None
    except OSError as e:
      raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except UnicodeDecodeError:
      raise ConfigError(f"--config {path} is not a text file (not UTF-8); give a YAML file "
                        "(see configs/)") from None
    except yaml.YAMLError as e:
      mark = getattr(e, "problem_mark", None)
      where = f" line {mark.line + 1}" if mark is not None else ""
      raise ConfigError(f"{path}:{where} is not valid YAML") from None
    if tree is None:
      raise ConfigError(f"--config {path} holds no settings (it is empty or only comments); "
                        "start from a file in configs/, or write {} to mean every default")
    if not isinstance(tree, dict):
      raise ConfigError(f"{path}: expected a mapping of sections at the top level")
  cfg = from_dict(apply_overrides(tree, overrides))
  validate(cfg)
  return cfg


# Where `run.debug_kill` can stop a run: once step K's training record is on
# file; right after checkpoint K's save has started (with asynchronous saves,
# while it is being written and before it is committed).
KILL_MOMENTS = ("record", "save")


def kill_point(spec: str) -> tuple[str, int] | None:
  """(moment, step) of `run.debug_kill` ('record:3', 'save:3'), or None for ''."""
  if not spec:
    return None
  moment, _, step = spec.partition(":")
  if moment not in KILL_MOMENTS or not step.isdigit():
    raise ConfigError(f"run.debug_kill must be MOMENT:STEP with MOMENT one of "
                      f"{', '.join(KILL_MOMENTS)} (e.g. save:3), got '{spec}'")
  return moment, int(step)


def device_ids(spec: str) -> list[int] | None:
  """The device ids of `dist.local_device_ids` ('0', '0,1'), or None for ''."""
  if not spec.strip():
    return None
  try:
    ids = [int(x) for x in spec.split(",")]
  except ValueError:
    ids = [-1]
  if min(ids) < 0 or len(set(ids)) != len(ids):
    raise ConfigError(f"dist.local_device_ids must be distinct device numbers separated by "
                      f"commas (e.g. 0 or 0,1), got '{spec}'")
  return ids


def profile_window(spec: str) -> tuple[int, int] | None:
  """(start, stop) of `run.profile` ('START:STOP', steps START..STOP-1), or None for ''."""
  if not spec:
    return None
  parts = spec.split(":")
  try:
    start, stop = (int(x) for x in parts)
  except ValueError:
    raise ConfigError(f"run.profile must be START:STOP (steps, e.g. 10:15), got '{spec}'") from None
  if not 0 <= start < stop:
    raise ConfigError(f"run.profile={spec}: need 0 <= START < STOP")
  return start, stop


def _or(choices: Sequence[str]) -> str:
  """'a, b or c': choices as an error message lists them."""
  return ", ".join(choices[:-1]) + " or " + choices[-1]


def vocab_parallel(model: ModelConfig, pipeline: PipelineConfig) -> bool:
  """Whether a run splits its embedding and head over the stages (`pipeline.head`).

  The pipeline's rule (`jaxpipe.pipeline.vocab_parallel`) on this model's
  sizes; `model.vocab_size` must be resolved.
  """
  from jaxpipe.model import block_matmul_params  # pylint: disable=g-import-not-at-top
  return split_vocab(pipeline.head, head_params=model.dim * model.vocab_size,
                     block_params=block_matmul_params(model), num_layers=model.n_layers,
                     num_stages=pipeline.stages)


def validate(cfg: Config) -> None:
  """Checks values and the arithmetic between sections; raises ConfigError."""
  _validate_run_and_data(cfg)
  validate_model(cfg.model)
  _validate_pipeline(cfg)
  validate_optimizer(cfg.optimizer)
  # The dtype names are the model's, which the optimizers' section does not import.
  _check(cfg.optimizer.ef_dtype in ("", *DTYPE_NAMES),
         f"optimizer.ef_dtype must be empty, {_or(DTYPE_NAMES)}; got '{cfg.optimizer.ef_dtype}'")
  _validate_checkpoint_eval_dist(cfg)


def _validate_run_and_data(cfg: Config) -> None:
  """run.*, data.* and the dist keys read at start-up."""
  r, d = cfg.run, cfg.data
  _check(r.steps >= 1, f"run.steps must be >= 1, got {r.steps}")
  _check(r.log_every >= 1, f"run.log_every must be >= 1, got {r.log_every}")
  _check(bool(r.dir), "run.dir must not be empty")
  _check(d.batch_size >= 1, f"data.batch_size must be >= 1, got {d.batch_size}")
  _check(d.seq_len >= 2, f"data.seq_len must be >= 2, got {d.seq_len}")
  _check(r.peak_tflops >= 0, f"run.peak_tflops must be >= 0, got {r.peak_tflops}")
  profile_window(r.profile)
  kill_point(r.debug_kill)
  device_ids(cfg.dist.local_device_ids)


def _validate_pipeline(cfg: Config) -> None:
  """pipeline.* and mesh.*, and how they divide the layers, the batch and the experts."""
  d, m, p, o = cfg.data, cfg.model, cfg.pipeline, cfg.optimizer
  _check(p.stages >= 1, f"pipeline.stages must be >= 1, got {p.stages}")
  _check(p.microbatches >= 1, f"pipeline.microbatches must be >= 1, got {p.microbatches}")
  _check(cfg.mesh.data >= 1, f"mesh.data must be >= 1, got {cfg.mesh.data}")
  if p.schedule == "none":
    _check(p.stages == 1, f"pipeline.stages={p.stages} needs a pipeline schedule "
           f"({', '.join(PIPELINED)}); set pipeline.stages=1 for schedule none")
  else:
    _check(m.n_layers % p.stages == 0,
           f"model.n_layers={m.n_layers} is not divisible by pipeline.stages={p.stages}; "
           "choose stages that divide the layers")
    _check(o.delay == 0, f"optimizer.delay={o.delay} simulates a delay for schedule none only; "
           f"schedule {p.schedule} has its own (2bw: one step)")
    _check(o.weight_prediction == 0,
           f"optimizer.weight_prediction={o.weight_prediction} runs with schedule none only (the "
           f"one-device simulation); inside {p.schedule} it would need one more weight version")
  _check(p.virtual_stages >= 1, f"pipeline.virtual_stages must be >= 1, got {p.virtual_stages}")
  if p.schedule == "interleaved":
    _check(p.virtual_stages >= 2,
           f"pipeline.schedule=interleaved needs pipeline.virtual_stages >= 2 chunks per device "
           f"(got {p.virtual_stages}; with 1 it is 1f1b); set pipeline.virtual_stages=2")
    _check(m.n_layers % (p.stages * p.virtual_stages) == 0,
           f"model.n_layers={m.n_layers} is not divisible by pipeline.stages x "
           f"pipeline.virtual_stages = {p.stages} x {p.virtual_stages} = "
           f"{p.stages * p.virtual_stages} chunks; choose stages and virtual_stages whose "
           "product divides the layers")
    _check(p.microbatches % p.stages == 0,
           f"pipeline.microbatches={p.microbatches} is not a multiple of pipeline.stages="
           f"{p.stages}, which interleaved's order needs (groups of S microbatches go round "
           f"the stages); set pipeline.microbatches to a multiple of {p.stages}, e.g. "
           f"{-(-p.microbatches // p.stages) * p.stages}")
  else:
    _check(p.virtual_stages == 1,
           f"pipeline.virtual_stages={p.virtual_stages} splits a device's blocks into chunks "
           f"for schedule interleaved only, not {p.schedule}; set pipeline.schedule=interleaved "
           "or pipeline.virtual_stages=1")
  if p.schedule == "2bw" and p.stages > 1:
    fewest = min_microbatches(p.schedule, p.stages)
    _check(p.microbatches >= fewest,
           f"pipeline.microbatches={p.microbatches} is too few for 2bw with {p.stages} stages; "
           f"it needs at least 2*(stages-1) = {fewest}")
  _check(d.batch_size % p.microbatches == 0,
         f"data.batch_size={d.batch_size} is not divisible by pipeline.microbatches={p.microbatches}")
  micro = d.batch_size // p.microbatches
  _check(micro % cfg.mesh.data == 0,
         f"the microbatch of {micro} sequences (data.batch_size / pipeline.microbatches) "
         f"is not divisible by mesh.data={cfg.mesh.data} replicas")
  if experts_split(p.schedule, cfg.mesh.data, m.moe.num_experts, cfg.mesh.expert_parallel):
    _check(m.moe.num_experts % cfg.mesh.data == 0,
           f"model.moe.num_experts={m.moe.num_experts} is not divisible by mesh.data="
           f"{cfg.mesh.data}: expert parallelism gives each replica an equal share; choose "
           "another mesh.data or set mesh.expert_parallel=false")


def _validate_checkpoint_eval_dist(cfg: Config) -> None:
  """checkpoint.*, eval.* and the dist.* process counts and timeouts."""
  _check(cfg.checkpoint.every >= 0, f"checkpoint.every must be >= 0, got {cfg.checkpoint.every}")
  _check(cfg.checkpoint.keep >= 1, f"checkpoint.keep must be >= 1, got {cfg.checkpoint.keep}")
  _check(cfg.eval.every >= 0, f"eval.every must be >= 0, got {cfg.eval.every}")
  _check(cfg.eval.batches >= 0, f"eval.batches must be >= 0, got {cfg.eval.batches}")
  ds = cfg.dist
  _check(ds.num_processes >= 1, f"dist.num_processes must be >= 1, got {ds.num_processes}")
  _check(0 <= ds.process_id < ds.num_processes,
         f"dist.process_id={ds.process_id} must be in [0, dist.num_processes={ds.num_processes})")
  for key in ("heartbeat_timeout_s", "init_timeout_s", "shutdown_timeout_s"):
    _check(getattr(ds, key) >= 1, f"dist.{key} must be >= 1 (seconds), got {getattr(ds, key)}")
  _check(ds.step_timeout_s >= 0,
         f"dist.step_timeout_s must be >= 0 (seconds; 0 = never), got {ds.step_timeout_s}")
  _check(ds.save_timeout_s >= 0,
         f"dist.save_timeout_s must be >= 0 (seconds; 0 = never), got {ds.save_timeout_s}")
