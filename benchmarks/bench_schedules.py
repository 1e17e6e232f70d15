"""Schedules side by side: step time, measured against simulated bubble, activation memory.

Workload: the MLP of bench_mlp (8 blocks of Linear(1024, 4096) -> GELU -> Linear(4096,
1024), batch 1024, MSE), K = 2 processes with one thread each, 8 micro-batches, no
re-materialization; interleaved with 2 stages of 2 blocks per process. Every schedule runs
in the same pair of processes, one step each in turn.

- step time: the slowest process's, median over the measured cycles.
- measured bubble: 1 - (time in forward/backward/weight actions) / (step time), all ranks.
- simulated bubble: the simulator's, fed with this run's median F, B and W times per stage.
- activation memory: the peak bytes of tensors autograd keeps for backward, per process,
  counting each storage once and leaving out parameters.

    python -m benchmarks.bench_schedules          # ~5 min, writes results/schedules.json
    python -m benchmarks.bench_schedules --quick  # small sizes, to check that it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.functional import mse_loss

from gpipe import Pipeline, launch
from gpipe.planning import measured_costs
from gpipe.planning.simulate import simulate
from gpipe.schedules import get_schedule, interleaved

from .bench_mlp import _data, _model
from .common import machine, summary, write_results

K = 2
SCHEDULES = ("gpipe", "1f1b", "zero-bubble", "interleaved")
V = 2  # stages per process of the interleaved schedule


def _stages(name: str) -> int:
    return K * V if name == "interleaved" else K


class _Held:
    """A tensor autograd keeps for backward; its storage counts while any holder lives."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: _SavedBytes, tensor: Tensor) -> None:
        self.meter, self.tensor = (
            meter,
            tensor.detach(),
        )  # not the tensor: it would tie an output to its own graph
        self.key = tensor.untyped_storage().data_ptr()
        meter.hold(self.key, tensor.untyped_storage().nbytes())

    def __del__(self) -> None:
        self.meter.drop(self.key, self.tensor.untyped_storage().nbytes())


class _SavedBytes:
    """Peak bytes of the tensors autograd saves for backward, each storage counted once,
    parameters left out."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._holders: dict[int, int] = {}
        self.live = self.peak = 0

    def hold(self, key: int, nbytes: int) -> None:
        if key not in self._holders:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._holders[key] = self._holders.get(key, 0) + 1

    def drop(self, key: int, nbytes: int) -> None:
        self._holders[key] -= 1
        if not self._holders[key]:
            del self._holders[key]
            self.live -= nbytes

    @contextmanager
    def watching(self) -> Iterator[None]:
        def pack(t: Tensor) -> _Held | Tensor:
            return t if t.untyped_storage().data_ptr() in self._params else _Held(self, t)

        def unpack(held: _Held | Tensor) -> Tensor:
            return held.tensor if isinstance(held, _Held) else held

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


def run(cfg: dict) -> dict:
    """Every schedule in turn in this pair of processes; returns this rank's figures."""
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    x, y = _data(cfg["rows"], cfg["width"])
    pipes, meters = {}, {}
    for name in SCHEDULES:
        model = _model(cfg["width"], cfg["hidden"], cfg["blocks"])
        pipes[name] = Pipeline(
            model,
            [cfg["blocks"] // _stages(name)] * _stages(name),
            chunks=cfg["chunks"],
            checkpoint="never",
            schedule=name,
            loss_fn=mse_loss,
            trace=True,
        )
        meters[name] = _SavedBytes(list(pipes[name].parameters()))
    out: dict = {name: {"seconds": [], "busy": [], "events": None} for name in SCHEDULES}
    for cycle in range(cfg["warmup"] + cfg["steps"]):
        turn = cycle % len(SCHEDULES)
        order = SCHEDULES[turn:] + SCHEDULES[:turn]
        for name in order:
            pipe = pipes[name]
            pipe.zero_grad()
            dist.barrier()
            start = perf_counter()
            with meters[name].watching():
                pipe.step(x, y)
            dist.barrier()
            if cycle >= cfg["warmup"]:
                out[name]["seconds"].append(perf_counter() - start)
                out[name]["busy"].append(pipe.last_step.busy)
                out[name]["events"] = pipe.recorder.events()
    for name in SCHEDULES:
        out[name]["peak_saved_bytes"] = meters[name].peak
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="measured steps per schedule")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small sizes, to check it runs")
    args = parser.parse_args()
    cfg = {
        "width": 1024, "hidden": 4096, "blocks": 8, "rows": 1024, "chunks": 8,
        "steps": args.steps, "warmup": args.warmup,
    }  # fmt: skip
    if args.quick:
        cfg |= {"width": 64, "hidden": 256, "rows": 64, "steps": 3, "warmup": 1}
    per_rank = launch(run, K, (cfg,), threads=1)
    report: dict = {"workload": cfg, "machine": machine(), "schedules": {}}
    cycles: dict[str, list[float]] = {}
    for name in SCHEDULES:
        ranks = per_rank.values()
        seconds = [max(ts) for ts in zip(*(r[name]["seconds"] for r in ranks), strict=True)]
        busy = [sum(bs) for bs in zip(*(r[name]["busy"] for r in ranks), strict=True)]
        cycles[name] = seconds
        measured_bubble = statistics.median(
            1 - b / (K * s) for b, s in zip(busy, seconds, strict=True)
        )
        events = [e for r in per_rank.values() for e in r[name]["events"]]
        schedule = (
            interleaved(K * V, cfg["chunks"], K)
            if name == "interleaved"
            else get_schedule(name)(K, cfg["chunks"])
        )
        simulated = simulate(schedule, measured_costs(schedule, events))
        report["schedules"][name] = {
            "seconds_per_step": summary(seconds),
            "measured_bubble": measured_bubble,
            "simulated_bubble": simulated.bubble,
            "peak_saved_mib": [r[name]["peak_saved_bytes"] / 2**20 for r in per_rank.values()],
        }
        row = report["schedules"][name]
        print(
            f"{name:12s} {row['seconds_per_step']['median'] * 1e3:8.1f} ms/step  "
            f"bubble measured {measured_bubble:6.1%} simulated {simulated.bubble:6.1%}  "
            f"activations {', '.join(f'{m:.0f}' for m in row['peak_saved_mib'])} MiB",
            flush=True,
        )
    med = {n: report["schedules"][n]["seconds_per_step"]["median"] for n in SCHEDULES}
    report["zero_bubble_over_1f1b"] = med["zero-bubble"] / med["1f1b"]
    report["1f1b_over_gpipe"] = med["1f1b"] / med["gpipe"]
    report["interleaved_over_1f1b"] = med["interleaved"] / med["1f1b"]
    # the same ratios within each cycle of consecutive steps, where drifts hit both alike
    report["per_cycle"] = {
        f"{a.replace('-', '_')}_over_{b}": summary(
            [x / y for x, y in zip(cycles[a], cycles[b], strict=True)]
        )
        for a, b in (("zero-bubble", "1f1b"), ("1f1b", "gpipe"), ("interleaved", "1f1b"))
    }
    path = write_results("schedules-quick" if args.quick else "schedules", report)
    ratios = ("zero_bubble_over_1f1b", "1f1b_over_gpipe", "interleaved_over_1f1b", "per_cycle")
    print(json.dumps({k: report[k] for k in ratios}))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
