"""`ScheduleOptions`: one typed object for a schedule's options, read from the config in one place.

It is frozen; `make_schedule`'s keyword arguments replace its fields and a
misspelled one is refused by name; its fields are the schedule classes'
keyword arguments; `trainer.schedule_from_config` fills it from what the
config says; and no code outside that function calls `make_schedule`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os

import pytest

from jaxpipe import config as config_lib, optim, trainer
from jaxpipe.pipeline import Schedule, ScheduleOptions, make_mesh, make_schedule
from tests import _pipeline_util as util
from tests import _runs

# Where code may call `make_schedule`: (file, the function around the call).
ALLOWED = {("jaxpipe/trainer.py", "schedule_from_config")}


def test_options_are_frozen():
  opts = ScheduleOptions()
  with pytest.raises(dataclasses.FrozenInstanceError):
    opts.stash = "residuals"  # type: ignore[misc]
  assert dataclasses.replace(opts, stash="residuals").stash == "residuals"
  assert opts.stash == "inputs"   # the copy changed, not the original


def test_options_are_the_schedule_classes_keyword_arguments():
  # make_schedule hands each field to the class as the keyword of that name:
  # the two lists, and their defaults, must be one.
  params = inspect.signature(Schedule.__init__).parameters.values()
  keywords = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
  fields = {f.name: f.default for f in dataclasses.fields(ScheduleOptions)}
  assert fields == keywords


def test_a_misspelled_option_is_a_type_error_naming_it():
  fns, opt, mesh = util.stage_fns(), util.optimizer("adamw"), make_mesh(2, 1)
  with pytest.raises(TypeError, match="'stahs'"):
    make_schedule("1f1b", fns, opt, mesh, 2, stahs="residuals")
  with pytest.raises(TypeError, match="'virtual_stage'"):
    make_schedule("1f1b", fns, opt, mesh, 2, ScheduleOptions(), virtual_stage=1)
  # Spelt right, the keyword replaces that field of the options given, and
  # the schedule runs with the result.
  sch = make_schedule("1f1b", fns, opt, mesh, 2, ScheduleOptions(shard_optimizer=False),
                      stash="residuals")
  assert sch.options == ScheduleOptions(stash="residuals", shard_optimizer=False)
  assert (sch.stash, sch.shard_optimizer) == ("residuals", False)


def _from_config(overrides, stages=None, **kwargs):
  """`schedule_from_config` of configs/tiny.yaml with `overrides`, on `stages` (the config's)."""
  cfg = config_lib.load(_runs.TINY, ["model.vocab_size=257", *overrides])
  _, fns, optimizer = trainer.components(cfg)
  mesh = make_mesh(stages or cfg.pipeline.stages, cfg.mesh.data)
  return trainer.schedule_from_config(cfg, fns, optimizer, mesh, **kwargs)


@pytest.mark.parametrize("overrides, kwargs, name, expected", [
    (("pipeline.head=last_stage",), {}, "none", ScheduleOptions(vocab_parallel=False)),
    (("pipeline.schedule=1f1b", "pipeline.stages=2", "pipeline.stash=residuals",
      "mesh.shard_optimizer=false", "mesh.expert_parallel=false", "pipeline.head=last_stage"),
     {}, "1f1b",
     ScheduleOptions(stash="residuals", shard_optimizer=False, expert_parallel=False,
                     vocab_parallel=False)),
    (("pipeline.schedule=interleaved", "pipeline.stages=2", "pipeline.virtual_stages=2",
      "pipeline.microbatches=4", "pipeline.head=vocab_parallel", "mesh.data=2"),
     {}, "interleaved", ScheduleOptions(virtual_stages=2, vocab_parallel=True)),
    (("optimizer.weight_prediction=1.0", "pipeline.head=vocab_parallel"), {}, "none",
     ScheduleOptions(predict=optim.predicted_params)),
    # Asked for another schedule than the config's (the planner's
    # comparisons): the stash asked for, and no weight prediction, which
    # only schedule none takes.
    (("optimizer.weight_prediction=1.0", "pipeline.head=vocab_parallel"),
     {"schedule": "gpipe", "stash": "residuals", "stages": 2}, "gpipe",
     ScheduleOptions(stash="residuals")),
], ids=["none", "1f1b", "interleaved", "prediction", "other-schedule"])
def test_schedule_from_config_takes_the_options_the_config_says(overrides, kwargs, name,
                                                                expected):
  sch = _from_config(overrides, **kwargs)
  assert sch.name == name
  assert sch.options == expected
  # What the schedule itself runs with (expert parallelism aside: a dense
  # model has no experts to split, whatever was asked).
  assert (sch.stash, sch.virtual_stages, sch.shard_optimizer, sch.vocab_parallel,
          sch.predict) == (expected.stash, expected.virtual_stages, expected.shard_optimizer,
                           expected.vocab_parallel, expected.predict)


def _sources() -> dict[str, str]:
  """{path relative to the repository: source} of train.py and every .py under jaxpipe/, tools/."""
  out = {}
  paths = [os.path.join(_runs.ROOT, "train.py")]
  for top in ("jaxpipe", "tools"):
    for base, _, files in os.walk(os.path.join(_runs.ROOT, top)):
      paths += [os.path.join(base, f) for f in files if f.endswith(".py")]
  for path in paths:
    with open(path, encoding="utf-8") as f:
      out[os.path.relpath(path, _runs.ROOT).replace(os.sep, "/")] = f.read()
  return out


def make_schedule_calls(sources: dict[str, str]) -> set[tuple[str, str]]:
  """(file, innermost function or '<module>') of each `make_schedule` call, by name or attribute."""
  out = set()

  def visit(path, node, where):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.Call) and "make_schedule" in (getattr(child.func, "id", None),
                                                             getattr(child.func, "attr", None)):
        out.add((path, where))
      inner = (child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
               else where)
      visit(path, child, inner)

  for path, text in sources.items():
    visit(path, ast.parse(text), "<module>")
  return out


def test_only_schedule_from_config_calls_make_schedule():
  assert make_schedule_calls(_sources()) == ALLOWED


def test_the_call_check_can_fail():
  sources = {
      "jaxpipe/trainer.py": "def schedule_from_config():\n  return make_schedule(1)\n",
      "tools/t.py": "def run():\n  def inner():\n    pipeline.make_schedule(2)\n",
      "jaxpipe/x.py": "make_schedule(3)\n",
  }
  assert make_schedule_calls(sources) == {
      ("jaxpipe/trainer.py", "schedule_from_config"), ("tools/t.py", "inner"),
      ("jaxpipe/x.py", "<module>")}
