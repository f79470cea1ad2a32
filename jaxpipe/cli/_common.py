"""What the commands share: a usage error and a bad input are one line on stderr."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from jaxpipe.errors import InputError


class Parser(argparse.ArgumentParser):
  """An ArgumentParser whose usage error is one line, `PROG: message (see --help)`, status 2."""

  def error(self, message: str) -> None:
    self.exit(2, f"{self.prog}: {message} (see --help)\n")


def run_reported(prog: str, work: Callable[[], Any], summary: Callable[[Any], str], *,
                 interrupted: str) -> int:
  """Runs `work()` and prints `summary` of its result: the command's exit status.

  0 after the summary; 2 with `PROG: message` on stderr for an InputError;
  130 with `PROG: interrupted` on stderr for Ctrl-C.
  """
  try:
    result = work()
  except InputError as e:
    print(f"{prog}: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"{prog}: {interrupted}", file=sys.stderr)
    return 130
  print(summary(result))
  return 0
