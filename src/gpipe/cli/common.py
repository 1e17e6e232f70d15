"""What every ``gpipe`` command shares: the one-line usage error and the parser that raises it."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from gpipe.planning.simulate import Costs
from gpipe.schedules import SCHEDULES, traits

__all__ = [
    "PAGE_OPTIONS",
    "Parser",
    "UsageError",
    "multi_stage_schedules",
    "positive",
    "read_costs",
]

# The options that set each of the page's settings (gpipe.view.check_settings names them).
PAGE_OPTIONS = {
    "stages": "--stages",
    "chunks": "--chunks",
    "schedule": "--schedule",
    "virtual_stages": "--virtual-stages",
    "checkpoint": "--checkpoint",
    "costs": "--costs",
}


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


def read_costs(path: str, n_stages: int) -> Costs:
    """``--costs FILE``: the cost model in JSON, with one value per stage where it is a list."""
    try:
        costs = Costs.from_file(path)
        for name in ("forward", "backward", "weight", "activation_bytes"):
            costs.per_stage(name, n_stages)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--costs {path}: {exc}") from None
    return costs


def multi_stage_schedules() -> str:
    """The registered schedules that place several stages on each rank, as ``--schedule``
    values for a message or a help text: ``interleaved``, or ``a or b``."""
    return " or ".join(name for name in SCHEDULES if traits(name).several_stages_per_rank)
