"""Errors that mean "the input is wrong", as opposed to "the code is wrong".

`train.py` and the tools catch `InputError`, print its message as one line on
stderr and exit with status 2. Everything else is a bug and keeps its traceback.
"""

__all__ = ["InputError", "ConfigError", "DataError", "CheckpointError", "check_config"]


class InputError(ValueError):
  """Bad user input; the message names the culprit and the fix in one line."""


class ConfigError(InputError):
  """A config key is unknown, mistyped, or inconsistent with another key."""


class DataError(InputError):
  """A data file is missing, truncated, corrupt, or does not fit the config."""


class CheckpointError(InputError):
  """A checkpoint is unreadable or does not fit the run's config."""


def check_config(cond: bool, message: str) -> None:
  """Raises ConfigError(message) unless `cond`: the config sections' one-line checks."""
  if not cond:
    raise ConfigError(message)
