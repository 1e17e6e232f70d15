"""``gpipe simulate``: schedules' predicted time, bubble and memory, compared without running."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from gpipe.cli.common import (
    MICROBATCH_TOKENS_HELP,
    PAGE_OPTIONS,
    UsageError,
    check_v_stages,
    microbatch_tokens,
    multi_stage_schedules,
    read_costs,
)
from gpipe.cli.plan_tensor import add_link_argument, link_of
from gpipe.cli.seq_chunk_flags import add_seq_chunks_argument, check_simulable
from gpipe.cli.simulate_output import figure_class, plot, table
from gpipe.errors import counted
from gpipe.planning.bubbles import split_costs
from gpipe.planning.simulate import Costs, compare, scenario, simulate
from gpipe.schedules import SCHEDULES, Placement, build, from_csv, get_schedule, to_csv, traits
from gpipe.view import Settings, check_settings
from gpipe.view import write as write_page

__all__ = ["add_parser"]

# One unit of compute per forward, per input-gradient backward and per weight-gradient
# backward: a whole backward then costs twice a forward, as it roughly does in practice.
DEFAULT_COSTS = Costs(forward=1.0, backward=1.0, weight=1.0)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="compare schedules' predicted time and memory",
        description="Simulate pipeline schedules under a cost model and print their makespan, "
        "bubble (idle share of all ranks' time) and peak number of live micro-batches per "
        "stage. Default costs: forward 1, backward 1 and weight 1 per stage, so an unsplit "
        "backward takes 2; no communication cost.",
    )
    p.add_argument("--stages", type=int, metavar="K", help="pipeline stages (default 4)")
    p.add_argument(
        "--chunks",
        type=int,
        default=None,
        metavar="M",
        help="micro-batches per step (default 8, or as many as --microbatch-tokens lists)",
    )
    p.add_argument(
        "--microbatch-tokens",
        metavar="N,N,...",
        help=MICROBATCH_TOKENS_HELP,
    )
    p.add_argument(
        "--schedule",
        action="append",
        metavar="NAME",
        help="schedule to simulate, repeatable or a comma list (default: all of "
        f"{', '.join(SCHEDULES)})",
    )
    p.add_argument(
        "--costs",
        metavar="FILE",
        help='JSON costs, e.g. {"forward": [1, 2], "backward": 2, "weight": 1, '
        '"latency": 0.1, "message_bytes": 1e6, "bandwidth": 1e9, "activation_bytes": 1e8}',
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        metavar="V",
        help=f"stages per rank for the {multi_stage_schedules()} schedule, each with 1/V of "
        "the rank's costs (default 2; a V schedule takes 2 only)",
    )
    add_seq_chunks_argument(
        p, "each costs, holds and sends 1/S of it; peaks count micro-batches' worth of them"
    )
    _add_replica_arguments(p)
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="T",
        help="ranks per stage: forward, backward, weight and grad_bytes split over them, "
        "and each F and B waits for --tp-allreduces all-reduces of message_bytes (the "
        "stage's boundary tensor) on --tp-link; activation_bytes kept whole (an upper "
        "bound); the world K x D x T (default 1)",
    )
    p.add_argument(
        "--tp-allreduces",
        type=int,
        metavar="N",
        help="with --tensor-parallel: all-reduces per stage per forward and per backward "
        "(default 2, one transformer block's)",
    )
    add_link_argument(p)
    p.add_argument(
        "--schedule-csv",
        metavar="FILE",
        help="simulate the schedule in a PyTorch schedule file (torch.distributed.pipelining's "
        "_dump_csv format: one row per rank) instead of named ones; its ranks, stages and "
        "micro-batches are read off the file, so --stages, --chunks, --virtual-stages and "
        "--data-parallel do not go with it",
    )
    p.add_argument(
        "--dump-csv",
        metavar="FILE",
        help="write the one --schedule named, at --stages and --chunks, as a PyTorch schedule "
        "file (compute actions only)",
    )
    p.add_argument("--plot", metavar="PNG", help="also draw each schedule's predicted timeline")
    p.add_argument(
        "--html",
        metavar="FILE",
        help="also write the interactive page (as gpipe view) for this case, starting on the "
        "first schedule named",
    )
    p.set_defaults(command=_simulate)


def _add_replica_arguments(p: Any) -> None:
    """--data-parallel, and how its replicas keep their states."""
    p.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        metavar="D",
        help="replicas of the pipeline: adds each stage's gradient all-reduce (the costs' "
        "grad_bytes over allreduce_bandwidth, in the runtime's buckets, each started as the "
        "last backward completes it) (default 1)",
    )
    p.add_argument(
        "--shard",
        choices=("none", "optimizer", "gradients", "full"),
        default="none",
        help="with --data-parallel: split the replicas' states (Pipeline's shard=); full "
        "all-gathers each stage's parameters (grad_bytes of them) at its first action and "
        "reduce-scatters its gradients in place of the all-reduce; optimizer and gradients "
        "reduce-scatter, then all-gather the updated parameters (default none)",
    )
    p.add_argument(
        "--reshard-after-forward",
        action="store_true",
        help="with --shard full: gather the parameters again for every compute action",
    )


def _simulate(args: argparse.Namespace) -> int:
    if args.schedule_csv is not None:
        _check_file_flags(args)
    args.stages = 4 if args.stages is None else args.stages
    v_given = args.virtual_stages is not None
    args.virtual_stages = 2 if args.virtual_stages is None else args.virtual_stages
    tokens = microbatch_tokens(args)
    for flag in ("stages", "chunks", "virtual_stages", "data_parallel"):
        if getattr(args, flag) < 1:
            raise UsageError(
                f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}"
            )
    shard = _shard(args)
    check_simulable(args)
    if args.schedule_csv is not None:
        return _simulate_file(args)
    names = _schedule_names(args.schedule)
    # --virtual-stages is the looped schedules'; where none is among those named (all of
    # them are, when none is named), a V, which keeps 2, is asked for another count in vain
    if not any(traits(name).placement is Placement.LOOPED for name in names):
        for name in names:
            check_v_stages(name, args.virtual_stages)
    several = v_given and args.virtual_stages > 1  # 1 is what one-stage schedules run
    if several and not any(traits(name).several_stages_per_rank for name in names):
        raise UsageError(
            f"--virtual-stages {args.virtual_stages}: --schedule {','.join(names)} places one "
            f"stage per process; --virtual-stages is for {multi_stage_schedules()}"
        )
    costs = DEFAULT_COSTS if args.costs is None else read_costs(args.costs, args.stages)
    costs = costs if tokens is None else costs.with_tokens(tokens)
    costs, tensor = _tensor_costs(args, costs)
    if args.dump_csv is not None:
        _dump(args, names)
    if args.plot is not None:
        figure_class()  # fail before simulating, not after
    page = None if args.html is None else _page_settings(args, names[0], costs)
    rows = compare(
        names,
        args.stages,
        args.chunks,
        costs,
        args.virtual_stages,
        args.data_parallel,
        shard,
        args.reshard_after_forward,
        args.seq_chunks,
    )
    _check_any_simulated(rows)
    source = args.costs or "default: forward 1, backward 1, weight 1 per stage"
    replicas = f", {args.data_parallel} replicas" if args.data_parallel > 1 else ""
    replicas += f" sharded {shard}" if shard else ""
    sizes = "" if tokens is None else f" of {args.microbatch_tokens} tokens"
    sizes += f", each as {args.seq_chunks} sub-sequences" if args.seq_chunks > 1 else ""
    counts = f"{counted(args.stages, 'stage')}, {counted(args.chunks, 'micro-batch', 'es')}"
    print(f"{counts}{sizes}{replicas}, costs {source}")
    if tensor:
        print(tensor)
    print(table(rows, args.stages, args.chunks, costs, args.data_parallel > 1, shard))
    if args.plot is not None:
        results = [
            simulate(
                *scenario(
                    row["schedule"],
                    args.stages,
                    args.chunks,
                    costs,
                    args.virtual_stages,
                    args.seq_chunks,
                )
            )
            for row in rows
            if "note" not in row
        ]
        plot(results, args.plot)
        print(f"timelines: {args.plot}")
    if page is not None:
        try:
            print(f"page: {write_page(args.html, page)}")
        except OSError as exc:
            raise UsageError(f"--html {args.html}: {exc.strerror or exc}") from None
    return 0


def _check_file_flags(args: argparse.Namespace) -> None:
    """A schedule file fixes the shape: a flag that would set it is refused, not ignored."""
    given = [
        f"--{flag.replace('_', '-')}"
        for flag in ("stages", "chunks", "virtual_stages")
        if getattr(args, flag) is not None
    ]
    given += ["--data-parallel"] if args.data_parallel != 1 else []
    if given:
        raise UsageError(
            f"--schedule-csv {args.schedule_csv} fixes the ranks, stages and micro-batches "
            "(and simulates one replica): drop " + ", ".join(given)
        )


def _check_any_simulated(rows: list[dict[str, Any]]) -> None:
    """A table of skipped schedules alone simulated nothing: say why, as a usage error, rather
    than print it and exit 0 (some skipped beside others simulated are noted in the table)."""
    if all("note" in row for row in rows):
        reasons = (f"--schedule {row['schedule']}: {_reason(row['note'])}" for row in rows)
        raise UsageError("; ".join(reasons))


def _reason(note: str) -> str:
    """Why ``compare`` skipped a schedule, without the table's ``skipped:``."""
    return note.removeprefix("skipped: ")


