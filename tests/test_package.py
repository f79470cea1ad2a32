"""jaxpipe as a package: what `jaxpipe.optim` imports, the console scripts, an install from git."""

import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPROJECT = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))

# The trainer's stack: none of it may load with `import jaxpipe.optim`.
NOT_FOR_OPTIM = ("flax", "orbax", "grain", "tiktoken", "tokenizers", "yaml", "tqdm",
                 "tensorboardX", "matplotlib", "safetensors", "jaxpipe.data", "jaxpipe.config",
                 "jaxpipe.model", "jaxpipe.pipeline", "jaxpipe.trainer")


def _python(code: str, cwd: str, env=None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        cwd=cwd, env=env, timeout=120)


def test_optim_imports_only_jax_and_optax(tmp_path):
  out = _python("import sys, jaxpipe.optim; "
                f"print(sorted(m for m in sys.modules if m.split('.')[0] in {NOT_FOR_OPTIM!r} "
                f"or m in {NOT_FOR_OPTIM!r}))",
                cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": ROOT})
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("name", sorted(PYPROJECT["project"]["scripts"]))
def test_console_script_targets_exist(name):
  module, func = PYPROJECT["project"]["scripts"][name].split(":")
  assert callable(getattr(importlib.import_module(module), func))


def test_every_dependency_of_the_code_is_declared():
  """Each third-party package jaxpipe/ imports is a dependency, or an extra's where optional."""
  project = PYPROJECT["project"]
  name = lambda d: re.split(r"[<>=!~ \[]", d, maxsplit=1)[0].lower().replace("-", "_")
  declared = {name(d) for d in project["dependencies"]}
  extras = {name(d) for ds in project["optional-dependencies"].values() for d in ds}
  # Import names that differ from distribution names.
  alias = {"yaml": "pyyaml", "orbax": "orbax_checkpoint", "tensorboardX": "tensorboardx"}
  imported = set()
  for base, _, files in os.walk(os.path.join(ROOT, "jaxpipe")):
    for f in (f for f in files if f.endswith(".py")):
      tree = ast.parse(open(os.path.join(base, f)).read())
      for node in ast.walk(tree):
        if isinstance(node, ast.Import):
          imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
          imported.add(node.module.split(".")[0])
  third_party = {m for m in imported
                 if m not in sys.stdlib_module_names and m not in ("jaxpipe", "__future__")}
  assert {"jax", "optax", "flax", "orbax"} <= third_party  # the walk saw the imports
  missing = {m for m in third_party if name(alias.get(m, m)) not in declared | extras}
  assert not missing, missing


def test_install_from_a_git_url_works_outside_the_clone(tmp_path):
  """`pip install git+file://...` builds the committed tree; its jaxpipe imports from anywhere."""
  if not os.path.isdir(os.path.join(ROOT, ".git")) or shutil.which("git") is None:
    pytest.skip("not a git checkout")
  target = tmp_path / "site"
  # No dependencies and no build isolation: only the package itself is built
  # and copied (the dependencies are this environment's), so no network is used.
  pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", "--target", str(target),
                        f"git+file://{ROOT}"], capture_output=True, text=True, timeout=300)
  assert pip.returncode == 0, pip.stderr[-2000:]
  files = {os.path.relpath(os.path.join(b, f), target)
           for b, _, fs in os.walk(target / "jaxpipe") for f in fs}
  for module in {v.split(":")[0] for v in PYPROJECT["project"]["scripts"].values()}:
    assert module.replace(".", "/") + ".py" in files, module
  out = _python("import jaxpipe, jaxpipe.optim, jaxpipe.cli.train; print(jaxpipe.__file__)",
                cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(target)})
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip().startswith(str(target)), out.stdout
