"""What every benchmark shares: a description of the machine, summary statistics, results."""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from gpipe import Pipeline
from gpipe.bench import machine, summary
from gpipe.planning import ActivationMeter

__all__ = [
    "RESULTS",
    "machine",
    "over_baseline",
    "steps_in_turn",
    "summary",
    "timed_step",
    "world_of_one",
    "write_results",
]

RESULTS = Path(__file__).parent / "results"


def world_of_one() -> None:
    """torchrun's variables for a world of this one process (a free local port), so that a
    ``Pipeline`` whose stages all live here joins it by itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def quick_or_repeats(description: str, repeats: int) -> argparse.Namespace:
    """The options the GPT benchmarks share: ``--quick`` and ``--repeats`` (3 when quick)."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, to check it runs")
    parser.add_argument("--repeats", type=int, default=repeats)
    args = parser.parse_args()
    if args.quick:
        args.repeats = 3
    return args


def gpt_model(quick: bool) -> dict[str, Any]:
    """The GPT the scaling, data-parallel and Layers benchmarks share (``GPTConfig``
    fields); ``quick``, a tiny one to check that a script runs."""
    if quick:
        return {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16, "dropout": 0.0}
    return {"n_layer": 8, "d_model": 256, "n_head": 4, "seq_len": 256, "dropout": 0.0}


def timed_step(pipe: Pipeline, x: Any, y: Any) -> float:
    """Seconds of one ``pipe.step`` started together on every rank: the slowest rank's."""
    pipe.zero_grad()
    dist.barrier()
    start = perf_counter()
    pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    took = torch.tensor([perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def activation_peak(pipe: Pipeline, x: Any, y: Any) -> int:
    """Peak activation bytes of this rank in one step of ``pipe`` (``ActivationMeter``), after
    one step to warm up: what a fresh process holds in its steady state."""
    inputs, targets = (x if pipe.is_first else None), (y if pipe.is_last else None)
    pipe.step(inputs, targets)
    pipe.zero_grad()
    with ActivationMeter(pipe) as meter:
        pipe.step(inputs, targets)
    return int(meter.peak)


def steps_in_turn(
    pipes: dict[str, Pipeline], x: Any, y: Any, repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds per step of each pipeline, one step each in turn, the order rotating every
    cycle, the first ``warmup`` cycles left out."""
    names = list(pipes)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for cycle in range(warmup + repeats):
        turn = cycle % len(names)
        for name in names[turn:] + names[:turn]:
            took = timed_step(pipes[name], x, y)
            if cycle >= warmup:
                seconds[name].append(took)
    return seconds


def over_baseline(
    seconds: dict[str, list[float]], baseline: str, label: str
) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
    """Each contender's seconds and its per-cycle ratio over ``baseline``'s (summaries), each
    printed on one line (``label`` names the baseline there)."""
    found = {}
    for name, times in seconds.items():
        ratios = [a / b for a, b in zip(times, seconds[baseline], strict=True)]
        found[name] = (summary(times), summary(ratios))
        print(
            f"{name:14s} {summary(times)['median']:.3f} s/step, over {label}'s per cycle "
            f"{summary(ratios)['median']:.3f} ({min(ratios):.3f} to {max(ratios):.3f})",
            flush=True,
        )
    return found


def write_results(name: str, results: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path
