"""gpipe at another git revision against the working tree, side by side in one pair of processes.

What a change to the engine bought, measured as BENCHMARKS.md asks: both versions run in the
same two processes (one thread each, gloo), one step each in turn with the order swapped
every cycle, and the ratio is taken within each cycle, so that the machine's drifts hit both
alike. The other revision's ``src/gpipe`` is extracted with ``git archive`` into a temporary
folder as the package ``gpipe_<rev>`` (the package imports itself only relatively).

    python -m benchmarks.compare_revisions 87cbb30                 # width-64 MLP, M = 8
    python -m benchmarks.compare_revisions 87cbb30 --width 512 --hidden 2048 --rows 512
"""

from __future__ import annotations

import argparse
import importlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from time import perf_counter, process_time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import mse_loss

from gpipe import launch

from .common import machine, summary, write_results

K = 2
ROOT = Path(__file__).resolve().parent.parent


def extract(rev: str, into: Path) -> str:
    """``src/gpipe`` at ``rev`` as the importable package ``gpipe_<rev>`` under ``into``."""
    name = "gpipe_" + "".join(c if c.isalnum() else "_" for c in rev)
    archive = subprocess.run(
        ["git", "archive", rev, "src/gpipe"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                path = into / name / Path(member.name).relative_to("src/gpipe")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
    return name


def _model(cfg: dict) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(
                nn.Linear(cfg["width"], cfg["hidden"]),
                nn.GELU(),
                nn.Linear(cfg["hidden"], cfg["width"]),
            )
            for _ in range(cfg["blocks"])
        ]
    )


def _meter(package: str) -> type:
    """A version's ActivationMeter, where that version keeps it (``planning.memory`` since
    the packages by concern, ``memory`` before)."""
    for module in ("planning.memory", "memory"):
        try:
            return importlib.import_module(f"{package}.{module}").ActivationMeter
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"{package} has no ActivationMeter")


def run(cfg: dict, path: str, package: str) -> dict[str, dict[str, list[float]]]:
    """Both versions in turn in this process; returns wall and CPU seconds per step of each
    (CPU: all of this process's threads, gloo's included), this rank."""
    sys.path.insert(0, path)
    versions = {
        "before": importlib.import_module(package),
        "after": importlib.import_module("gpipe"),
    }
    meters = {name: _meter(module.__name__) for name, module in versions.items()}
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(cfg["rows"], cfg["width"], generator=g)
    y = torch.randn(cfg["rows"], cfg["width"], generator=g)
    pipes = {
        name: module.Pipeline(
            _model(cfg),
            [cfg["blocks"] // K] * K,
            chunks=cfg["chunks"],
            checkpoint=cfg["checkpoint"],
            schedule=cfg["schedule"],
            loss_fn=mse_loss,
            group=dist.new_group(list(range(K))),  # each its own channels
        )
        for name, module in versions.items()
    }
    if cfg["memory"]:  # one step each under the activation meter of its own version
        peaks = {}
        for name, pipe in pipes.items():
            with meters[name](pipe) as meter:
                pipe.zero_grad()
                pipe.step(x, y)
            peaks[name] = meter.peak
        return {"activation_peak": peaks}  # type: ignore[dict-item]
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in pipes}
    for cycle in range(cfg["warmup"] + cfg["steps"]):
        order = list(pipes) if cycle % 2 == 0 else list(reversed(pipes))
        for name in order:
            dist.barrier()
            start, cpu = perf_counter(), process_time()
            pipes[name].zero_grad()
            pipes[name].step(x, y)
            wall, cpu = perf_counter() - start, process_time() - cpu
            dist.barrier()
            if cycle >= cfg["warmup"]:
                times[name]["wall"].append(wall)
                times[name]["cpu"].append(cpu)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the git revision to compare with (e.g. a commit hash)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--checkpoint", default="never")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--memory", action="store_true", help="peak activation bytes per process, no timing"
    )
    args = parser.parse_args()
    cfg = vars(args)
    with tempfile.TemporaryDirectory() as tmp:
        package = extract(args.rev, Path(tmp))
        per_rank = launch(run, K, (cfg, tmp, package), threads=1)
    if args.memory:
        for rank, got in sorted(per_rank.items()):
            peaks = got["activation_peak"]
            change = peaks["after"] / peaks["before"] - 1
            print(
                f"rank {rank}: activation peak before {peaks['before']:,} B, after "
                f"{peaks['after']:,} B ({change:+.1%})"
            )
        return
    # a step takes as long as its slowest process; its CPU time is both processes'
    ranks = list(per_rank.values())
    times = {
        name: [max(ts) for ts in zip(*(r[name]["wall"] for r in ranks), strict=True)]
        for name in ("before", "after")
    }
    cpu = {
        name: [sum(ts) for ts in zip(*(r[name]["cpu"] for r in ranks), strict=True)]
        for name in ("before", "after")
    }
    ratios = [a / b for a, b in zip(times["after"], times["before"], strict=True)]
    cpu_ratios = [a / b for a, b in zip(cpu["after"], cpu["before"], strict=True)]
    report = {
        "workload": cfg,
        "machine": machine(),
        "seconds_per_step": {name: summary(ts) for name, ts in times.items()},
        "cpu_seconds_per_step": {name: summary(ts) for name, ts in cpu.items()},
        "after_over_before_per_cycle": summary(ratios),
        "cpu_after_over_before_per_cycle": summary(cpu_ratios),
    }
    for name, ts in times.items():
        print(
            f"{name:7s} {statistics.median(ts) * 1e3:8.2f} ms/step, "
            f"{statistics.median(cpu[name]) * 1e3:8.2f} CPU-ms/step (medians of {len(ts)})"
        )
    print(
        f"after / before, per-cycle medians: wall {statistics.median(ratios):.3f}, "
        f"CPU {statistics.median(cpu_ratios):.3f}"
    )
    name = f"compare-{args.schedule}-w{args.width}-{args.rev[:8]}"
    print(f"written to {write_results(name, report)}")


if __name__ == "__main__":
    main()
