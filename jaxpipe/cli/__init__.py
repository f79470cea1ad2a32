"""Command-line entry points, and what they share with the tools: `Parser` and `run_reported`."""

from jaxpipe.cli._common import Parser, run_reported

__all__ = ["Parser", "run_reported"]
