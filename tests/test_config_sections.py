"""The optimizer's per-optimizer sections (`optimizer.muon.momentum`, `optimizer.lion.b1`, ...).

Each section key, from a YAML file or an override, reaches the factory that
`make_optimizer` calls; a bad choice inside a section and every key that
moved out of the flat section are refused in one line (exit 2 through
train.py); a run saved with the flat keys compares equal to today's config,
resumes, and reads back for export and generation.
"""

import copy
import dataclasses
import json
import os
import shutil

import optax
import pytest
import yaml

from jaxpipe import config, optim, resume, trainer
from jaxpipe import study as study_lib
from jaxpipe.errors import CheckpointError, ConfigError
from jaxpipe.optim import _adan, _mars, _muon, _normuon, _optimizers, _soap
from tests import _runs

# The function `make_optimizer` calls for each optimizer, by the module it looks it up in.
FACTORIES = {"adamw": (_optimizers, "adamw"), "lion": (_optimizers, "lion"),
             "sgd": (_optimizers, "sgd"), "muon": (_muon, "muon"),
             "normuon": (_normuon, "normuon"), "mars": (_mars, "mars"), "adan": (_adan, "adan"),
             "soap": (_soap, "soap")}

# (key under `optimizer`, a value other than its default, an optimizer that
# reads it, the factory's argument it becomes).
CASES = [
    ("muon.momentum", 0.9, "muon", "momentum"),
    ("muon.nesterov", False, "muon", "nesterov"),
    ("muon.ns_steps", 7, "muon", "ns_steps"),
    ("muon.ns_coeffs", "polar_express", "muon", "ns_coeffs"),
    # NorMuon's direction is Muon's: it reads Muon's section.
    ("muon.momentum", 0.9, "normuon", "momentum"),
    ("muon.ns_coeffs", "polar_express", "normuon", "ns_coeffs"),
    ("normuon.b2", 0.9, "normuon", "neuron_b2"),
    ("mars.gamma", 0.05, "mars", "gamma"),
    ("mars.b1", 0.9, "mars", "b1"),
    ("mars.b2", 0.98, "mars", "b2"),
    ("lion.b1", 0.8, "lion", "b1"),
    ("lion.b2", 0.995, "lion", "b2"),
    ("adan.b1", 0.9, "adan", "b1"),
    ("adan.b2", 0.8, "adan", "b2"),
    ("adan.b3", 0.999, "adan", "b3"),
    ("adan.form", "optax", "adan", "form"),
    ("soap.precondition_frequency", 3, "soap", "precondition_frequency"),
    ("soap.shampoo_beta", 0.9, "soap", "shampoo_beta"),
    ("soap.max_precond_dim", 64, "soap", "max_precond_dim"),
    ("sgd.momentum", 0.5, "sgd", "momentum"),
    ("sgd.nesterov", False, "sgd", "nesterov"),
    # The AdamW group's rate stays flat: the three optimizers that keep the group read it.
    ("adam_lr", 0.004, "muon", "adam_learning_rate"),
    ("adam_lr", 0.004, "normuon", "adam_learning_rate"),
    ("adam_lr", 0.004, "mars", "adam_learning_rate"),
]

# The flat section as it was before the per-optimizer sections (every key).
OLD_FLAT_KEYS = (
    "name", "lr", "adam_lr", "weight_decay", "b1", "b2", "eps", "momentum", "nesterov",
    "ns_steps", "ns_coeffs", "normuon_b2", "mars_gamma", "mars_b1", "mars_b2", "lion_b1",
    "lion_b2", "adan_b1", "adan_b2", "adan_b3", "adan_form", "precondition_frequency",
    "shampoo_beta", "max_precond_dim", "schedule", "warmup_steps", "min_lr_ratio",
    "decay_fraction", "clip_norm", "delay", "error_feedback", "ef_dtype", "weight_prediction")


def _sections():
  """{section name: its dataclass} of the optimizer's subsections."""
  return {f.name: f.default_factory for f in dataclasses.fields(optim.OptimizerConfig)
          if f.default_factory is not dataclasses.MISSING}


