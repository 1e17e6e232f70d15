"""``gpipe plan --shard``: the replicas' parameters, gradients and optimizer state split over
them (``Pipeline``'s ``shard``), as the planner and ``--suggest`` count them."""

from __future__ import annotations

import argparse
from typing import Any

from gpipe.cli.common import UsageError

__all__ = ["add_shard_arguments", "plan_options", "planned_shard", "searched_shards"]

_MODES = ("none", "optimizer", "gradients", "full")


def add_shard_arguments(p: Any) -> None:
    p.add_argument(
        "--shard",
        choices=_MODES,
        help="with --data-parallel: split each stage's states over its replicas as "
        "Pipeline(shard=...) does: optimizer state (optimizer), and gradients (gradients), "
        "and parameters (full); the table then adds what each process holds between steps "
        "(default none; with --suggest, full for a configuration that does not fit without)",
    )
    p.add_argument(
        "--reshard-after-forward",
        action="store_true",
        help="with --shard full: gather one layer's parameters at a time, for every forward "
        "and backward, rather than all of them once a step",
    )


def planned_shard(args: argparse.Namespace) -> str | None:
    """``--shard`` as ``plan`` takes it, checked against ``--data-parallel``."""
    shard = None if args.shard in (None, "none") else args.shard
    if shard is not None and args.data_parallel < 2:
        raise UsageError(
            f"--shard {shard} splits each stage over its replicas: it needs --data-parallel "
            f"2 or more, got {args.data_parallel}"
        )
    if args.reshard_after_forward and shard != "full":
        raise UsageError("--reshard-after-forward frees what --shard full gathers: add it")
    return shard


def searched_shards(args: argparse.Namespace) -> list[str | None] | None:
    """What ``--suggest`` tries: the ``--shard`` given, or (None) whole states and then, with
    replicas, ``full`` for a configuration that does not fit whole."""
    if args.data_parallel < 1:
        raise UsageError(f"--data-parallel must be a positive integer, got {args.data_parallel}")
    if args.batch_size < args.data_parallel:
        raise UsageError(
            f"--batch-size {args.batch_size} cannot give each of --data-parallel "
            f"{args.data_parallel} replicas a row"
        )
    if args.reshard_after_forward:
        raise UsageError("--suggest plans the gathers once a step: drop --reshard-after-forward")
    shard = planned_shard(args)
    return None if args.shard is None else [shard]


def plan_options(args: argparse.Namespace) -> dict[str, Any]:
    """What ``gpipe plan``'s flags tell ``planning.memory.plan`` besides the profile and the
    cut: the same for the built-in GPT and for a split model."""
    return {
        "batch_size": args.batch_size,
        "chunks": args.chunks,
        "schedule": args.schedule,
        "checkpoint": args.checkpoint,
        "optimizer": args.optimizer,
        "n_ranks": args.stages,
        "data_parallel": args.data_parallel,
        "shard": planned_shard(args),
        "reshard_after_forward": args.reshard_after_forward,
    }
