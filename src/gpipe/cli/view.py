"""``gpipe view``: write the page that plays a schedule through its stages, offline, and print
where it is."""

from __future__ import annotations

import argparse
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
from gpipe.runtime.recompute import CHECKPOINT_MODES
from gpipe.schedules import SCHEDULES, Schedule, from_csv
from gpipe.view import DEFAULT_COSTS, Settings, check_settings, write

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "view",
        help="write an interactive page that plays a schedule, offline",
        description="Write one self-contained HTML page that plays micro-batches through the "
        "pipeline stages as gpipe's schedules and simulator say, with controls for K, M, the "
        "schedule, the checkpoint mode and the cost model, and read-outs of makespan, bubble "
        "and memory. It needs no network. Default costs: forward, backward and weight 1 per "
        "rank, 4 MiB messages, 64 MiB of activations per micro-batch.",
    )
    p.add_argument("--stages", type=int, metavar="K", help="ranks (default 4)")
    p.add_argument(
        "--chunks",
        type=int,
        metavar="M",
        help="micro-batches (default 8, or as many as --microbatch-tokens lists)",
    )
    p.add_argument("--microbatch-tokens", metavar="N,N,...", help=MICROBATCH_TOKENS_HELP)
    p.add_argument("--schedule", choices=tuple(SCHEDULES), help="default gpipe")
    p.add_argument(
        "--virtual-stages",
        type=int,
        metavar="V",
        help=f"stages per rank with --schedule {multi_stage_schedules()} (default 2; a V "
        "schedule takes 2 only)",
    )
    p.add_argument("--checkpoint", choices=CHECKPOINT_MODES, default="never", help="default never")
    p.add_argument(
        "--costs", metavar="FILE", help="JSON costs of one rank, as gpipe simulate reads them"
    )
    p.add_argument(
        "--schedule-csv",
        metavar="FILE",
        help="play the schedule of a PyTorch schedule file (as torch.distributed.pipelining "
        "writes them), checked first; it fixes K, M and the stages' ranks, so --stages, "
        "--schedule and --virtual-stages do not go with it",
    )
    p.add_argument(
        "--out", default="gpipe-view.html", metavar="FILE", help="default gpipe-view.html"
    )
    p.set_defaults(command=_view)


_DEFAULTS = {"stages": 4, "schedule": "gpipe", "virtual_stages": 2}


def _view(args: argparse.Namespace) -> int:
    fixed = None
    if args.schedule_csv is not None:
        fixed = _read_file(args)
        args.stages, args.chunks = fixed.n_ranks, fixed.n_microbatches
    for flag, default in _DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    costs = DEFAULT_COSTS if args.costs is None else read_costs(args.costs, args.stages)
    given = len(costs.microbatch_scale) or None  # a --costs file's factors set M too
    if args.microbatch_tokens is None and args.chunks is None:
        args.chunks = given
    said = (
        f"--schedule-csv {args.schedule_csv} has {{m}} micro-batches" if fixed else "--chunks {m}"
    )
    tokens = microbatch_tokens(args, said)
    costs = costs if tokens is None else costs.with_tokens(tokens)
    values = (args.stages, args.chunks, args.schedule, args.virtual_stages, args.checkpoint)
    try:
        if fixed is None:
            check_v_stages(args.schedule, args.virtual_stages)
            check_settings(*values, costs, names=PAGE_OPTIONS)
            settings = Settings(*values, costs)
        else:
            settings = Settings(args.stages, args.chunks, "gpipe", 2, args.checkpoint, costs)
        path = write(args.out, settings, fixed=fixed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"--out {args.out}: {exc.strerror or exc}") from None
    print(path.resolve())
    return 0


def _read_file(args: argparse.Namespace) -> Schedule:
    """The schedule of ``--schedule-csv``, which fixes the options that shape a schedule: one
    of them given beside it is refused rather than ignored (--chunks where it differs)."""
    given = [f"--{flag.replace('_', '-')}" for flag in _DEFAULTS if getattr(args, flag) is not None]
    if given:
        raise UsageError(
            f"--schedule-csv {args.schedule_csv} fixes the ranks, stages and schedule: drop "
            + ", ".join(given)
        )
    try:
        fixed = from_csv(args.schedule_csv)
    except ValueError as exc:
        raise UsageError(f"--schedule-csv: {exc}") from None
    if args.chunks not in (None, fixed.n_microbatches):
        raise UsageError(
            f"--chunks {args.chunks}, but --schedule-csv {args.schedule_csv} has "
            f"{fixed.n_microbatches} micro-batches"
        )
    return fixed
