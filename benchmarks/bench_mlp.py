"""GPipe step time against its honest ideal and against PyTorch's ScheduleGPipe, side by side.

Workload: 8 blocks of Linear(1024, 4096) -> GELU -> Linear(4096, 1024), batch 1024, MSE,
K = 2 processes with one thread each, 8 micro-batches, no re-materialization.

Contenders, in one pair of processes, one step each in turn (rotating the order every cycle),
so that drifts of the machine hit all alike:
  gpipe      gpipe.Pipeline, stages [4, 4]
  torch      torch.distributed.pipelining.ScheduleGPipe on the same split
  at_once    "stages at once": each process runs only its own stage's blocks forward and
             backward over the same 8 micro-batches, at the same time, with no communication
  lone       the whole model accumulated over 8 micro-batches on rank 0 while rank 1 waits

ideal = slowest at_once process x (M + K - 1) / M; naive ideal = lone x (M + K - 1) / (M K).

    python -m benchmarks.bench_mlp            # full run (~5 min), writes results/mlp.json
    python -m benchmarks.bench_mlp --quick    # width 64: where the fixed cost per action shows
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from time import perf_counter

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.functional import mse_loss

from gpipe import Pipeline, launch
from gpipe.schedules import gpipe as gpipe_schedule

from .common import machine, summary, write_results

K = 2
CONTENDERS = ("gpipe", "torch", "at_once", "lone")


def _model(width: int, hidden: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(blocks)
        ]
    )


def _data(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def _own_blocks(model: nn.Sequential) -> nn.Sequential:
    rank, per = dist.get_rank(), len(model) // K
    return model[rank * per : (rank + 1) * per]


def _gpipe(cfg: dict, x: Tensor, y: Tensor) -> Callable[[], None]:
    model = _model(cfg["width"], cfg["hidden"], cfg["blocks"])
    per = cfg["blocks"] // K
    pipe = Pipeline(model, [per] * K, chunks=cfg["chunks"], checkpoint="never", loss_fn=mse_loss)

    def step() -> None:
        pipe.zero_grad()
        pipe.step(x, y)

    return step


def _torch(cfg: dict, x: Tensor, y: Tensor) -> Callable[[], None]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    part = _own_blocks(_model(cfg["width"], cfg["hidden"], cfg["blocks"]))
    rank = dist.get_rank()
    stage = PipelineStage(part, rank, K, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, cfg["chunks"], loss_fn=mse_loss)

    def step() -> None:
        part.zero_grad()
        if rank == 0:
            schedule.step(x, return_outputs=False)
        else:
            schedule.step(target=y, losses=[], return_outputs=False)

    return step


def _at_once(cfg: dict, x: Tensor, y: Tensor) -> Callable[[], None]:
    part = _own_blocks(_model(cfg["width"], cfg["hidden"], cfg["blocks"]))
    last = dist.get_rank() == K - 1
    xs, ys = x.chunk(cfg["chunks"]), y.chunk(cfg["chunks"])
    grad = torch.randn_like(xs[0])

    def step() -> None:
        part.zero_grad()
        for xm, ym in zip(xs, ys, strict=True):
            h = xm.detach().requires_grad_(last)  # a later stage also returns input grads
            out = part(h)
            if last:
                (mse_loss(out, ym) / len(xs)).backward()
            else:
                out.backward(grad)

    return step


def _lone(cfg: dict, x: Tensor, y: Tensor) -> Callable[[], None]:
    """The whole model on rank 0; the other ranks wait at the barrier, idle."""
    model = _model(cfg["width"], cfg["hidden"], cfg["blocks"])
    chunks = cfg["chunks"]

    def step() -> None:
        if dist.get_rank() != 0:
            return
        model.zero_grad()
        for xm, ym in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
            (mse_loss(model(xm), ym) / chunks).backward()

    return step


BUILDERS = {"gpipe": _gpipe, "torch": _torch, "at_once": _at_once, "lone": _lone}


def run(cfg: dict) -> dict[str, list[float]]:
    """In one pair of processes, every contender in turn, one step at a time, so that drifts
    of the machine hit all alike. Returns each contender's seconds per step on this rank."""
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    x, y = _data(cfg["rows"], cfg["width"])
    steps = {name: build(cfg, x, y) for name, build in BUILDERS.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for cycle in range(cfg["warmup"] + cfg["steps"]):
        order = list(steps)[cycle % 4 :] + list(steps)[: cycle % 4]
        for name in order:
            dist.barrier()
            start = perf_counter()
            steps[name]()
            if name != "lone":
                dist.barrier()
            if cycle >= cfg["warmup"]:
                times[name].append(perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="measured steps per contender")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="width 64, batch 64: fixed costs")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--hidden", type=int, help="default 4 x width")
    parser.add_argument("--rows", type=int, default=1024, help="mini-batch rows")
    args = parser.parse_args()
    cfg = {
        "width": args.width,
        "hidden": args.hidden or 4 * args.width,
        "blocks": 8,
        "rows": args.rows,
        "chunks": 8,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
    }
    if args.quick:
        cfg |= {"width": 64, "hidden": 256, "rows": 64}
    per_rank = launch(run, K, (cfg,), threads=cfg["threads"])
    # a step takes as long as its slowest process; "lone" is rank 0's alone
    times = {
        name: [max(ts) for ts in zip(*(r[name] for r in per_rank.values()), strict=True)]
        for name in CONTENDERS
    }
    times["lone"] = per_rank[0]["lone"]
    cycles = [{name: times[name][i] for name in CONTENDERS} for i in range(cfg["steps"])]
    for name in CONTENDERS:
        print(f"  {name:8s} {statistics.median(times[name]) * 1e3:9.1f} ms/step", flush=True)

    stats = {name: summary(times[name]) for name in CONTENDERS}
    m = cfg["chunks"]
    med = {name: stats[name]["median"] for name in CONTENDERS}
    ideal = med["at_once"] * (m + K - 1) / m
    naive = med["lone"] * (m + K - 1) / (m * K)
    actions = len(gpipe_schedule(K, m).programs[0])

    def per_cycle(ratio: Callable[[dict[str, float]], float]) -> dict[str, float]:
        return summary([ratio(c) for c in cycles])

    report = {
        "workload": cfg,
        "machine": machine(),
        "seconds_per_step": stats,
        "ideal": ideal,
        "naive_ideal": naive,
        "gpipe_over_ideal": med["gpipe"] / ideal,
        "gpipe_over_naive_ideal": med["gpipe"] / naive,
        "gpipe_over_torch": med["gpipe"] / med["torch"],
        "contention": med["at_once"] / (med["lone"] / K),
        "overhead_us_per_action": (med["gpipe"] - ideal) / actions * 1e6,
        "actions_per_rank": actions,
        # the same ratios within each cycle of consecutive steps
        "per_cycle": {
            "gpipe_over_ideal": per_cycle(lambda c: c["gpipe"] / (c["at_once"] * (m + K - 1) / m)),
            "gpipe_over_torch": per_cycle(lambda c: c["gpipe"] / c["torch"]),
        },
        "cycles": cycles,
    }
    name = "mlp-quick" if args.quick else f"mlp-w{cfg['width']}-b{cfg['rows']}"
    path = write_results(name, report)
    figures = {k: v for k, v in report.items() if k not in ("workload", "machine", "cycles")}
    print(json.dumps(figures, indent=1))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