def _get(cfg: optim.OptimizerConfig, key: str):
  """The value of a dotted key under `optimizer`."""
  for part in key.split("."):
    cfg = getattr(cfg, part)
  return cfg


def _text(value) -> str:
  """A value as an override writes it."""
  return str(value).lower() if isinstance(value, bool) else str(value)


def _load(tmp_path, how: str, settings: dict) -> config.Config:
  """A config with `settings` (dotted keys under `optimizer`) from a YAML file or overrides."""
  if how == "override":
    return config.load(None, [f"optimizer.{k}={_text(v)}" for k, v in settings.items()])
  section = {}
  for key, value in settings.items():
    *parents, leaf = key.split(".")
    node = section
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  path = tmp_path / "config.yaml"
  path.write_text(yaml.safe_dump({"optimizer": section}))
  return config.load(str(path))


def _passed(monkeypatch, cfg: optim.OptimizerConfig) -> dict:
  """The arguments `make_optimizer(cfg)` gives its optimizer's factory."""
  module, name = FACTORIES[cfg.name]
  seen = {}

  def record(learning_rate, **kwargs):
    seen.update(kwargs, learning_rate=learning_rate)
    return optax.identity()

  monkeypatch.setattr(module, name, record)
  optim.make_optimizer(cfg, 10)
  return seen


def _error(tmp_path, how: str, settings: dict) -> str:
  with pytest.raises(ConfigError) as e:
    _load(tmp_path, how, settings)
  return str(e.value)


def test_the_cases_cover_every_section_key():
  keys = {f"{name}.{f.name}" for name, cls in _sections().items()
          for f in dataclasses.fields(cls)}
  assert keys == {k for k, *_ in CASES if "." in k}
  assert set(_sections()) == {"muon", "normuon", "mars", "lion", "adan", "soap", "sgd"}


@pytest.mark.parametrize("how", ["yaml", "override"])
@pytest.mark.parametrize("key,value,name,argument", CASES,
                         ids=[f"{c[2]}-{c[0]}" for c in CASES])
def test_each_key_reaches_the_optimizer(tmp_path, monkeypatch, how, key, value, name, argument):
  assert _get(optim.OptimizerConfig(), key) != value   # else the check could not fail
  cfg = _load(tmp_path, how, {"name": name, "schedule": "constant", key: value}).optimizer
  assert _get(cfg, key) == value
  got = _passed(monkeypatch, cfg)[argument]
  if callable(got):   # a rate is passed as a schedule (constant here)
    got = float(got(0))
  if isinstance(value, float):
    assert got == pytest.approx(value, rel=1e-6)
  else:
    assert got == value


def test_a_section_is_read_by_its_own_optimizer_only(monkeypatch):
  """SGD's momentum leaves Muon's alone, and Muon's SGD's: the keys are two now."""
  cfg = config.load(None, ["optimizer.name=muon", "optimizer.sgd.momentum=0.5",
                           "optimizer.sgd.nesterov=false"]).optimizer
  got = _passed(monkeypatch, cfg)
  assert (got["momentum"], got["nesterov"]) == (0.95, True)
  cfg = config.load(None, ["optimizer.name=sgd", "optimizer.muon.momentum=0.5"]).optimizer
  got = _passed(monkeypatch, cfg)
  assert (got["momentum"], got["nesterov"]) == (0.95, True)


