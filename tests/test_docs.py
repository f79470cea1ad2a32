"""The documentation's code runs: every ```python block of README.md and docs/*.md."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
BLOCKS = [(os.path.relpath(path, ROOT), i, code) for path in DOCS
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", open(path).read(), re.S))]


@pytest.mark.parametrize("where,index,code", BLOCKS,
                         ids=[f"{w}#{i}" for w, i, _ in BLOCKS])
def test_python_block_runs(where, index, code):
  exec(compile(code, f"{where} block {index}", "exec"), {"__name__": "__doc_block__"})


def test_readme_opens_with_the_two_commands():
  lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
  commands = [l for l in lines[:20] if l.startswith("python3 -m venv .venv")]
  assert len(commands) == 2
  assert commands[0].endswith("train.py --config configs/quickstart.yaml")
  assert commands[1].endswith("-m pytest")
  # .ci/run takes the line two below "Run the tests:" (the line after ```bash).
  at = next(i for i, l in enumerate(lines) if l.startswith("Run the tests:"))
  assert lines[at + 2] == commands[1]
  # The tests' environment brings jaxlib's CUDA plugin: test_gpu.py compiles for GPU targets.
  assert "install -q -e '.[dev,cuda]'" in commands[1]


def test_relative_links_point_at_files():
  broken = []
  for path in DOCS:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", open(path).read()):
      if "://" in target:
        continue
      if not os.path.exists(os.path.join(os.path.dirname(path), target)):
        broken.append(f"{os.path.relpath(path, ROOT)} -> {target}")
  assert not broken, broken


def test_every_shipped_config_chooses_its_stash_and_says_what_it_costs():
  """Each configs/*.yaml sets pipeline.stash explicitly, with a comment on its cost."""
  import yaml  # pylint: disable=g-import-not-at-top
  paths = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
  assert paths
  for path in paths:
    text = open(path).read()
    pipeline = (yaml.safe_load(text) or {}).get("pipeline", {})
    assert pipeline.get("stash") in ("inputs", "residuals"), path
    lines = text.splitlines()
    at = next(i for i, l in enumerate(lines) if l.strip().startswith("stash:"))
    said = "\n".join(lines[max(0, at - 4):at + 1])
    assert "#" in said, f"{path}: no comment beside pipeline.stash"
