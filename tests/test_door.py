"""What a newcomer meets first: docstrings as help() shows them, a mistyped config key.

Both checks are functions over plain values, so each also runs on a
synthetic case that breaks it, to show it can fail.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import unicodedata

import pytest

import jaxpipe
from jaxpipe import config
from jaxpipe.errors import ConfigError


def control_characters(text: str) -> list[str]:
  """The control characters of `text` other than newline, as repr()s, in order."""
  return [repr(c) for c in text if unicodedata.category(c) == "Cc" and c != "\n"]


def _public_docs(module) -> dict[str, str]:
  """{qualified name: docstring} of a module, its public functions and classes and their methods.

  Only what the module defines itself: a name it imports is checked where
  it is defined.
  """
  docs = {module.__name__: module.__doc__ or ""}
  for name, obj in vars(module).items():
    if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
      continue
    if inspect.isclass(obj):
      docs[f"{module.__name__}.{name}"] = obj.__doc__ or ""
      for attr, member in vars(obj).items():
        if not attr.startswith("_") and inspect.isfunction(member):
          docs[f"{module.__name__}.{name}.{attr}"] = member.__doc__ or ""
    elif inspect.isfunction(obj):
      docs[f"{module.__name__}.{name}"] = obj.__doc__ or ""
  return docs


def bad_docstrings(docs: dict[str, str]) -> list[str]:
  """'name: characters' for each docstring holding a control character other than newline."""
  return [f"{name}: {', '.join(control_characters(doc))}"
          for name, doc in sorted(docs.items()) if control_characters(doc)]


def test_every_docstring_reads_as_written():
  # "\beta" in a non-raw string is a backspace and "eta": help() shows
  # \x08eta. Every module is imported, jaxpipe.gpu's too: they import
  # without a GPU, so none is passed over.
  docs = _public_docs(jaxpipe)
  modules = [m.name for m in pkgutil.walk_packages(jaxpipe.__path__, "jaxpipe.")]
  assert "jaxpipe.optim" in modules and "jaxpipe.cli.prepare_data" in modules, modules
  for name in modules:
    docs.update(_public_docs(importlib.import_module(name)))
  assert "jaxpipe.optim._muon.scale_by_muon" in docs
  assert bad_docstrings(docs) == []


def test_the_docstring_check_can_fail():
  # The very mistake: a LaTeX \beta (and \frac, \v) in a non-raw docstring.
  def f():
    """m = \beta m + (1 - \beta) g, \frac{a}{b}, a\vb, tab\tinside."""
  assert bad_docstrings({"f": f.__doc__}) == [
      "f: '\\x08', '\\x08', '\\x0c', '\\x0b', '\\t'"]
  assert bad_docstrings({"g": "Two lines,\nnewline only."}) == []


def _error(overrides=(), tree=None) -> str:
  """The one-line ConfigError that `overrides` (or a config `tree`) draws."""
  with pytest.raises(ConfigError) as e:
    if tree is not None:
      config.from_dict(tree)
    else:
      config.apply_overrides({}, list(overrides))
  message = str(e.value)
  assert "\n" not in message, message
  return message


@pytest.mark.parametrize("key,meant", [
    ("optimizer.lrr", "optimizer.lr"),     # a key
    ("optimiser.lr", "optimizer.lr"),      # a section
    ("optimiser.lrr", "optimizer.lr"),     # both
    ("run.Steps", "run.steps"),            # case
])
def test_a_mistyped_override_is_answered_with_the_key_meant(key, meant):
  message = _error([f"{key}=1"])
  assert message.startswith(f"unknown config key '{key}' (did you mean '{meant}'?); "
                            "valid keys in "), message
  # The valid keys are still listed: those of the level that went wrong.
  where = "optimizer" if key == "optimizer.lrr" else ("run" if key == "run.Steps" else "")
  valid = config.to_dict(config.Config())
  keys = valid[where] if where else valid
  assert message.endswith(": " + ", ".join(keys)), message


def test_a_mistyped_key_in_a_config_file_is_answered_too():
  message = _error(tree={"optimizer": {"lrr": 1e-3}})
  assert message.startswith("unknown config key 'optimizer.lrr' (did you mean 'optimizer.lr'?); "
                            "valid keys in optimizer: name, lr,"), message
  message = _error(tree={"optimiser": {"lr": 1e-3}})
  assert message.startswith("unknown config key 'optimiser' (did you mean 'optimizer'?); "
                            "valid keys in the top level: run, data,"), message


@pytest.mark.parametrize("key", ["optimizer.zzzz", "zzzz.lr", "optimizer.lr.x", "optimiser"])
def test_a_key_like_no_other_gets_no_guess(key):
  # `optimiser` alone would name a section, which an override cannot set.
  message = _error([f"{key}=1"])
  assert message.startswith(f"unknown config key '{key}'") and "did you mean" not in message, \
      message
  assert _error(tree={"zzzz": 1}).startswith("unknown config key 'zzzz'; valid keys in ")


@pytest.mark.parametrize("override,message", [
    ("pipeline.schedule=Gpipe", "pipeline.schedule must be none, gpipe, 1f1b, 2bw, pipedream, "
     "interleaved or zb1, got 'Gpipe' (did you mean 'gpipe'?)"),
    ("optimizer.name=adamm", "optimizer.name must be adamw, muon, lion, adan, sgd, mars, "
     "normuon or soap, got 'adamm' (did you mean 'adamw'?)"),
    ("pipeline.head=middle", "pipeline.head must be auto, vocab_parallel or last_stage, "
     "got 'middle'"),
])
def test_a_value_outside_a_choice_is_answered_with_the_choices(override, message):
  # The key's type (a Literal) lists the choices; reading the value checks them, once.
  with pytest.raises(ConfigError) as e:
    config.load(None, [override])
  assert str(e.value) == message


def test_a_choice_given_as_another_type_names_the_choices_too():
  with pytest.raises(ConfigError) as e:
    config.from_dict({"model": {"remat": True}})
  assert str(e.value) == "model.remat must be none, full or dots, got True"
