"""The tables ``gpipe plan`` prints: a row per process of a plan, a row per configuration
that ``--suggest`` found."""

from __future__ import annotations

import argparse
from typing import Any

from gpipe.planning.memory import MemoryPlan, StagePlan, format_bytes
from gpipe.planning.suggest import Candidate, LayerCosts, Search


def _tensor_line(args: argparse.Namespace, tensor_parallel: int) -> str | None:
    """What tensor parallelism changes in the figures, and the world, or None without it."""
    if tensor_parallel == 1:
        return None
    k, d, t = args.stages, args.data_parallel, tensor_parallel
    return (
        f"tensor parallel T={t}: each row is one of a stage's {t} ranks (per rank: parameters, "
        f"gradients and optimizer state split where the plan splits them, activations split "
        f"inside attention and the MLP); world K x D x T = {k} x {d} x {t} = {k * d * t} "
        "processes"
    )


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
    t = getattr(args, "tensor_parallel", None) or 1
    params = sum(r.params for r in result.ranks)
    per_rank = " per tensor rank" if t > 1 else ""
    print(
        f"{heading}, {params / 1e6:,.1f} M parameters{per_rank} "
        f"({args.dtype}); {args.stages} stages, {cut}, "
        f"{args.schedule}, {args.chunks} micro-batches of {_rows(args)} sequences, "
        f"checkpoint {args.checkpoint}, {_states(result)}"
    )
    tensor = _tensor_line(args, t)
    if tensor is not None:
        print(tensor)
    replicated, sharded = result.data_parallel > 1, result.shard is not None
    message = "reduce-scatter" if sharded else "all-reduce"
    header = [
        "rank" if t == 1 else "stage rank",
        "layers" if starts is None else "stages begin at",
        "parameters" if t == 1 else "parameters/rank",
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
    args: argparse.Namespace,
    found: Search,
    costs: LayerCosts,
    memory: int,
    tensor_choice: tuple[dict[int, Search | str], str] | None = None,
) -> None:
    """The fastest configurations that fit, as ``--top`` rows; with replicas, a column says
    which ones shard their states to fit; ``tensor_choice`` (each T tried, what it found,
    and the bound of the T tried): why T is what it is, above the table."""
    shown = found.fitting[: args.top or 5]
    replicas = f" over {args.data_parallel} replicas" if args.data_parallel > 1 else ""
    print(
        f"gpt: blocks {args.n_layer}, d_model {args.d_model}, {args.model_params / 1e6:,.1f} M "
        f"parameters ({args.dtype}); {args.batch_size} sequences per step{replicas}, "
        f"{args.optimizer}, {format_bytes(memory)} per process"
    )
    print(f"{found.fits} of {found.searched} configurations fit ({_bounds(found)})")
    tensor = any(c.tensor_parallel > 1 for c in found.ranked)
    messages = "tensor collectives counted, pipeline messages free" if tensor else "messages free"
    print(f"time: {costs.source}, backward 2 x forward, {messages}")
    if tensor_choice is not None:
        _tensor_choice(found.fitting[0], *tensor_choice)
    timed = costs.unit == "s"
    best = shown[0].step_time
    time = "step time" if timed else "relative time"
    shard = ["shard"] if args.data_parallel > 1 else []
    header = [
        "stages",
        *(["T"] if tensor else []),
        "chunks",
        "schedule",
        "checkpoint",
        *shard,
        time,
        "bubble",
        "peak memory",
        "fits",
    ]
    rows = [_row(c, best, timed, memory, bool(shard), tensor) for c in shown]
    names = {2, 3, 4} if shard else {2, 3}
    _table(header, rows, frozenset(n + tensor for n in names))  # names aligned left
    print(f"fastest: {shown[0].options()}")


def _row(
    c: Candidate, best: float, timed: bool, memory: int, replicas: bool, tensor: bool
) -> list[str]:
    schedule = c.schedule if c.virtual_stages == 1 else f"{c.schedule} v={c.virtual_stages}"
    shard = [c.shard or "none"] if replicas else []
    return [
        str(c.stages),
        *([str(c.tensor_parallel)] if tensor else []),
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


def _tensor_choice(chosen: Candidate, tried: dict[int, Search | str], bound: str) -> None:
    """Why ``--suggest`` chose its T: each T's fastest configuration that fits beside the
    chosen one's, or why it had none; T is ranks per stage, memory per rank."""
    ts = ", ".join(str(t) for t in tried)
    print(
        f"tensor parallel: tried T = {ts} ({bound}); chose T={chosen.tensor_parallel}, the "
        "fastest configuration that fits"
    )
    for t, found in tried.items():
        if isinstance(found, str):
            print(f"  T={t}: not possible: {found}")
        elif not found.fitting:
            least = found.least
            smallest = "" if least is None else f" (least {format_bytes(least.peak_bytes)})"
            print(f"  T={t}: nothing fits{smallest}")
        else:
            fastest = found.fitting[0]
            print(
                f"  T={t}: fastest fitting {fastest.step_time / chosen.step_time:.2f} x the "
                f"chosen time, peak {format_bytes(fastest.peak_bytes)} per rank "
                f"({fastest.options()})"
            )