def _tensor_costs(args: argparse.Namespace, costs: Costs) -> tuple[Costs, str]:
    """``costs`` of one rank of T per stage, and a line that says so (empty without)."""
    t, allreduces = args.tensor_parallel, args.tp_allreduces
    if t < 1:
        raise UsageError(f"--tensor-parallel must be a positive integer, got {t}")
    if allreduces is not None and allreduces < 0:
        raise UsageError(f"--tp-allreduces must be at least 0, got {allreduces}")
    if t == 1:
        if args.tp_link is not None:
            raise UsageError("--tp-link is the link of --tensor-parallel T's ranks: give T > 1")
        if allreduces is not None:
            raise UsageError(
                f"--tp-allreduces {allreduces} counts the all-reduces of --tensor-parallel T's "
                "ranks: give T > 1"
            )
        return costs, ""
    allreduces = 2 if allreduces is None else allreduces
    if args.schedule_csv is not None or args.html is not None:
        raise UsageError("--tensor-parallel: the page and --schedule-csv play T = 1; drop it")
    device, link = link_of(args, t)
    # seconds only where the costs are (a message's size says so): unit costs stay unit
    sized = costs.message_bytes > 0
    comm = allreduces * link.ring(costs.message_bytes, t, passes=2) if sized else 0.0
    k = args.stages

    def split(name: str, extra: float = 0.0) -> list[float]:
        return [v / t + extra for v in costs.per_stage(name, k)]

    scaled = dataclasses.replace(
        costs,
        forward=split("forward", comm),
        backward=split("backward", comm),
        weight=split("weight"),
        recompute=split("recompute"),
        grad_bytes=split("grad_bytes"),
    )
    world = k * args.data_parallel * t
    collectives = (
        f"each F and B +{comm:.3g} s for {allreduces} all-reduces of "
        f"{costs.message_bytes:g} bytes on {device.name}'s link"
        if sized
        else "collectives free (the costs give no message_bytes)"
    )
    line = (
        f"tensor parallel T={t}: per rank, compute and grad_bytes / {t}, {collectives}; "
        f"world K x D x T = {k} x {args.data_parallel} x {t} = {world}"
    )
    return scaled, line


