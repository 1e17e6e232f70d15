"""Starting processes with ``gpipe.launch``: spawn against forkserver, side by side.

Each cycle launches 2 processes that join a gloo group and return, once per start method in
alternating order, from a caller that has already run torch work (as a test or a notebook
has). The forkserver starts at the first forkserver launch, which is left out of the cycles
as a warm-up. Reported: per-method medians of wall seconds per launch, the per-cycle ratio
forkserver / spawn and its median, and the CPU seconds of the launched processes (their own
user + system time, read from inside them, so a forkserver's relay is not counted twice).

    python -m benchmarks.bench_launch               # 9 cycles, about half a minute
    python -m benchmarks.bench_launch --quick       # 3 cycles, to check that it runs
"""

from __future__ import annotations

import resource
import statistics
from time import perf_counter

import torch
import torch.distributed as dist

from gpipe import launch
from gpipe.comm import init_process_group

from .common import machine, quick_or_repeats, write_results

METHODS = ("spawn", "forkserver")


def joined() -> float:
    """What a launched process does: join the group, agree, and report its CPU seconds."""
    init_process_group(torch.device("cpu"), 60.0)
    dist.barrier()
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def _once(method: str) -> tuple[float, float]:
    start = perf_counter()
    cpu = launch(joined, 2, threads=1, start_method=method)
    return perf_counter() - start, sum(cpu.values())


def main() -> None:
    args = quick_or_repeats(__doc__, repeats=9)
    torch.ones(256, 256) @ torch.ones(256, 256)  # the caller has run torch work
    _once("forkserver")  # the server starts and imports torch and gpipe: not a cycle
    wall: dict[str, list[float]] = {m: [] for m in METHODS}
    cpu: dict[str, list[float]] = {m: [] for m in METHODS}
    for cycle in range(args.repeats):
        order = METHODS if cycle % 2 == 0 else METHODS[::-1]
        for method in order:
            seconds, used = _once(method)
            wall[method].append(seconds)
            cpu[method].append(used)
    ratios = [f / s for f, s in zip(wall["forkserver"], wall["spawn"], strict=True)]
    results = {
        "command": "python -m benchmarks.bench_launch" + (" --quick" if args.quick else ""),
        "machine": machine(),
        "cycles": args.repeats,
        "wall_s": {m: {"median": statistics.median(v), "all": v} for m, v in wall.items()},
        "cpu_s_of_launched": {m: statistics.median(v) for m, v in cpu.items()},
        "forkserver_over_spawn": {"median": statistics.median(ratios), "all": ratios},
    }
    for method in METHODS:
        print(
            f"{method:>10}: {results['wall_s'][method]['median']:.3f} s per launch of 2, "
            f"{results['cpu_s_of_launched'][method]:.2f} CPU s in the launched processes"
        )
    print(f"forkserver / spawn per cycle: median {results['forkserver_over_spawn']['median']:.3f}")
    if not args.quick:
        print(f"written to {write_results('launch', results)}")


if __name__ == "__main__":
    main()
