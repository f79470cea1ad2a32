"""The config's keys as `train.py --help` lists them, each with its default and its note.

Read from `jaxpipe.config`'s dataclasses and the comments beside their
fields, so the list never drifts from the keys `load` accepts.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import textwrap
import tokenize
import typing

from jaxpipe import config as config_lib

__all__ = ["field_notes", "describe"]


def field_notes(cls: type) -> dict[str, str]:
  """Each field's documentation: the comment beside it, or the comment lines just above it.

  Read from the class's source, where the fields are documented; empty when
  the source is not available (an installed package without .py files).
  """
  try:
    source = textwrap.dedent(inspect.getsource(cls))
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
  except (OSError, TypeError, tokenize.TokenError):
    return {}
  comments = {t.start[0]: t.string.lstrip("#").strip() for t in tokens
              if t.type == tokenize.COMMENT}
  lines = source.splitlines()
  names = {f.name for f in dataclasses.fields(cls)}
  notes = {}
  for number, line in enumerate(lines, 1):
    name = line.strip().split(":", 1)[0]
    if name not in names or ":" not in line:
      continue
    above, at = [], number - 1
    while at in comments and lines[at - 1].lstrip().startswith("#"):
      above.insert(0, comments[at])
      at -= 1
    notes[name] = comments.get(number) or " ".join(above)
  return notes


def describe(cls: type | None = None, prefix: str = "") -> list[str]:
  """Every config key with its default and its documentation, one line each, by section.

  Generated from the dataclasses, so it lists exactly the keys `load` accepts
  (`train.py --help` prints it).
  """
  cls = config_lib.Config if cls is None else cls
  out, sections = [], []
  notes, hints = field_notes(cls), typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if dataclasses.is_dataclass(default):
      sections.append((type(default), f"{prefix}{f.name}"))
      continue
    text = json.dumps(default)
    hint = hints.get(f.name)
    choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()
    if choices:
      text += f" (one of {' | '.join(choices)})"
    note = f"  # {notes[f.name]}" if notes.get(f.name) else ""
    out.append(f"  {f.name}: {text}{note}")
  if out:
    out.insert(0, f"{prefix[:-1]}:")
  for sub, name in sections:
    out += describe(sub, name + ".")
  return out
