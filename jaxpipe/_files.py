"""Output that appears only when complete, with the modes the user's umask gives."""

from __future__ import annotations

import os
import secrets


def umask() -> int:
  """The process umask, read without changing it.

  Linux states it in /proc/self/status. Elsewhere it is set and set back,
  the only portable way to read it: a file another thread creates in between
  gets the stand-in umask 022.
  """
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError):
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def file_mode() -> int:
  """The mode `open()` gives a new file: 0666 & ~umask."""
  return 0o666 & ~umask()


def fresh_dir(parent: str, prefix: str) -> str:
  """Creates a new empty folder `parent/PREFIXrandom` and returns its path.

  Unlike `tempfile.mkdtemp`, whose folders are 0700, the folder takes the
  mode `os.makedirs` gives under the process umask (0777 & ~umask), so output
  built in it and renamed into place is readable by whoever may read its
  neighbours. mkdtemp's private mode guards a folder in a shared /tmp; these
  folders live beside the output, in a directory the user chose.
  """
  for _ in range(100):
    path = os.path.join(parent, prefix + secrets.token_hex(4))
    try:
      os.mkdir(path)  # fails if it exists: nothing else can be handed the same folder
    except FileExistsError:
      continue
    return path
  raise FileExistsError(f"{parent}: no free name for a folder starting {prefix}")
