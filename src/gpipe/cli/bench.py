"""``gpipe bench``: gpipe's schedules against baselines, PyTorch's pipelining and torchgpipe,
side by side in one run."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from gpipe.cli.common import UsageError
from gpipe.runtime.recompute import CHECKPOINT_MODES
from gpipe.schedules import SCHEDULES

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark gpipe against baselines, PyTorch's pipelining and torchgpipe",
        description="Time every contender on an MLP, a GPT, a ResNet and a narrow MLP in 2 "
        "processes of one thread each, one step each in turn over several cycles, for several "
        "micro-batch counts; then measure each contender's peak memory in fresh processes. "
        "Writes bench.json, bench.md and PNG plots. The full default run takes about three "
        "hours on 2 cores.",
    )
    p.add_argument(
        "--workload",
        default="mlp,gpt,cnn,mlp64",
        help="comma list of mlp, gpt, cnn, mlp64 (default all)",
    )
    p.add_argument(
        "--size",
        choices=("full", "tiny"),
        default="full",
        help="full: the documented sizes; tiny: seconds, to check that everything runs",
    )
    p.add_argument("--chunks", default="1,2,4,8,16", help="micro-batch counts (default 1,2,4,8,16)")
    p.add_argument(
        "--memory-chunks",
        type=int,
        default=8,
        metavar="M",
        help="micro-batches of the memory pass (default 8; 0 skips the memory pass)",
    )
    p.add_argument(
        "--memory-jobs",
        type=int,
        default=2,
        metavar="N",
        help="memory passes at once, each in fresh processes (default 2; 1 where memory is short)",
    )
    p.add_argument("--repeats", type=int, default=3, help="measured steps per contender")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per contender")
    p.add_argument(
        "--schedules",
        default=",".join(SCHEDULES),
        help=f"gpipe schedules (default {','.join(SCHEDULES)})",
    )
    p.add_argument(
        "--modes",
        default=",".join(CHECKPOINT_MODES),
        help=f"re-materialization modes (default {','.join(CHECKPOINT_MODES)})",
    )
    p.add_argument(
        "--skip",
        default="",
        metavar="NAMES",
        help="comma list of contenders, or prefixes such as 'pytorch' or 'gpipe/zero-bubble', "
        "to leave out",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="intra-op threads per process (default 1)"
    )
    p.add_argument(
        "--out",
        default="bench-results",
        help="folder for the report (default bench-results, in the current folder: the "
        "figures committed under benchmarks/results are not written over)",
    )
    p.add_argument("--no-plots", action="store_true", help="write no PNG (no matplotlib needed)")
    p.set_defaults(command=_bench)


def _names(flag: str, value: str, allowed: tuple[str, ...] | None) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names and allowed is not None:
        raise UsageError(f"--{flag} needs at least one of {', '.join(allowed)}")
    if allowed is not None:
        bad = [n for n in names if n not in allowed]
        if bad:
            raise UsageError(
                f"--{flag}: unknown {', '.join(map(repr, bad))}; expected {', '.join(allowed)}"
            )
    return names


def _counts(flag: str, value: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"--{flag} must be a comma list of integers, got {value!r}") from None
    if not counts or any(c < 1 for c in counts):
        raise UsageError(f"--{flag} must be positive integers, got {value!r}")
    return tuple(sorted(set(counts)))


def _bench(args: argparse.Namespace) -> int:
    from gpipe.bench.contenders import contenders
    from gpipe.bench.run import BenchOptions, matches, run_bench
    from gpipe.bench.workloads import WORKLOADS

    workloads = _names("workload", args.workload, tuple(WORKLOADS))
    schedules = _names("schedules", args.schedules, tuple(SCHEDULES))
    modes = _names("modes", args.modes, CHECKPOINT_MODES)
    chunks = _counts("chunks", args.chunks)
    for flag in ("repeats", "threads", "memory_jobs"):
        if getattr(args, flag) < 1:
            name = flag.replace("_", "-")
            raise UsageError(f"--{name} must be a positive integer, got {getattr(args, flag)}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.memory_chunks < 0:
        raise UsageError(
            f"--memory-chunks must be 0 (no memory pass) or more, got {args.memory_chunks}"
        )
    skip = _names("skip", args.skip, None)
    known = [c.name for c in contenders(schedules, modes)]
    for s in skip:
        if not any(matches(n, s) for n in known):
            raise UsageError(f"--skip: {s!r} names no contender; contenders: {', '.join(known)}")
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "plots need matplotlib: pip install 'gpipe-parallel[plot]', or pass --no-plots"
            ) from None
    try:  # now, not after hours of measuring
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {args.out}: {exc.strerror or exc}; expected a folder") from None
    options = BenchOptions(
        workloads=workloads,
        size=args.size,
        chunks=chunks,
        memory_chunks=args.memory_chunks or None,
        memory_jobs=args.memory_jobs,
        repeats=args.repeats,
        warmup=args.warmup,
        schedules=schedules,
        modes=modes,
        skip=skip,
        threads=args.threads,
        out=Path(args.out),
        plots=not args.no_plots,
        command=shlex.join(["gpipe", *sys.argv[1:]])
        if sys.argv[1:2] == ["bench"]
        else "gpipe bench",
    )
    report = run_bench(options)
    print()
    for t in report["targets"]:
        met = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        print(f"{met:>12}  {t['target']}: {t['figure']}")
    for note in report["caveats"]:
        print(f"note: {note}")
    print("written: " + ", ".join(report["files"]))
    return 0
