"""Generation through the pipeline on the CPU: decode tokens/s of `gpipe train`'s default GPT
cut in two (two processes of one thread, two groups in flight) against the unsplit model in
one process of one thread and of two; and the time to first token of a long prompt beside
waiting requests, prefilled in chunks or whole.

1. Throughput: 16 prompts of 8 to 16 tokens, 96 new tokens each (greedy, no end of text), so
   that decoding dominates. Two processes hold every contender at once: the pipeline over
   both (``Pipeline.generate``, K = 2, ``in_flight=2``), and the whole model on the first
   process alone (K = 1, its own group), run with one intra-op thread and with two while the
   second process waits. Each cycle runs each contender once, in an order that rotates, and
   the ratio is taken per cycle.
2. The ceiling: one decoding step of each stage alone on 8 rows, and of the whole model on
   16, in one process (the first; the second waits), alternating. Two groups in flight give
   each stage two such steps per token of every sequence, so the whole model's step over
   twice the slower stage's is the most the pipeline can gain, with nothing to send.
3. Time to first token: the same GPT with a context of 1,024, a prompt of 960 tokens first
   and 15 of 16 after it, 16 new tokens each, through the two stages, prefilled whole
   (``prefill_chunk=None``) or in chunks of 64; the long prompt's first token, the short
   ones' (median and slowest), and how long it all took.

    python -m benchmarks.bench_generate            # ~5 minutes on 2 cores
    python -m benchmarks.bench_generate --quick    # small sizes, to check that it runs
"""

from __future__ import annotations

import os
import statistics
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from gpipe import Pipeline, launch
from gpipe.models import PRESETS, Embedding, build_gpt, config_from_preset

from .common import machine, quick_or_repeats, write_results

PROMPTS = 16


def _prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _model(seq_len: int) -> torch.nn.Sequential:
    torch.manual_seed(0)  # the same weights in every contender
    return build_gpt(config_from_preset("small", seq_len=seq_len))