def test_the_built_transform_follows_a_section_key(tmp_path):
  """The value makes the update: Lion's b1 from YAML gives optim.lion's update with that b1."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  params = {"kernel": jnp.array([[1.0, -2.0], [0.5, 3.0]])}
  grads = {"kernel": jnp.array([[0.3, -0.1], [0.2, 0.4]])}

  def second_update(tx):
    # After g, the momentum is 0.01 g (b2 = 0.99); then -0.05 g: the sign of
    # c = b1 m + (1 - b1) g is g's for b1 = 0.9 (Lion's default), -g's for b1 = 0.2.
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    updates, _ = tx.update({"kernel": -0.05 * grads["kernel"]}, state, params)
    return np.asarray(updates["kernel"])

  cfg = _load(tmp_path, "yaml", {"name": "lion", "schedule": "constant", "clip_norm": 0.0,
                                 "lion.b1": 0.2}).optimizer
  assert cfg.lion.b1 == 0.2
  got = second_update(optim.make_optimizer(cfg, 10))
  np.testing.assert_allclose(got, second_update(optim.lion(cfg.lr, b1=0.2)), rtol=1e-6)
  assert np.abs(got - second_update(optim.lion(cfg.lr))).min() > cfg.lr


@pytest.mark.parametrize("how", ["yaml", "override"])
@pytest.mark.parametrize("key,value,choices", [
    ("muon.ns_coeffs", "newton", "jordan or polar_express"),
    ("adan.form", "optaxx", "paper or optax"),
])
def test_a_bad_choice_in_a_section_is_one_line_with_the_choices(tmp_path, how, key, value,
                                                                 choices):
  message = _error(tmp_path, how, {key: value})
  assert message.startswith(f"optimizer.{key} must be {choices}, got '{value}'"), message
  assert "\n" not in message


def test_a_section_given_a_value_is_refused(tmp_path):
  assert _error(tmp_path, "override", {"muon": 3}) == (
      "'optimizer.muon' is a section; set one of its keys: momentum, nesterov, ns_steps, "
      "ns_coeffs")
  assert _error(tmp_path, "yaml", {"muon": 3}) == (
      "optimizer.muon: expected a section (mapping), got 3 (int)")
  assert _error(tmp_path, "override", {"muon.gama": 3}).startswith(
      "unknown config key 'optimizer.muon.gama'")


def test_the_moved_keys_are_every_key_that_left_the_flat_section():
  now = {f.name for f in dataclasses.fields(optim.OptimizerConfig)}
  gone = {k for k in OLD_FLAT_KEYS if k not in now}
  assert set(optim.MOVED) == gone
  assert {k for k in config.MOVED_KEYS if k.startswith("optimizer.")} == {
      f"optimizer.{k}" for k in gone}


@pytest.mark.parametrize("how", ["yaml", "override"])
@pytest.mark.parametrize("old", sorted(optim.MOVED))
def test_every_moved_key_names_its_new_place(tmp_path, how, old):
  targets = optim.MOVED[old]
  value = _get(optim.OptimizerConfig(), targets[0])   # of the right type: the key alone is refused
  message = _error(tmp_path, how, {old: value})
  new = " or ".join(f"optimizer.{t}" for t in targets)
  assert message == f"optimizer.{old} moved: it is {new}"
  # The new place takes the value.
  for target in targets:
    assert _get(_load(tmp_path, how, {target: value}).optimizer, target) == value


@pytest.mark.exit_status(2)
@pytest.mark.parametrize("where,line", [
    ("override", "error: optimizer.mars_gamma moved: it is optimizer.mars.gamma"),
    ("yaml", "error: optimizer.lion_b1 moved: it is optimizer.lion.b1"),
    ("choice", "error: optimizer.muon.ns_coeffs must be jordan or polar_express, "
               "got 'newton'"),
])
def test_train_py_exits_2_with_one_line(tmp_path, where, line):
  run_dir = tmp_path / "run"
  cache = str(tmp_path / "cache")
  if where == "yaml":
    with open(_runs.TINY) as f:
      tree = yaml.safe_load(f)
    tree["optimizer"]["lion_b1"] = 0.9
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(tree))
    p = _runs.run(str(run_dir), cache_dir=cache, config=str(path))
  else:
    override = ("optimizer.mars_gamma=0.05" if where == "override"
                else "optimizer.muon.ns_coeffs=newton")
    p = _runs.run(str(run_dir), override, cache_dir=cache)
  assert p.returncode == 2, p.stderr
  assert p.stderr.strip().splitlines() == [line]
  assert not run_dir.exists()


# --- configs saved before the sections -----------------------------------------------

# An `optimizer` section as the flat layout saved it (every key), and the
# overrides that say the same in today's keys.
OLD_SAVED = {
    "name": "muon", "lr": 0.02, "adam_lr": 0.004, "weight_decay": 0.1, "b1": 0.9, "b2": 0.95,
    "eps": 1e-8, "momentum": 0.9, "nesterov": False, "ns_steps": 6,
    "ns_coeffs": "polar_express", "normuon_b2": 0.9, "mars_gamma": 0.05, "mars_b1": 0.9,
    "mars_b2": 0.98, "lion_b1": 0.8, "lion_b2": 0.995, "adan_b1": 0.9, "adan_b2": 0.8,
    "adan_b3": 0.999, "adan_form": "optax", "precondition_frequency": 3,
    "shampoo_beta": 0.9, "max_precond_dim": 64, "schedule": "constant", "warmup_steps": 0,
    "min_lr_ratio": 0.1, "decay_fraction": 0.2, "clip_norm": 1.0, "delay": 0,
    "error_feedback": 1.0, "ef_dtype": "", "weight_prediction": 0.0}
NOW = ["optimizer.name=muon", "optimizer.lr=0.02", "optimizer.adam_lr=0.004",
       "optimizer.schedule=constant", "optimizer.error_feedback=1",
       "optimizer.muon.momentum=0.9", "optimizer.muon.nesterov=false",
       "optimizer.muon.ns_steps=6", "optimizer.muon.ns_coeffs=polar_express",
       "optimizer.normuon.b2=0.9", "optimizer.mars.gamma=0.05", "optimizer.mars.b1=0.9",
       "optimizer.mars.b2=0.98", "optimizer.lion.b1=0.8", "optimizer.lion.b2=0.995",
       "optimizer.adan.b1=0.9", "optimizer.adan.b2=0.8", "optimizer.adan.b3=0.999",
       "optimizer.adan.form=optax", "optimizer.soap.precondition_frequency=3",
       "optimizer.soap.shampoo_beta=0.9", "optimizer.soap.max_precond_dim=64"]


def _saved_before_the_sections(tree: dict, optimizer: dict) -> dict:
  """A saved config tree with its `optimizer` section replaced by a flat one."""
  out = copy.deepcopy(tree)
  out["optimizer"] = dict(optimizer)
  return out


def test_a_saved_flat_config_compares_equal_to_today_s():
  now = config.to_dict(config.load(_runs.TINY, NOW))
  saved = _saved_before_the_sections(now, OLD_SAVED)
  assert set(saved["optimizer"]) == set(OLD_FLAT_KEYS)
  assert resume.config_differences(saved, now) == []
  resume.check_compatible(saved, now, "checkpoints")
  # What differs is named in today's keys.
  changed = _saved_before_the_sections(now, {**OLD_SAVED, "mars_gamma": 0.07, "lion_b1": 0.5})
  assert resume.config_differences(changed, now) == [
      "optimizer.lion.b1: 0.5 -> 0.8", "optimizer.mars.gamma: 0.07 -> 0.05"]
  with pytest.raises(CheckpointError, match=r"optimizer.lion.b1: 0.5 -> 0.8"):
    resume.check_compatible(changed, now, "checkpoints")
  # The saved tree itself is left as it was.
  assert changed["optimizer"]["mars_gamma"] == 0.07 and "mars" not in changed["optimizer"]


def test_a_saved_sgd_run_s_momentum_is_sgd_s():
  """`momentum` served Muon and SGD: an SGD run's was SGD's, and Muon's stays its default."""
  old = {**OLD_SAVED, "name": "sgd", "momentum": 0.5, "nesterov": False}
  sgd = [o for o in NOW if not o.startswith(("optimizer.name", "optimizer.muon.momentum",
                                             "optimizer.muon.nesterov"))]
  now = config.to_dict(config.load(_runs.TINY, [*sgd, "optimizer.name=sgd",
                                                "optimizer.sgd.momentum=0.5",
                                                "optimizer.sgd.nesterov=false"]))
  assert resume.config_differences(_saved_before_the_sections(now, old), now) == []
  upgraded = config.upgrade_saved({"optimizer": old})["optimizer"]
  assert upgraded["sgd"] == {"momentum": 0.5, "nesterov": False}
  assert "momentum" not in upgraded.get("muon", {})


