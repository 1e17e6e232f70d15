"""GPipe step time against its honest ideal and against PyTorch's ScheduleGPipe, side by side.

Workload: 8 blocks of Linear(1024, 4096) -> GELU -> Linear(4096, 1024), batch 1024, MSE,
K = 2 processes with one thread each, 8 micro-batches, no re-materialization.

Contenders, launched in turn within every round so that drifts of the machine hit all alike:
  gpipe      gpipe.Pipeline, stages [4, 4]
  torch      torch.distributed.pipelining.ScheduleGPipe on the same split
  at_once    "stages at once": each process runs only its own stage's blocks forward and
             backward over the same 8 micro-batches, at the same time, with no communication
  lone       the whole model accumulated over 8 micro-batches in one process, alone

ideal = slowest at_once process x (M + K - 1) / M; naive ideal = lone x (M + K - 1) / (M K).

    python -m benchmarks.bench_mlp            # full run, writes benchmarks/results/mlp.json
    python -m benchmarks.bench_mlp --quick    # small sizes, to check that it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
from time import perf_counter

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import mse_loss

from gpipe import Pipeline, launch
from gpipe.schedule import gpipe as gpipe_schedule

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


def _timed(steps: int, warmup: int, step, *, barrier: bool) -> list[float]:
    """Seconds per step after ``warmup`` steps; processes start each step together."""
    times = []
    for i in range(warmup + steps):
        if barrier:
            dist.barrier()
        start = perf_counter()
        step()
        if barrier:
            dist.barrier()
        if i >= warmup:
            times.append(perf_counter() - start)
    return times


def _own_blocks(model: nn.Sequential) -> nn.Sequential:
    rank, per = dist.get_rank(), len(model) // K
    return model[rank * per : (rank + 1) * per]


def run_gpipe(cfg: dict) -> list[float]:
    model = _model(cfg["width"], cfg["hidden"], cfg["blocks"])
    per = cfg["blocks"] // K
    pipe = Pipeline(model, [per] * K, chunks=cfg["chunks"], checkpoint="never", loss_fn=mse_loss)
    x, y = _data(cfg["rows"], cfg["width"])

    def step():
        pipe.zero_grad()
        pipe.step(x, y)

    return _timed(cfg["steps"], cfg["warmup"], step, barrier=True)


def run_torch(cfg: dict) -> list[float]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo")
    part = _own_blocks(_model(cfg["width"], cfg["hidden"], cfg["blocks"]))
    rank = dist.get_rank()
    stage = PipelineStage(part, rank, K, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, cfg["chunks"], loss_fn=mse_loss)
    x, y = _data(cfg["rows"], cfg["width"])

    def step():
        part.zero_grad()
        if rank == 0:
            schedule.step(x, return_outputs=False)
        else:
            schedule.step(target=y, losses=[], return_outputs=False)

    return _timed(cfg["steps"], cfg["warmup"], step, barrier=True)


def run_at_once(cfg: dict) -> list[float]:
    dist.init_process_group("gloo")
    part = _own_blocks(_model(cfg["width"], cfg["hidden"], cfg["blocks"]))
    last = dist.get_rank() == K - 1
    x, y = _data(cfg["rows"], cfg["width"])
    xs, ys = x.chunk(cfg["chunks"]), y.chunk(cfg["chunks"])
    grad = torch.randn_like(xs[0])

    def step():
        part.zero_grad()
        for xm, ym in zip(xs, ys, strict=True):
            h = xm.detach().requires_grad_(last)  # a later stage also returns input grads
            out = part(h)
            if last:
                (mse_loss(out, ym) / len(xs)).backward()
            else:
                out.backward(grad)

    return _timed(cfg["steps"], cfg["warmup"], step, barrier=True)


def run_lone(cfg: dict) -> list[float]:
    model = _model(cfg["width"], cfg["hidden"], cfg["blocks"])
    x, y = _data(cfg["rows"], cfg["width"])
    chunks = cfg["chunks"]

    def step():
        model.zero_grad()
        for xm, ym in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
            (mse_loss(model(xm), ym) / chunks).backward()

    return _timed(cfg["steps"], cfg["warmup"], step, barrier=False)


RUNNERS = {"gpipe": run_gpipe, "torch": run_torch, "at_once": run_at_once, "lone": run_lone}


def _round(cfg: dict, order: list[str]) -> dict[str, float]:
    """One launch per contender; a step's time is that of its slowest process."""
    medians = {}
    for name in order:
        nprocs = 1 if name == "lone" else K
        per_rank = launch(RUNNERS[name], nprocs, (cfg,), threads=cfg["threads"])
        steps = [max(times) for times in zip(*per_rank.values(), strict=True)]
        medians[name] = statistics.median(steps)
        print(f"  {name:8s} {medians[name] * 1e3:9.1f} ms/step", flush=True)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="small sizes, to check it runs")
    args = parser.parse_args()
    cfg = {
        "width": 1024,
        "hidden": 4096,
        "blocks": 8,
        "rows": 1024,
        "chunks": 8,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
    }
    if args.quick:
        cfg |= {"width": 64, "hidden": 256, "rows": 64, "steps": 3, "warmup": 1}
        args.rounds = 1
    rounds = []
    for r in range(args.rounds):
        order = list(CONTENDERS[r % 4 :] + CONTENDERS[: r % 4])
        print(f"round {r + 1}/{args.rounds}", flush=True)
        rounds.append(_round(cfg, order))

    stats = {name: summary([r[name] for r in rounds]) for name in CONTENDERS}
    m = cfg["chunks"]
    med = {name: stats[name]["median"] for name in CONTENDERS}
    ideal = med["at_once"] * (m + K - 1) / m
    naive = med["lone"] * (m + K - 1) / (m * K)
    actions = len(gpipe_schedule(K, m).programs[0])
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
    }
    name = "mlp-quick" if args.quick else "mlp"
    path = write_results(name, report)
    figures = {k: v for k, v in report.items() if k not in ("workload", "machine")}
    print(json.dumps(figures, indent=1))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
