"""DualPipeV's pairs on a GPU: each stage's work on its own CUDA stream, against one stream.

One process holds a V of two stages (K = 1), so in DualPipeV's steady phase the forward of
one micro-batch on one stage and the backward of another on the other stage are independent.
On the process's one stream the GPU runs them one after the other; with a stream per stage
(``Pipeline(overlap_stages=True)``, dualpipe-v's default on CUDA) it may run them at once.
zero-bubble-v, whose actions are not paired, runs both ways too.

Every cycle runs each contender's steps in turn (their order alternating from cycle to
cycle); the ratio of each contender to its one-stream twin is taken per cycle, and the
medians of those ratios are reported. Needs one CUDA device::

    python -m benchmarks.bench_stage_streams --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.functional import mse_loss

from gpipe import Pipeline
from gpipe.models import GPTConfig, build_gpt, lm_loss

from .common import world_of_one


def _mlp(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


Workload = tuple[Callable[[], nn.Sequential], Any, Any, Callable[..., torch.Tensor]]


def _workloads(device: torch.device) -> dict[str, Workload]:
    """Name -> (model factory, inputs, targets, loss)."""
    found: dict[str, Workload] = {}
    for width, rows in ((4096, 512), (4096, 4096), (1024, 256)):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(rows, width, generator=g).to(device)
        y = torch.randn(rows, width, generator=g).to(device)
        found[f"mlp{width}-b{rows}"] = (lambda w=width: _mlp(w, 8), x, y, mse_loss)
    config = GPTConfig(n_layer=8, d_model=1024, n_head=16, vocab_size=8192, seq_len=512)
    ids = torch.randint(0, config.vocab_size, (16, config.seq_len + 1), generator=g).to(device)
    found["gpt1024-b16"] = (lambda: build_gpt(config), ids[:, :-1], ids[:, 1:], lm_loss)
    return found


def _timed(pipe: Pipeline, x: Any, y: Any, steps: int) -> tuple[float, float]:
    """Seconds per step on the GPU's clock (synchronized), and the host's seconds in the
    median ``step`` call (what it takes to issue the step's work)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    issued = []
    for _ in range(steps):
        before = time.perf_counter()
        pipe.step(x, y)
        issued.append(time.perf_counter() - before)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, statistics.median(issued)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda")
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "chunks": args.chunks,
        "cycles": args.cycles,
        "steps": args.steps,
        "workloads": {},
    }
    for name, (factory, x, y, loss) in _workloads(device).items():
        if args.only and name not in args.only.split(","):
            continue
        contenders: dict[str, Pipeline] = {}
        for schedule in args.schedules.split(","):
            for overlap in (True, False):
                model = factory()
                half = len(model) // 2
                contenders[f"{schedule}/{'streams' if overlap else 'one stream'}"] = Pipeline(
                    model.to(device),
                    [half, len(model) - half],
                    chunks=args.chunks,
                    checkpoint="never",
                    schedule=schedule,
                    loss_fn=loss,
                    device=device,
                    overlap_stages=overlap,
                )
        for pipe in contenders.values():
            _timed(pipe, x, y, 2)  # warm-up
        times: dict[str, list[float]] = {key: [] for key in contenders}
        host: dict[str, list[float]] = {key: [] for key in contenders}
        for cycle in range(args.cycles):
            order = list(contenders) if cycle % 2 == 0 else list(reversed(contenders))
            for key in order:
                step_s, host_s = _timed(contenders[key], x, y, args.steps)
                times[key].append(step_s)
                host[key].append(host_s)
        ratios = {}
        for schedule in args.schedules.split(","):
            on, off = times[f"{schedule}/streams"], times[f"{schedule}/one stream"]
            ratios[schedule] = statistics.median(a / b for a, b in zip(on, off, strict=True))
        entry = {
            "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "host_median_ms": {k: 1e3 * statistics.median(v) for k, v in host.items()},
            "streams_over_one_stream": ratios,
            "raw_s": times,
        }
        results["workloads"][name] = entry
        print(
            name,
            json.dumps(
                {k: entry[k] for k in ("median_ms", "host_median_ms", "streams_over_one_stream")}
            ),
        )
        del contenders
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--cycles", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per contender a cycle")
    parser.add_argument("--schedules", default="dualpipe-v,zero-bubble-v")
    parser.add_argument("--only", default="", help="comma-separated workload names")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    world_of_one()
    results = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
