"""What every ``gpipe`` command shares: the one-line usage error and the parser that raises it."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

__all__ = ["Parser", "UsageError", "positive"]


class UsageError(Exception):
    """Bad input on the command line; reported in one line with exit code 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are UsageError, so ``main`` reports them in one line."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def positive(name: str, value: Any) -> None:
    """Refuse ``--name value`` unless it is unset or at least 1."""
    if value is not None and value < 1:
        raise UsageError(f"--{name} must be a positive integer, got {value}")
