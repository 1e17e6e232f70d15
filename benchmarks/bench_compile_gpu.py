"""Compiled layers against eager ones on one GPU: the GPT under 1f1b (one stage) and
zero-bubble-v (a V of two stages), in one process.

A GPT of 8 blocks, d_model 1024, 16 heads, 512 tokens, vocabulary 8192, batch 16 in 8
micro-batches, float32, checkpoint never. The first two steps of each contender compile
(their time and first loss are reported); then cycles of 3 steps of each contender, the order
rotating, until 11 cycles or ``budget`` seconds since the start; the per-cycle medians of
compiled over eager are reported. Needs one CUDA device::

    PYTHONPATH=src python -m benchmarks.bench_compile_gpu 190   # writes $OUT/compile_gpu.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings

import torch

from .common import world_of_one

START = time.time()


def main(budget: float) -> None:
    from gpipe import Pipeline
    from gpipe.models import GPTConfig, build_gpt, lm_loss

    warnings.simplefilter("ignore")  # the split-backward note
    out = os.environ.get("OUT", "/tmp")
    report: dict = {}  # the phases, as they finish

    def dump() -> None:
        found = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
        with open(f"{out}/compile_gpu.json", "w") as f:
            json.dump({**found, "phases": report}, f, indent=1)

    cfg = GPTConfig(n_layer=8, d_model=1024, n_head=16, vocab_size=8192, seq_len=512)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (16, 513), generator=g).cuda()
    x, y = ids[:, :-1], ids[:, 1:]
    pipes = {}
    for schedule, balance in (("1f1b", [10]), ("zero-bubble-v", [5, 5])):
        for compiled in (False, True):
            torch.manual_seed(0)
            name = f"{schedule}/{'compiled' if compiled else 'eager'}"
            pipes[name] = Pipeline(
                build_gpt(cfg).cuda(),
                balance,
                chunks=8,
                checkpoint="never",
                schedule=schedule,
                loss_fn=lm_loss,
                device="cuda",
                compile=compiled,
            )
    first = {}
    for name, pipe in pipes.items():
        torch.cuda.synchronize()
        started = time.time()
        loss = float(pipe.step(x, y))
        pipe.step(x, y)
        torch.cuda.synchronize()
        first[name] = {"seconds": time.time() - started, "first_loss": loss}
        print(name, first[name], flush=True)
    report["first_two_steps"] = first
    dump()
    times: dict[str, list[float]] = {name: [] for name in pipes}
    names = list(pipes)
    cycle = 0
    while cycle < 11 and time.time() - START < budget:
        for name in names[cycle % 4 :] + names[: cycle % 4]:
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(3):
                pipes[name].step(x, y)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - started) / 3)
        cycle += 1
    report["cycles"] = cycle
    report["seconds"] = times
    report["compiled_over_eager"] = {
        s: statistics.median(
            c / e for c, e in zip(times[f"{s}/compiled"], times[f"{s}/eager"], strict=True)
        )
        for s in ("1f1b", "zero-bubble-v")
    }
    report["median_ms"] = {n: 1e3 * statistics.median(v) for n, v in times.items()}
    dump()
    shown = ("cycles", "compiled_over_eager", "median_ms")
    print(json.dumps({k: report[k] for k in shown}), flush=True)


if __name__ == "__main__":
    world_of_one()
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 190.0)
