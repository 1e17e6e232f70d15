"""The tables ``gpipe plan`` prints: a row per process of a plan, a row per configuration
that ``--suggest`` found."""

from __future__ import annotations

import argparse
from typing import Any

from gpipe.planning.memory import MemoryPlan, StagePlan, format_bytes
from gpipe.planning.suggest import Candidate, LayerCosts, Search

__all__ = ["print_plan", "print_suggestions"]


def _rows(args: argparse.Namespace) -> str:
    """The sequences a process's mini-batch holds: the batch, or each replica's share."""
    if args.data_parallel == 1:
        return str(args.batch_size)
    share = -(-args.batch_size // args.data_parallel)
    return f"{share} (of {args.batch_size}, over {args.data_parallel} replicas)"


def _states(result: MemoryPlan) -> str:
    """The optimizer, and how the replicas keep the states when they are sharded."""
    if result.shard is None:
        return result.optimizer
    return f"{result.optimizer}, sharded {result.shard} over {result.data_parallel} replicas"


def _table(header: list[str], rows: list[list[str]], left: frozenset[int] = frozenset()) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


def print_plan(
    args: argparse.Namespace,
    heading: str,
    cut: str,
    result: MemoryPlan,
    memory: int,
    starts: list[str] | None = None,
) -> None:
    """The plan's table, a row per process; ``starts`` (a split model's): the submodule
    where each stage begins, in place of the count of layers. Sharded, a column gives what
    each process holds between steps, and a line below says so."""
    params = sum(r.params for r in result.ranks)
    print(
        f"{heading}, {params / 1e6:,.1f} M parameters "
        f"({args.dtype}); {args.stages} stages, {cut}, "
        f"{args.schedule}, {args.chunks} micro-batches of {_rows(args)} sequences, "
        f"checkpoint {args.checkpoint}, {_states(result)}"
    )
    replicated, sharded = result.data_parallel > 1, result.shard is not None
    message = "reduce-scatter" if sharded else "all-reduce"
    header = [
        "rank",
        "layers" if starts is None else "stages begin at",
        "parameters",
        "weights",
        "grads+optimizer",
        "activations",
        *([message] if replicated else []),
        "total",
        *(["held between steps"] if sharded else []),
        f"fits {format_bytes(memory)}",
    ]
    _table(header, [_plan_row(r, memory, replicated, starts) for r in result.ranks])
    if sharded:
        print(
            f"held between steps: parameters, gradients and optimizer state, those --shard "
            f"{result.shard} splits as shards; weights and grads+optimizer: at the step's "
            "peak, with what is gathered or accumulated whole beside the shards"
        )


def _plan_row(r: StagePlan, memory: int, replicated: bool, starts: list[str] | None) -> list[str]:
    return [
        str(r.rank),
        str(r.layers) if starts is None else ", ".join(starts[s] for s in r.stages),
        f"{r.params / 1e6:,.1f} M",
        format_bytes(r.param_bytes),
        format_bytes(r.state_bytes),
        format_bytes(r.activation_bytes),
        *([format_bytes(r.allreduce_bytes)] if replicated else []),
        format_bytes(r.total_bytes),
        *([format_bytes(r.held_bytes)] if r.shard is not None else []),
        "yes" if r.total_bytes <= memory else "no",
    ]


def print_suggestions(
    args: argparse.Namespace, found: Search, costs: LayerCosts, memory: int
) -> None:
    """The fastest configurations that fit, as ``--top`` rows; with replicas, a column says
    which ones shard their states to fit."""
    shown = found.fitting[: args.top or 5]
    params = sum(r.params for r in shown[0].memory.ranks)
    replicas = f" over {args.data_parallel} replicas" if args.data_parallel > 1 else ""
    print(
        f"gpt: blocks {args.n_layer}, d_model {args.d_model}, {params / 1e6:,.1f} M parameters "
        f"({args.dtype}); {args.batch_size} sequences per step{replicas}, {args.optimizer}, "
        f"{format_bytes(memory)} per process"
    )
    print(f"{found.fits} of {found.searched} configurations fit ({_bounds(found)})")
    print(f"time: {costs.source}, backward 2 x forward, messages free")
    timed = costs.unit == "s"
    best = shown[0].step_time
    time = "step time" if timed else "relative time"
    shard = ["shard"] if args.data_parallel > 1 else []
    header = [
        "stages",
        "chunks",
        "schedule",
        "checkpoint",
        *shard,
        time,
        "bubble",
        "peak memory",
        "fits",
    ]
    rows = [_row(c, best, timed, memory, bool(shard)) for c in shown]
    _table(header, rows, frozenset({2, 3, 4} if shard else {2, 3}))  # names aligned left
    print(f"fastest: {shown[0].options()}")


def _row(c: Candidate, best: float, timed: bool, memory: int, replicas: bool) -> list[str]:
    schedule = c.schedule if c.virtual_stages == 1 else f"{c.schedule} v={c.virtual_stages}"
    shard = [c.shard or "none"] if replicas else []
    return [
        str(c.stages),
        str(c.chunks),
        schedule,
        c.checkpoint,
        *shard,
        f"{c.step_time:.3g} s" if timed else f"{c.step_time / best:.2f}",
        f"{c.bubble:.1%}",
        format_bytes(c.peak_bytes),
        f"yes ({c.peak_bytes / memory:.0%})",
    ]


def _bounds(found: Search) -> str:
    """What was searched, in a few words: the range of each dimension."""

    def span(values: set[Any]) -> str:
        low, high = min(values), max(values)
        return str(low) if low == high else f"{low}-{high}"

    grid = found.grid
    return (
        f"stages {span({g[0] for g in grid})}, chunks {span({g[1] for g in grid})}, "
        f"{len({g[2] for g in grid})} schedules, {len({g[3] for g in grid})} checkpoint modes"
    )
