"""House rules read from the source alone (pure `ast`, no JAX): short functions,
no private names across modules, no import cycles, each choice list defined once.

Every check is a function over source text, so each test also runs it on a
small synthetic source that breaks the rule, to show the check can fail.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED = ("jaxpipe", "tools")
MAX_LINES = 110


def _sources(root: str = ROOT) -> dict[str, str]:
  """{path relative to root: source} of every .py file under jaxpipe/ and tools/."""
  out = {}
  for top in CHECKED:
    for base, dirs, files in os.walk(os.path.join(root, top)):
      dirs[:] = sorted(d for d in dirs if d != "__pycache__")
      for f in sorted(files):
        if f.endswith(".py"):
          path = os.path.join(base, f)
          with open(path, encoding="utf-8") as fh:
            out[os.path.relpath(path, root).replace(os.sep, "/")] = fh.read()
  return out


def _module_of(path: str) -> str:
  """The name a file is imported under: tools/ run as scripts, so theirs are top-level."""
  parts = path[:-len(".py")].split("/")
  if parts[0] == "tools":
    parts = parts[1:]
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _package_of(path: str) -> str:
  """The package a file belongs to: itself for an __init__.py, else its parent."""
  module = _module_of(path)
  return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def long_functions(sources: dict[str, str], limit: int = MAX_LINES) -> list[tuple[str, str, int]]:
  """(path, function, lines) of every function longer than `limit`, def line to last line."""
  out = []
  for path, text in sources.items():
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > limit:
          out.append((path, node.name, lines))
  return out


def _imports(path: str, text: str, modules: set[str]):
  """Yields (node, alias, module, name) for every name imported in a file, lazy ones included.

  `module` is the absolute module imported from; `name` the name imported
  from it, or None when the import names the module itself (a submodule
  named in `from package import module` counts as the module).
  """
  package = _package_of(path)
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node, alias, alias.name, None
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")[:len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
      else:
        module = node.module
      for alias in node.names:
        sub = f"{module}.{alias.name}"
        if sub in modules:
          yield node, alias, sub, None
        else:
          yield node, alias, module, alias.name


def _private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: str, modules: set[str]) -> bool:
  return any(m == module or m.startswith(module + ".") for m in modules)


def private_imports(sources: dict[str, str]) -> list[str]:
  """Uses of another module's private name, or of a private module from outside its package.

  `from m import _name` is refused whatever m is, and `m._name` on one of
  this repository's modules bound by an import; `import a._b` (or any import
  through a private module `a._b`) only from files inside package `a`. The
  module rule covers this repository's modules: JAX's private `jax._src` has
  names (the distributed client) that no public module gives, and `os._exit`
  is public in all but name.
  """
  modules = {_module_of(p) for p in sources}
  out = []
  for path, text in sources.items():
    package = _package_of(path)
    bound = {}
    for node, alias, module, name in _imports(path, text, modules):
      where = f"{path}:{node.lineno}"
      if name is not None and _private(name):
        out.append(f"{where} imports private name {name} from {module}")
      # The name a module import binds (`import a.b` binds a, not the module a.b).
      if name is None and (alias.asname or isinstance(node, ast.ImportFrom)
                           or "." not in alias.name):
        bound[alias.asname or alias.name.rpartition(".")[2]] = module
      parts = module.split(".")
      for i, part in enumerate(parts):
        owner = ".".join(parts[:i])
        inside = bool(owner) and (package == owner or package.startswith(owner + "."))
        if _private(part) and not inside and _ours(module, modules):
          out.append(f"{where} imports private module {'.'.join(parts[:i + 1])} "
                     f"from outside {owner or 'its package'}")
          break
    for node in ast.walk(ast.parse(text)):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in bound and _private(node.attr)
          and _ours(bound[node.value.id], modules)):
        out.append(f"{path}:{node.lineno} uses private name {node.attr} of "
                   f"{bound[node.value.id]}")
  return out


def _lazy_submodules(path: str, text: str, by_module: dict[str, str]) -> set[str]:
  """Files a package's __init__.py loads on first use through a table of submodule names.

  The packages load their JAX-heavy parts lazily (`_LAZY = {"name": "_engine"}`
  read by a module `__getattr__`): an import all the same, as far as cycles go.
  """
  if not path.endswith("__init__.py"):
    return set()
  package, out = _module_of(path), set()
  for node in ast.parse(text).body:
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
      for value in node.value.values:
        if isinstance(value, ast.Constant) and f"{package}.{value.value}" in by_module:
          out.add(by_module[f"{package}.{value.value}"])
  return out


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
  """{file: files it imports} among the given files, lazy imports inside functions included.

  An import of `a.b.c` is an edge to c's file only (not to the __init__.py of
  a and a.b, which every submodule import runs and which would make every
  package that imports its own submodules a cycle); a name imported from a
  package (`from a.b import f`) is an edge to that package's __init__.py.
  """
  by_module = {_module_of(p): p for p in sources}
  graph = {}
  for path, text in sources.items():
    edges = set()
    for _, _, module, _ in _imports(path, text, set(by_module)):
      target = by_module.get(module)
      if target and target != path:
        edges.add(target)
    graph[path] = edges | _lazy_submodules(path, text, by_module)
  return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Each strongly connected set of more than one file (Tarjan), sorted."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        out.append(sorted(group))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(out)


def test_no_function_is_longer_than_the_limit():
  found = long_functions(_sources())
  assert not found, found


def test_the_length_check_can_fail():
  body = "\n".join(f"  x{i} = {i}" for i in range(MAX_LINES))
  found = long_functions({"a.py": f"def f():\n{body}\n\ndef g():\n  pass\n"})
  assert found == [("a.py", "f", MAX_LINES + 1)]


def test_no_private_name_is_imported_across_modules():
  found = private_imports(_sources())
  assert not found, "\n".join(found)


def test_the_private_import_check_can_fail():
  sources = {
      "jaxpipe/pipeline/__init__.py": "from jaxpipe.pipeline._cost import cost\n",
      "jaxpipe/pipeline/_cost.py": "def cost(): pass\ndef _helper(): pass\n",
      "jaxpipe/pipeline/_engine.py": ("from . import _cost\nfrom ._cost import cost\n"
                                      "_cost._helper()\n"),
      "jaxpipe/cli/planner.py": ("from jaxpipe.pipeline import _cost\n"
                                 "def f():\n  from jaxpipe.pipeline._cost import _helper\n"),
      "tools/bench.py": ("import jaxpipe.pipeline._cost\nfrom jaxpipe.pipeline import cost\n"
                         "import os\nos._exit(0)\n"),  # os is not this repository's
  }
  found = sorted(private_imports(sources))
  assert found == [
      "jaxpipe/cli/planner.py:1 imports private module jaxpipe.pipeline._cost "
      "from outside jaxpipe.pipeline",
      "jaxpipe/cli/planner.py:3 imports private module jaxpipe.pipeline._cost "
      "from outside jaxpipe.pipeline",
      "jaxpipe/cli/planner.py:3 imports private name _helper from jaxpipe.pipeline._cost",
      "jaxpipe/pipeline/_engine.py:3 uses private name _helper of jaxpipe.pipeline._cost",
      "tools/bench.py:1 imports private module jaxpipe.pipeline._cost "
      "from outside jaxpipe.pipeline",
  ], found


def test_no_import_cycle_among_files():
  cycles = import_cycles(import_graph(_sources()))
  assert not cycles, cycles


def test_the_cycle_check_can_fail():
  sources = {
      "tools/a.py": "import b\n",
      "tools/b.py": "def f():\n  import a\n",        # a lazy import closes the cycle
      "tools/c.py": "import a\n",
      "jaxpipe/p/__init__.py": "from jaxpipe.p._x import f\n",
      "jaxpipe/p/_x.py": "def f():\n  from jaxpipe.p import g\n",
      "jaxpipe/p/_y.py": "from jaxpipe.p import _x\n",  # the submodule, not the package
      "jaxpipe/q/__init__.py": "_LAZY = {'f': '_z'}\n",     # loaded on first use of q.f
      "jaxpipe/q/_z.py": "from jaxpipe.q import g\n",
  }
  assert import_cycles(import_graph(sources)) == [
      ["jaxpipe/p/__init__.py", "jaxpipe/p/_x.py"], ["jaxpipe/q/__init__.py", "jaxpipe/q/_z.py"],
      ["tools/a.py", "tools/b.py"]]


def choice_lists(sources: dict[str, str]) -> dict[frozenset, set[str]]:
  """{set of strings: files writing it out} for each tuple, list, set or Literal[...] of strings.

  A choice list written out in two files is one fact in two places; one
  read from the other (`typing.get_args`, an import) is not written out.
  """
  out: dict[frozenset, set[str]] = {}
  for path, text in sources.items():
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple):
        elts = node.slice.elts
      elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        elts = node.elts
      else:
        continue
      if len(elts) >= 2 and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                for e in elts):
        out.setdefault(frozenset(e.value for e in elts), set()).add(path)
  return out


# The choice lists the house keeps in one place each (the pipelined schedules
# are derived from the names, never written out): schedule names, stash modes, dtype names, pipeline.head, remat policies,
# attention settings, optimizer names, learning-rate schedules, NaN policies,
# mesh layouts, the tokenizers known by name.
CHOICES = {
    "schedules": {"none", "gpipe", "1f1b", "2bw", "pipedream", "interleaved", "zb1"},
    "stash": {"inputs", "residuals"},
    "dtypes": {"float32", "bfloat16", "float16"},
    "head": {"auto", "vocab_parallel", "last_stage"},
    "remat": {"none", "full", "dots"},
    "attention": {"auto", "xla", "blockwise", "cudnn"},
    "optimizers": {"adamw", "muon", "lion", "adan", "sgd", "mars", "normuon", "soap"},
    "lr schedules": {"constant", "cosine", "wsd"},
    "nan policies": {"skip", "stop"},
    "layouts": {"stage", "data"},
    "tokenizers": {"byte", "gpt2"},
}


def repeated_choices(sources: dict[str, str]) -> dict[str, list[str]]:
  """{choice list: the files} for each of CHOICES written out in more than one file."""
  found = choice_lists(sources)
  return {name: sorted(found.get(frozenset(values), ()))
          for name, values in CHOICES.items() if len(found.get(frozenset(values), ())) > 1}


def test_each_choice_list_is_written_once():
  found = choice_lists(_sources())
  missing = [name for name, values in CHOICES.items() if frozenset(values) not in found]
  assert not missing, f"no longer written anywhere (renamed?): {missing}"
  assert not repeated_choices(_sources())


def test_the_choice_check_can_fail():
  sources = {
      "jaxpipe/pipeline/_names.py": 'ScheduleName = Literal["none", "gpipe", "1f1b", "2bw", '
                                    '"pipedream"]\nSTASH = ("inputs", "residuals")\n',
      "jaxpipe/config.py": "SCHEDULES = SCHEDULE_NAMES\nSTASH = ['residuals', 'inputs']\n",
  }
  assert repeated_choices(sources) == {"stash": ["jaxpipe/config.py",
                                                 "jaxpipe/pipeline/_names.py"]}