def test_a_study_marker_with_the_flat_keys_is_the_same_config(tmp_path):
  """tools/delay_study.py compares a cell's saved config too: read in today's keys."""
  run_dir = tmp_path / "muon-sync-s0"
  run_dir.mkdir()
  (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n')
  overrides = ("run.steps=2", "optimizer.name=muon", "optimizer.muon.momentum=0.9")
  cell = study_lib.Cell("muon-sync-s0", str(run_dir), "muon", "sync", 0, 3e-3, 2, overrides)

  def mark(momentum):
    tree = study_lib.trajectory_config(_runs.TINY, overrides)
    flat = {k: v for k, v in tree["optimizer"].items() if not isinstance(v, dict)}
    tree["optimizer"] = {**flat, "momentum": momentum, "lion_b1": 0.9}
    (run_dir / study_lib.MARKER).write_text(json.dumps({"config": tree, "pid": None}))

  mark(0.9)
  assert study_lib.cell_state(cell, _runs.TINY) == "restart"
  mark(0.8)
  with pytest.raises(study_lib.StudyError, match=r"optimizer.muon.momentum: 0.8 -> 0.9"):
    study_lib.cell_state(cell, _runs.TINY)


def _flatten_optimizer(tree: dict) -> dict:
  """A saved config in the flat layout, for a run whose optimizer reads each key's first place."""
  out = copy.deepcopy(tree)
  section = out["optimizer"]
  for old, targets in optim.MOVED.items():
    sub, key = targets[0].split(".")
    section[old] = section[sub][key]
  for name in _sections():
    del section[name]
  return out


def _rewrite_saved_configs(run_dir: str, step: int) -> None:
  """Rewrites run_dir/config.yaml and checkpoint `step`'s config as the flat layout wrote them."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = os.path.join(run_dir, "config.yaml")
  with open(path) as f:
    tree = yaml.safe_load(f)
  with open(path, "w") as f:
    yaml.safe_dump(_flatten_optimizer(tree), f, sort_keys=False)
  ckpt_dir = os.path.join(run_dir, "checkpoints")
  manager = ocp.CheckpointManager(ckpt_dir, item_names=("state", "data", "meta"))
  out = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore(),
      meta=ocp.args.JsonRestore()))
  meta = dict(out["meta"])
  meta["config"] = _flatten_optimizer(meta["config"])
  shutil.rmtree(os.path.join(ckpt_dir, str(step)))
  manager.reload()
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(out["state"]), data=ocp.args.JsonSave(out["data"]),
      meta=ocp.args.JsonSave(meta)), force=True)
  manager.wait_until_finished()
  manager.close()


def test_a_run_saved_with_the_flat_keys_resumes_exactly_and_reads_back(tmp_path):
  """The checkpoint and config.yaml of a run before the sections: resume, export's reader."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxpipe import runs  # pylint: disable=g-import-not-at-top
  common = ["run.steps=4", "checkpoint.every=2", "checkpoint.async_save=false",
            "eval.every=2", "optimizer.name=muon", "optimizer.muon.momentum=0.9",
            "optimizer.lion.b1=0.8"]

  def train(run_dir):
    return trainer.train(config.load(_runs.TINY, [f"run.dir={run_dir}", *common]))

  whole, older = str(tmp_path / "whole"), str(tmp_path / "older")
  train(whole)
  shutil.copytree(whole, older)
  shutil.rmtree(os.path.join(older, "checkpoints", "4"))
  _rewrite_saved_configs(older, 2)
  with open(os.path.join(older, "config.yaml")) as f:
    assert yaml.safe_load(f)["optimizer"]["momentum"] == 0.9   # the flat layout indeed
  # Export and generation read the run's config.yaml and weights.
  cfg, params, _ = runs.load_params(older, 2)
  assert cfg.optimizer.muon.momentum == 0.9 and cfg.optimizer.lion.b1 == 0.8
  _, want, _ = runs.load_params(whole, 2)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The same command continues the run bit for bit.
  assert train(older)["start_step"] == 2
  assert _runs.train_losses(older) == _runs.train_losses(whole)
  assert _runs.val_losses(older) == _runs.val_losses(whole)
