"""Peak activation memory of 1F1B, ZB-V, V-Half and V-Min on 2, 4 and 8 processes, and
their step times on 2.

How much a schedule holds depends only on the order of each process's actions, not on how
fast they run, so this measures on more processes than the machine has cores: each (K,
schedule) in fresh processes of one thread, one warm-up step and one step under
``ActivationMeter`` (saved tensors and layer inputs and outputs, each storage once,
parameters left out), M = 8 micro-batches, no re-materialization. The workload: 16 blocks of
Linear(256, 1024) -> GELU -> Linear(1024, 256), batch 256, MSE; 1F1B cuts it into K stages,
the V schedules into 2K. Those runs' step times mean nothing (K processes share two cores).

``--time``: the four schedules in one pair of processes of one thread each, K = 2, on
``gpipe bench``'s mlp (8 blocks of Linear(512, 2048) -> GELU -> Linear(2048, 512), batch
512), M = 8, one step each in turn, the order rotating every cycle; medians, and each
schedule's step over 1F1B's in the same cycle.

    python -m benchmarks.bench_v_memory           # a few minutes, writes results/v-memory.json
    python -m benchmarks.bench_v_memory --time --repeats 11   # results/v-time.json
    python -m benchmarks.bench_v_memory --quick   # K = 2 only
    python -m benchmarks.bench_v_memory --ks 8 --blocks 64 --results v-memory-deep
                                                  # deeper stages: 4 blocks per half-stage
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn.functional import mse_loss

from gpipe import Pipeline, launch
from gpipe.planning import closed_form_peak
from gpipe.schedules import Placement, traits

from .common import activation_peak, machine, over_baseline, steps_in_turn, write_results

SCHEDULES = ("1f1b", "zero-bubble-v", "v-half", "v-min")
BLOCKS, WIDTH, HIDDEN, ROWS, CHUNKS = 16, 256, 1024, 256, 8


def _model(blocks: int = BLOCKS, width: int = WIDTH, hidden: int = HIDDEN) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(blocks)
        ]
    )


def timed(repeats: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per step of every schedule, K = 2, taking turns in one pair of processes."""
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    pipes = {}
    for schedule in SCHEDULES:
        stages = 4 if traits(schedule).placement is Placement.V else 2
        pipes[schedule] = Pipeline(
            _model(8, 512, 2048),
            [8 // stages] * stages,
            chunks=CHUNKS,
            checkpoint="never",
            schedule=schedule,
            loss_fn=mse_loss,
        )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
    return steps_in_turn(pipes, x, y, repeats, warmup)


def run(k: int, schedule: str, blocks: int = BLOCKS) -> int:
    """This process's peak activation bytes in one step of ``schedule`` on ``k`` processes,
    the workload ``blocks`` blocks deep."""
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    stages = 2 * k if traits(schedule).placement is Placement.V else k
    if blocks % stages:
        raise ValueError(f"--blocks {blocks} must divide into {stages} stages of {schedule}")
    balance = [blocks // stages] * stages
    pipe = Pipeline(
        _model(blocks),
        balance,
        chunks=CHUNKS,
        checkpoint="never",
        schedule=schedule,
        loss_fn=mse_loss,
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)
    return activation_peak(pipe, x, y)


def _time(repeats: int) -> None:
    seconds = launch(timed, 2, (repeats, 1), threads=1)[0]
    report: dict = {"machine": machine(), "repeats": repeats, "schedules": {}}
    for schedule, (times, ratios) in over_baseline(seconds, "1f1b", "1F1B").items():
        report["schedules"][schedule] = {"seconds": times, "over_1f1b_per_cycle": ratios}
    print(f"written to {write_results('v-time', report)}")


def _own(peaks: list[int], schedule: str) -> list[int]:
    """Each process's peak without the mini-batch's input and target, which the processes of
    the first and the last stage read whole (both the first process's in a V)."""
    batch = ROWS * WIDTH * 4  # float32 bytes of the input, and as many of the target
    last = 0 if traits(schedule).placement is Placement.V else len(peaks) - 1
    return [p - batch * ((r == 0) + (r == last)) for r, p in enumerate(peaks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="K = 2 only")
    parser.add_argument("--time", action="store_true", help="step times at K = 2 instead")
    parser.add_argument("--repeats", type=int, default=11, help="measured cycles of --time")
    parser.add_argument("--ks", default="2,4,8", help="process counts (default 2,4,8)")
    parser.add_argument("--blocks", type=int, default=BLOCKS, help=f"depth (default {BLOCKS})")
    parser.add_argument("--results", help="the results file's name (default v-memory)")
    args = parser.parse_args()
    if args.time:
        _time(args.repeats)
        return
    ks = (2,) if args.quick else tuple(int(k) for k in args.ks.split(","))
    report: dict = {
        "workload": dict(blocks=args.blocks, width=WIDTH, hidden=HIDDEN, rows=ROWS, chunks=CHUNKS),
        "machine": machine(),
        "peaks": {},
    }
    for k in ks:
        peaks = {}
        for schedule in SCHEDULES:
            per_rank = launch(run, k, (k, schedule, args.blocks), threads=1)
            peaks[schedule] = [per_rank[r] for r in range(k)]
        base = max(peaks["1f1b"])
        base_own = max(_own(peaks["1f1b"], "1f1b"))
        for schedule in SCHEDULES:
            busiest, own = max(peaks[schedule]), max(_own(peaks[schedule], schedule))
            formula = closed_form_peak(schedule, k, CHUNKS, 2 if schedule != "1f1b" else 1)
            report["peaks"][f"K={k}/{schedule}"] = {
                "per_process_mib": [p / 2**20 for p in peaks[schedule]],
                "busiest_over_1f1b": busiest / base,
                "without_the_mini_batch_per_process_mib": [
                    p / 2**20 for p in _own(peaks[schedule], schedule)
                ],
                "without_the_mini_batch_busiest_over_1f1b": own / base_own,
                "closed_form_busiest_over_1f1b": None
                if formula is None
                else max(formula) / min(CHUNKS, k),
            }
            print(
                f"K={k} {schedule:14s} busiest {busiest / 2**20:5.2f} MiB = {busiest / base:.3f}"
                f" x 1F1B's, without the mini-batch {own / base_own:.3f}; per process "
                + ", ".join(f"{p / 2**20:.2f}" for p in peaks[schedule]),
                flush=True,
            )
    path = write_results(args.results or ("v-memory-quick" if args.quick else "v-memory"), report)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