def _timed(run: Any) -> float:
    """Seconds of ``run()`` started together on both processes: the slower's."""
    dist.barrier()
    start = perf_counter()
    run()
    took = torch.tensor([perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def throughput(repeats: int, new: int) -> dict[str, Any]:
    """Decode tokens/s of each contender, alternating, and the per-cycle ratios."""
    config = PRESETS["small"]
    prompts = _prompts([8 + (i % 9) for i in range(PROMPTS)], config.vocab_size)
    staged = Pipeline(_model(config.seq_len), chunks=1, timeout=1800)  # joins the group
    solo_group = dist.new_group([0])
    whole = (
        Pipeline(_model(config.seq_len), group=solo_group, timeout=1800)
        if dist.get_rank() == 0
        else None
    )
    tokens = PROMPTS * new

    def pipelined() -> None:
        staged.generate(prompts, new, in_flight=2)

    def alone(threads: int) -> Any:
        def run() -> None:
            if whole is not None:
                torch.set_num_threads(threads)
                whole.generate(prompts, new)
                torch.set_num_threads(1)

        return run

    contenders = {
        "K=2 x 1 thread": pipelined,
        "K=1 x 1 thread": alone(1),
        "K=1 x 2 threads": alone(2),
    }
    names = list(contenders)
    for name in names:  # warm up
        contenders[name]()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for cycle in range(repeats):
        order = names[cycle % len(names) :] + names[: cycle % len(names)]
        for name in order:
            seconds[name].append(_timed(contenders[name]))
    base1, base2 = seconds["K=1 x 1 thread"], seconds["K=1 x 2 threads"]
    k2 = seconds["K=2 x 1 thread"]
    return {
        "tokens": tokens,
        "tokens_per_s": {n: tokens / statistics.median(s) for n, s in seconds.items()},
        "seconds": seconds,
        "ratio_vs_1_thread": statistics.median(b / k for b, k in zip(base1, k2, strict=True)),
        "ratio_vs_2_threads": statistics.median(b / k for b, k in zip(base2, k2, strict=True)),
    }


def _decode_step(layers: list[torch.nn.Module], rows: int, steps: int) -> float:
    """Seconds of one decoding step of ``layers`` on ``rows`` rows of 16 cached tokens."""
    from gpipe.engine.generation.lanes import CachedStage, StageCaches
    from gpipe.engine.generation.scheduler import Piece, Task

    caches = StageCaches(CachedStage(torch.nn.Sequential(*layers), 0, torch.device("cpu"), None))
    first = isinstance(layers[0], Embedding)
    width = layers[0].token.embedding_dim if first else layers[0].ln1.normalized_shape[0]
    with torch.no_grad():
        for i in range(rows):
            x = torch.full((1, 16), 5) if first else torch.randn(1, 16, width)
            caches.run(Task(0, pieces=(Piece(i, 0, (), True),)), None, [x])
        caches.apply(Task(0, joins=tuple(range(rows)), rows=tuple(range(rows))))
        x = torch.full((rows, 1), 5) if first else torch.randn(rows, 1, width)
        start = perf_counter()
        for _ in range(steps):
            caches.decode(0, x)
        return (perf_counter() - start) / steps


def ceiling(repeats: int, steps: int) -> dict[str, Any]:
    """The whole model's decoding step on 16 rows against each stage's on 8 (first rank)."""
    found: dict[str, list[float]] = {
        "whole, 16 rows": [],
        "stage 0, 8 rows": [],
        "stage 1, 8 rows": [],
    }
    if dist.get_rank() == 0:
        model = _model(PRESETS["small"].seq_len).eval()
        layers = list(model)
        half = len(layers) // 2
        for _ in range(repeats):
            found["whole, 16 rows"].append(_decode_step(layers, 16, steps))
            found["stage 0, 8 rows"].append(_decode_step(layers[:half], 8, steps))
            found["stage 1, 8 rows"].append(_decode_step(layers[half:], 8, steps))
    dist.barrier()
    step = {name: statistics.median(times) for name, times in found.items() if times}
    if not step:
        return {}
    slower = max(step["stage 0, 8 rows"], step["stage 1, 8 rows"])
    return {"seconds": step, "ceiling": step["whole, 16 rows"] / (2 * slower)}


def first_tokens(repeats: int, long: int, chunk: int) -> dict[str, Any]:
    """Time to first token of a long prompt and of the short ones behind it, and the longest
    gap between two tokens, prefilled whole or in chunks of ``chunk``."""
    context = long + 64
    prompts = _prompts([long] + [16] * (PROMPTS - 1), 256, seed=1)
    pipe = Pipeline(_model(context), chunks=1, timeout=1800)
    found: dict[str, dict[str, list[float]]] = {}
    for cycle in range(repeats + 1):
        for chunked in (None, chunk) if cycle % 2 == 0 else (chunk, None):
            name = "whole" if chunked is None else f"chunks of {chunked}"
            dist.barrier()
            pipe.generate(prompts, 16, in_flight=2, prefill_chunk=chunked)
            timing = pipe.generator().timing
            if timing is None or cycle == 0:  # the first cycle warms up
                continue
            first = [t - timing.started for t in timing.first_token if t is not None]
            row = found.setdefault(name, {"long": [], "short": [], "short_max": [], "total": []})
            row["long"].append(first[0])
            row["short"].append(statistics.median(first[1:]))
            row["short_max"].append(max(first[1:]))
            row["total"].append(timing.ended - timing.started)
    return {name: {k: statistics.median(v) for k, v in row.items()} for name, row in found.items()}


def run_all(quick: bool, repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    load = os.getloadavg()
    results: dict[str, Any] = {"throughput": throughput(repeats, 8 if quick else 96)}
    results["ceiling"] = ceiling(repeats, 8 if quick else 64)
    long = 96 if quick else 960
    results["first_token"] = first_tokens(repeats, long, 16 if quick else 64)
    results["load_average"] = {"before": load, "after": os.getloadavg()}
    return results


def main() -> None:
    args = quick_or_repeats(__doc__ or "", 9)
    found = launch(run_all, 2, (args.quick, args.repeats), threads=1)[0]
    found["machine"] = machine()
    found["command"] = "python -m benchmarks.bench_generate" + (" --quick" if args.quick else "")
    if not args.quick:
        print(write_results("generate", found))
    tp = found["throughput"]
    for name, rate in tp["tokens_per_s"].items():
        print(f"{name}: {rate:.0f} tokens/s")
    one, two = tp["ratio_vs_1_thread"], tp["ratio_vs_2_threads"]
    print(f"K=2 / K=1 x 1 thread: {one:.2f}; / K=1 x 2 threads: {two:.2f}")
    most = found["ceiling"]["ceiling"]
    print(f"ceiling (the whole model's step over twice the slower stage's): {most:.2f}")
    for name, row in found["first_token"].items():
        print(
            f"{name}: first token of the long prompt {row['long'] * 1e3:.0f} ms, of the short "
            f"ones {row['short'] * 1e3:.0f} ms (median), {row['short_max'] * 1e3:.0f} ms "
            f"(slowest), all {row['total'] * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
