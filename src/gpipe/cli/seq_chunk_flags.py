"""``--seq-chunks S`` of ``gpipe simulate`` and ``gpipe plan``: micro-batches run as S
sub-sequences (``Pipeline(seq_chunks=S)``), its flag and what each command refuses with it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from gpipe.cli.common import UsageError
from gpipe.planning.memory import sub_sequence_carry
from gpipe.schedules.seq_chunked import SEQ_CHUNKED

__all__ = ["add_seq_chunks_argument", "check_plannable", "check_simulable", "gpt_carry_bytes"]


def add_seq_chunks_argument(p: argparse.ArgumentParser, what: str) -> None:
    """The ``--seq-chunks`` flag; ``what`` says how the command models the sub-sequences."""
    p.add_argument(
        "--seq-chunks",
        type=int,
        default=1,
        metavar="S",
        help=f"each micro-batch as S sub-sequences (gpipe train --seq-chunks; with "
        f"{', '.join(SEQ_CHUNKED)}): {what} (default 1)",
    )


def _positive(args: argparse.Namespace) -> int:
    s: int = args.seq_chunks
    if s < 1:
        raise UsageError(f"--seq-chunks must be a positive integer, got {s}")
    return s


def check_simulable(args: argparse.Namespace) -> None:
    """``gpipe simulate``: sub-sequences are simulated in its table and plot, not yet in the
    page, the schedule files it writes or reads."""
    s = _positive(args)
    taken = [f for f in ("schedule_csv", "dump_csv", "html") if getattr(args, f) is not None]
    if s > 1 and taken:
        flag = taken[0].replace("_", "-")
        raise UsageError(f"--seq-chunks {s} does not run with --{flag} yet")


def check_plannable(args: argparse.Namespace, gpt: bool, default_schedule: str) -> None:
    """``gpipe plan``: sub-sequences are planned for the built-in GPT's memory, under a
    schedule that runs them, whose sequence S divides."""
    s = _positive(args)
    if s == 1:
        return
    given = {
        "--generate": args.generate,
        "--suggest": args.suggest,
        "--shard": args.shard not in (None, "none"),
        f"--model {args.model}": not gpt,
    }
    for flag, present in given.items():
        if present:
            raise UsageError(f"--seq-chunks {s} is not planned with {flag} yet")
    schedule = args.schedule or default_schedule
    if schedule not in SEQ_CHUNKED:
        raise UsageError(
            f"--seq-chunks {s} runs with --schedule {', '.join(SEQ_CHUNKED)}, got {schedule}"
        )
    if args.seq_len % s:
        raise UsageError(f"--seq-chunks {s} does not divide --seq-len {args.seq_len}")


def gpt_carry_bytes(
    args: argparse.Namespace, n_layer: int, one_block: Callable[[argparse.Namespace], Any]
) -> list[float]:
    """With ``--seq-chunks``, what each layer of an ``n_layer``-block GPT hands the next
    sub-sequence per row (its blocks' keys and values, of the rank's heads): ``plan``'s
    ``carry_bytes``, from ``one_block(args)``'s one-block model and sub-sequence."""
    if args.seq_chunks == 1:
        return []
    layers, tokens = one_block(args)
    embedding, block, head = sub_sequence_carry(layers, tokens)
    return [embedding, *[block] * n_layer, head]
