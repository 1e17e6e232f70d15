"""Where a pipelined step's time goes, per action kind, on each of K = 2 processes.

For every schedule, a few steps of ``gpipe.Pipeline`` (2 processes, one thread each, gloo)
on an MLP, with every action timed by the executor's hook. Each rank's step wall time splits
into:

  compute      F, B and W actions (with recomputation inside B under re-materialization)
  recompute    R actions (recomputation ahead of the gradient), where the schedule has them
  recv         receive actions: waiting for a peer, plus unpacking the message
  send         send actions: packing the message and handing it to gloo
  executor     gaps between consecutive actions: the executor's own Python work
  bookkeeping  before the first action and after the last: the per-step set-up, the
               collectives (the row count, the loss) and waiting for the outstanding sends

Also the per-action fixed cost over the ideal (stages at once, no communication), and a
torch.profiler summary of one step (``--profile``).

    python -m benchmarks.profile_step                       # width 64, every schedule
    python -m benchmarks.profile_step --width 512 --hidden 2048 --rows 512
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
from gpipe.schedules import SCHEDULES, traits

from .common import machine, write_results

K = 2
CATEGORIES = ("compute", "recompute", "recv", "send", "executor", "bookkeeping")


def _model(width: int, hidden: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(blocks)
        ]
    )


def _balance(schedule: str, blocks: int) -> list[int]:
    """Even stages, as many as the schedule places on K processes (two each for the looped
    and V schedules)."""
    parts = K * traits(schedule).stages_per_rank(virtual_stages=2)
    return [blocks // parts] * parts


def _breakdown(pipe: Pipeline, wall: float) -> dict[str, float]:
    """Seconds of this rank's last step in each category (see the module docstring)."""
    assert pipe.recorder is not None
    events = pipe.recorder.events()
    out = dict.fromkeys(CATEGORIES, 0.0)
    for e in events:
        if e.kind in ("F", "B", "W"):
            out["compute"] += e.end - e.start
        elif e.kind == "R":
            out["recompute"] += e.end - e.start
        elif e.kind.startswith("RECV"):
            out["recv"] += e.end - e.start
        else:
            out["send"] += e.end - e.start
    span = events[-1].end - events[0].start if events else 0.0
    out["executor"] = span - sum(out[c] for c in ("compute", "recompute", "recv", "send"))
    out["bookkeeping"] = wall - span
    out["wall"] = wall
    out["actions"] = len(events)
    return out


def _at_once(cfg: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    """Seconds of one step of this rank's stage alone, no communication: the ideal's part."""
    model = _model(cfg["width"], cfg["hidden"], cfg["blocks"])
    per = cfg["blocks"] // K
    part = model[dist.get_rank() * per : (dist.get_rank() + 1) * per]
    last = dist.get_rank() == K - 1
    grad = torch.randn(x.size(0) // cfg["chunks"], cfg["width"])
    times = []
    for _ in range(cfg["warmup"] + cfg["steps"]):
        dist.barrier()
        start = perf_counter()
        part.zero_grad()
        for xm, ym in zip(x.chunk(cfg["chunks"]), y.chunk(cfg["chunks"]), strict=True):
            out = part(xm.detach().requires_grad_(last))
            if last:
                (mse_loss(out, ym) / cfg["chunks"]).backward()
            else:
                out.backward(grad)
        times.append(perf_counter() - start)
    return statistics.median(times[cfg["warmup"] :])


def run(cfg: dict) -> dict:
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(cfg["rows"], cfg["width"], generator=g)
    y = torch.randn(cfg["rows"], cfg["width"], generator=g)
    result: dict = {"at_once": _at_once(cfg, x, y), "schedules": {}}
    for schedule in cfg["schedules"]:
        for checkpoint in cfg["checkpoints"]:
            pipe = Pipeline(
                _model(cfg["width"], cfg["hidden"], cfg["blocks"]),
                _balance(schedule, cfg["blocks"]),
                chunks=cfg["chunks"],
                checkpoint=checkpoint,
                schedule=schedule,
                loss_fn=mse_loss,
                trace=True,
            )
            steps = []
            for i in range(cfg["warmup"] + cfg["steps"]):
                dist.barrier()
                start = perf_counter()
                pipe.zero_grad()
                pipe.step(x, y)
                wall = perf_counter() - start
                if i >= cfg["warmup"]:
                    steps.append(_breakdown(pipe, wall))
            median = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
            if cfg["profile"]:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    pipe.zero_grad()
                    pipe.step(x, y)
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
                median["profile"] = table
            result["schedules"][f"{schedule}/{checkpoint}"] = median
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--schedules", nargs="+", default=sorted(SCHEDULES))
    parser.add_argument("--checkpoints", nargs="+", default=["never"])
    parser.add_argument("--profile", action="store_true", help="torch.profiler table per case")
    parser.add_argument("--name", default=None, help="results file name (default from sizes)")
    args = parser.parse_args()
    if args.blocks % (2 * K):
        parser.error(
            f"--blocks must be a multiple of {2 * K}, so that every schedule's stages (two per "
            f"process under the looped and V schedules) are even, got {args.blocks}"
        )
    cfg = vars(args)
    per_rank = launch(run, K, (cfg,), threads=1)
    m = args.chunks
    ideal = max(r["at_once"] for r in per_rank.values()) * (m + K - 1) / m
    report: dict = {"workload": cfg, "machine": machine(), "ideal": ideal, "cases": {}}
    print(f"ideal (stages at once x (M+K-1)/M): {ideal * 1e3:.2f} ms")
    header = "".join(f"{c:>12s}" for c in CATEGORIES)
    for case in per_rank[0]["schedules"]:
        ranks = {r: per_rank[r]["schedules"][case] for r in per_rank}
        wall = max(v["wall"] for v in ranks.values())
        actions = max(v["actions"] for v in ranks.values())
        over = (wall - ideal) / actions * 1e6
        print(
            f"\n{case}: {wall * 1e3:.2f} ms/step, {wall / ideal:.3f} x ideal, "
            f"{over:.0f} us per action over the ideal ({actions} actions/rank)"
        )
        print(f"  rank{header}")
        for r, v in ranks.items():
            print(f"  {r:4d}" + "".join(f"{v[c] * 1e3:10.2f}ms" for c in CATEGORIES))
            if "profile" in v and r == 0:
                print(v["profile"])
        report["cases"][case] = {
            "wall": wall,
            "over_ideal": wall / ideal,
            "us_per_action_over_ideal": over,
            "ranks": {
                r: {k: v[k] for k in (*CATEGORIES, "wall", "actions")} for r, v in ranks.items()
            },
        }
    name = args.name or f"profile-w{args.width}"
    print(f"\nwritten to {write_results(name, report)}")
    print(json.dumps({c: round(v["us_per_action_over_ideal"]) for c, v in report["cases"].items()}))


if __name__ == "__main__":
    main()