def _shard(args: argparse.Namespace) -> str | None:
    """``--shard``, checked against the options it needs and those it cannot go with."""
    shard = None if args.shard == "none" else args.shard
    if shard is not None and args.data_parallel < 2:
        raise UsageError(
            f"--shard {shard} splits each stage over its replicas: it needs "
            f"--data-parallel 2 or more, got {args.data_parallel}"
        )
    if args.reshard_after_forward and shard != "full":
        raise UsageError("--reshard-after-forward frees what --shard full gathers: add it")
    if shard is not None and (args.html is not None or args.schedule_csv is not None):
        raise UsageError("--shard: the page and --schedule-csv play unsharded replicas; drop it")
    return shard


def _dump(args: argparse.Namespace, names: list[str]) -> None:
    if len(names) != 1:
        raise UsageError(f"--dump-csv writes one schedule: name it with --schedule, got {names}")
    try:
        schedule = build(names[0], args.stages, args.chunks, args.virtual_stages)
        to_csv(schedule, args.dump_csv)
    except ValueError as exc:
        raise UsageError(f"--dump-csv: {exc}") from None
    except OSError as exc:
        raise UsageError(f"--dump-csv {args.dump_csv}: {exc.strerror or exc}") from None
    print(f"schedule file: {args.dump_csv}")


def _simulate_file(args: argparse.Namespace) -> int:
    """The schedule of a PyTorch schedule file, checked, simulated and drawn."""
    if args.schedule or args.dump_csv or args.html or args.microbatch_tokens:
        raise UsageError(
            "--schedule-csv simulates the file's schedule alone: drop --schedule, "
            "--dump-csv, --html and --microbatch-tokens"
        )
    try:
        schedule = from_csv(args.schedule_csv)
    except ValueError as exc:
        raise UsageError(f"--schedule-csv: {exc}") from None
    k = schedule.n_ranks
    costs = DEFAULT_COSTS if args.costs is None else read_costs(args.costs, k)
    result = simulate(schedule, split_costs(schedule, costs))
    row = {
        "schedule": schedule.name,
        "makespan": result.makespan,
        "bubble": result.bubble,
        "peak_live_per_stage": result.peak_live,
        "peak_activation_bytes": max(result.peak_rank_activation_bytes),
    }
    print(
        f"{k} ranks, {schedule.n_stages} stages, {schedule.n_microbatches} micro-batches, "
        f"costs {args.costs or 'default: forward 1, backward 1, weight 1 per rank'}"
    )
    print(table([row], k, schedule.n_microbatches, costs))
    if args.plot is not None:
        plot([result], args.plot)
        print(f"timelines: {args.plot}")
    return 0


def _page_settings(args: argparse.Namespace, schedule: str, costs: Costs) -> Settings:
    """The page's starting point for this case; refused before simulating if it cannot play it."""
    try:
        check_settings(
            args.stages,
            args.chunks,
            schedule,
            args.virtual_stages,
            "never",
            costs,
            names=PAGE_OPTIONS,
        )
    except ValueError as exc:
        raise UsageError(f"--html: {exc}") from None
    return Settings(args.stages, args.chunks, schedule, args.virtual_stages, "never", costs)


def _schedule_names(given: list[str] | None) -> list[str]:
    if not given:
        return list(SCHEDULES)
    names = [name.strip() for value in given for name in value.split(",") if name.strip()]
    for name in names:
        try:
            get_schedule(name)
        except ValueError as exc:
            raise UsageError(f"--schedule: {exc}") from None
    return list(dict.fromkeys(names))
