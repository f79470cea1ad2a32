"""README's table of train.py's exit statuses is the code's, and each status is produced by a test.

The tests that run train.py to a status carry `@pytest.mark.exit_status(N)`
and assert that status themselves; this file checks that every status in the
table has such a test, that no test claims a status the table lacks, and
that the table lists exactly the statuses the trainer defines.
"""

import ast
import glob
import os
import re

from jaxpipe import trainer
from jaxpipe.cli import train as train_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _documented() -> set:
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  table = text[text.index("Exit statuses of `train.py`"):]
  table = table[:table.index("\n\n", table.index("| status |"))]
  found = set()
  rows = [l for l in table.splitlines() if l.startswith("|")][2:]  # after header and rule
  for row in rows:
    cell = row.split("|")[1].strip()
    found.add("128+N" if cell.startswith("128+N") else int(cell))
  return found


def _marked() -> dict:
  """{status: [test names]} from every `pytest.mark.exit_status(...)` in tests/."""
  out = {}
  for path in glob.glob(os.path.join(ROOT, "tests", "test_*.py")):
    with open(path) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if not isinstance(node, ast.FunctionDef):
        continue
      for deco in node.decorator_list:
        if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
            and deco.func.attr == "exit_status"):
          status = deco.args[0].value
          out.setdefault(status, []).append(f"{os.path.basename(path)}::{node.name}")
  return out


def test_the_table_lists_exactly_the_statuses_the_trainer_defines():
  defined = {0, 2, trainer.EXIT_NONFINITE, trainer.EXIT_LOST, trainer.EXIT_IOERR,
             trainer.EXIT_INTERRUPTED}
  assert trainer.EXIT_SIGNAL == 128
  assert _documented() == defined | {"128+N"}


def test_every_documented_status_is_produced_by_a_test():
  documented, marked = _documented(), _marked()
  missing = documented - set(marked)
  assert not missing, f"no test runs train.py to status {sorted(map(str, missing))}"
  assert set(marked) <= documented, f"tests claim undocumented statuses: {set(marked) - documented}"


def test_the_command_s_help_names_every_status():
  doc = train_cli.__doc__
  for status in _documented():
    number = "128+signal" if status == "128+N" else str(status)
    assert re.search(rf"(^|[ ;(]){re.escape(number)}\b", doc), (number, doc)
