"""What every ``gpipe`` command shares: the one-line usage error and the parser that raises it."""

from __future__ import annotations

import argparse
from typing import NoReturn

from gpipe.planning.simulate import Costs
from gpipe.training.rules import check_v_stages, multi_stage_schedules, positive

__all__ = [
    "MICROBATCH_TOKENS_HELP",
    "PAGE_OPTIONS",
    "Parser",
    "UsageError",
    "check_v_stages",
    "multi_stage_schedules",
    "microbatch_tokens",
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


def read_costs(path: str, n_stages: int) -> Costs:
    """``--costs FILE``: the cost model in JSON, with one value per stage where it is a list."""
    try:
        costs = Costs.from_file(path)
        for name in ("forward", "backward", "weight", "activation_bytes"):
            costs.per_stage(name, n_stages)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--costs {path}: {exc}") from None
    return costs


def microbatch_tokens(args: argparse.Namespace, chunks: str = "--chunks {m}") -> list[float] | None:
    """``--microbatch-tokens``, checked: it sets ``--chunks`` when that is not given (8 when
    neither is), and must agree with it when both are (``chunks`` says where M came from)."""
    if args.microbatch_tokens is None:
        args.chunks = 8 if args.chunks is None else args.chunks
        return None
    try:
        tokens = [float(t) for t in args.microbatch_tokens.split(",")]
    except ValueError:
        tokens = []
    if not tokens or any(not t > 0 for t in tokens):
        raise UsageError(
            "--microbatch-tokens must be a comma list of positive token counts, got "
            f"{args.microbatch_tokens!r}"
        )
    if args.chunks not in (None, len(tokens)):
        raise UsageError(
            f"{chunks.format(m=args.chunks)} but --microbatch-tokens lists {len(tokens)} "
            "micro-batches: give one, or both agreeing"
        )
    args.chunks = len(tokens)
    return tokens


MICROBATCH_TOKENS_HELP = (
    "tokens of each micro-batch, such as packed sequences give (e.g. 100,30,500): each "
    "micro-batch's compute costs in proportion, the costs being those of the mean one "
    "(Costs.microbatch_scale), so uneven micro-batches show in the bubble"
)
