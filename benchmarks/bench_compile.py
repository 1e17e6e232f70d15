"""Compiled layers against eager ones: the GPT's tokens per second under 1F1B and zero-bubble.

Two processes of one thread each (K = 2) hold, side by side, an eager pipeline and one with
``compile=True`` (torch.compile's default backend) for each schedule, on the same GPT
(``benchmarks.common.gpt_model``), batch 16 in 4 micro-batches, no re-materialization. The
first steps compile (their time is reported apart); then every cycle runs one step of each
contender, the order rotating, and the compiled step's time is divided by the eager one's of
the same schedule in the same cycle; the medians of those ratios are reported.

    python -m benchmarks.bench_compile --repeats 9      # writes results/compile.json
    python -m benchmarks.bench_compile --quick          # a tiny GPT, to check it runs
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

import torch

from gpipe import Pipeline, launch
from gpipe.models import GPTConfig, build_gpt, lm_loss

from .common import gpt_model, machine, quick_or_repeats, summary, timed_step, write_results

SCHEDULES = ("1f1b", "zero-bubble")
ROWS, CHUNKS = 16, 4


def contenders(model: dict[str, Any]) -> dict[str, Pipeline]:
    config = GPTConfig(**model)
    pipes = {}
    for schedule in SCHEDULES:
        for compiled in (False, True):
            torch.manual_seed(0)
            pipes[f"{schedule}/{'compiled' if compiled else 'eager'}"] = Pipeline(
                build_gpt(config),
                chunks=CHUNKS,
                checkpoint="never",
                schedule=schedule,
                loss_fn=lm_loss,
                compile=compiled,
            )
    return pipes


def measure(model: dict[str, Any], repeats: int) -> dict[str, Any]:
    """One process's part: the compile steps, then ``repeats`` rotating cycles."""
    import warnings

    warnings.simplefilter("ignore")  # the split-backward note, said by every pipeline
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, GPTConfig(**model).vocab_size, (ROWS, model["seq_len"] + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    pipes = contenders(model)
    first = {}
    for name, pipe in pipes.items():
        start = perf_counter()
        timed_step(pipe, x, y)  # compiles, under compile=True
        timed_step(pipe, x, y)
        first[name] = perf_counter() - start
    seconds: dict[str, list[float]] = {name: [] for name in pipes}
    names = list(pipes)
    for cycle in range(repeats):
        for name in names[cycle % len(names) :] + names[: cycle % len(names)]:
            seconds[name].append(timed_step(pipes[name], x, y))
    return {"first_two_steps_s": first, "seconds": seconds}


def main() -> None:
    args = quick_or_repeats(__doc__ or "", repeats=9)
    model = gpt_model(args.quick)
    result = launch(measure, 2, (model, args.repeats), threads=1)[0]
    tokens = ROWS * model["seq_len"]
    report: dict[str, Any] = {
        "machine": machine(),
        "model": model,
        "rows": ROWS,
        "chunks": CHUNKS,
        "repeats": args.repeats,
        "first_two_steps_s": result["first_two_steps_s"],
        "contenders": {},
    }
    for name, times in result["seconds"].items():
        report["contenders"][name] = {
            "seconds": summary(times),
            "tokens_per_s": tokens / sorted(times)[len(times) // 2],
        }
    for schedule in SCHEDULES:
        pairs = zip(
            result["seconds"][f"{schedule}/compiled"],
            result["seconds"][f"{schedule}/eager"],
            strict=True,
        )
        report["contenders"][f"{schedule}/compiled"]["over_eager_per_cycle"] = summary(
            [c / e for c, e in pairs]
        )
    path = write_results("compile-quick" if args.quick else "compile", report)
    for name, entry in report["contenders"].items():
        ratio = entry.get("over_eager_per_cycle", {}).get("median")
        extra = f", compiled / eager {ratio:.3f}" if ratio else ""
        print(f"{name}: {entry['tokens_per_s']:.0f} tokens/s{extra}")
    print(f"first two steps (s): {report['first_two_steps_s']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
