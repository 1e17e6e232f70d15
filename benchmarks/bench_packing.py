"""Packing against padding on a long-tailed corpus: tokens/s and the measured bubble, K = 2.

A corpus of token ids whose lengths follow a long tail (about 90 % of 8-127 tokens, 10 % of
128-1,024) trains through a small Llama cut in two by ``gpipe.split`` (SDPA attention,
float32), one process per stage, one thread each, schedule 1F1B, M micro-batches:

- padding: the corpus in order, cut into M micro-batches of equal sequence counts, each
  sequence padded to the longest of its micro-batch (``position_ids`` 0..T-1 per row);
- first-fit: ``pack(..., balanced=False)``, rows of at most 1,024 tokens;
- balanced: ``pack(...)``, token-balanced micro-batches;
- equal: M micro-batches of the same rows x 1,024 tokens (the corpus's tokens laid in rows),
  the yardstick of the bubble.

Packed rows keep documents apart by their ``position_ids``, which restart per document
(tests/data/test_packed_split.py checks this is exact against the documents alone). Each cycle runs
one step of each contender, in an order rotated from cycle to cycle; a step's time is the
slower rank's, its tokens/s counts real tokens (never padding), and its bubble is the
ranks' idle share of the step (``Pipeline.last_step``, as ``gpipe train`` reports it).
Ratios are taken per cycle; the medians are reported.

    python -m benchmarks.bench_packing              # ~5 minutes on 2 cores
    python -m benchmarks.bench_packing --quick      # a small corpus, to check that it runs
"""

from __future__ import annotations

import copy
import statistics
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gpipe
from benchmarks.common import machine, quick_or_repeats, summary, write_results
from gpipe import Pipeline, launch
from gpipe.data import IGNORE_INDEX, pack

NAMES = ("padding", "first-fit", "balanced", "equal")
MAX_TOKENS = 1024


def lengths_of(n: int, seed: int = 0) -> list[int]:
    """``n`` lengths, about 90 % of 8-127 tokens and 10 % of 128-1,024."""
    g = torch.Generator().manual_seed(seed)
    short = torch.randint(8, 128, (n,), generator=g)
    long = torch.randint(128, MAX_TOKENS + 1, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.1, long, short).tolist()


def corpus(n: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (length,), generator=g) for length in lengths_of(n)]


def padded(docs: list[torch.Tensor], chunks: int) -> list[tuple[dict, torch.Tensor]]:
    """The documents in order, ``chunks`` micro-batches, each padded to its longest."""
    out = []
    for group in torch.tensor_split(torch.arange(len(docs)), chunks):
        rows = [docs[i] for i in group.tolist()]
        width = max(len(d) for d in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        targets = torch.full((len(rows), width), IGNORE_INDEX)
        for r, d in enumerate(rows):
            ids[r, : len(d)] = d
            targets[r, : len(d) - 1] = d[1:]
        positions = torch.arange(width).expand(len(rows), width).contiguous()
        out.append(({"input_ids": ids, "position_ids": positions}, targets))
    return out


def equal(docs: list[torch.Tensor], chunks: int, rows: int) -> list[tuple[dict, torch.Tensor]]:
    """``chunks`` micro-batches of ``rows`` x 1,024 of the corpus's tokens, one run per row."""
    tokens = torch.cat(docs)
    need = chunks * rows * MAX_TOKENS
    tokens = tokens.repeat(need // tokens.numel() + 1)[:need].view(chunks, rows, MAX_TOKENS)
    positions = torch.arange(MAX_TOKENS).expand(rows, MAX_TOKENS).contiguous()
    targets = torch.cat([tokens[..., 1:], torch.full((chunks, rows, 1), IGNORE_INDEX)], -1)
    return [
        ({"input_ids": x, "position_ids": positions}, y)
        for x, y in zip(tokens, targets, strict=True)
    ]


def model_inputs(microbatches: list[tuple[dict, torch.Tensor]]) -> list[tuple[dict, Any]]:
    keys = ("input_ids", "position_ids")
    return [({k: x[k] for k in keys}, y) for x, y in microbatches]


def llama(cfg: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["width"],
        intermediate_size=2 * cfg["width"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_TOKENS,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def summed(out, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), reduction="sum")


def _step(pipe: Pipeline, microbatches: list) -> tuple[float, float]:
    """One step on every rank: the slower rank's seconds, and the ranks' idle share."""
    pipe.zero_grad()
    dist.barrier()
    start = perf_counter()
    pipe.step(microbatches=microbatches)
    seconds = torch.tensor([perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    last = pipe.last_step
    assert last is not None
    times = torch.tensor([last.busy, last.total], dtype=torch.float64)
    dist.all_reduce(times)
    return float(seconds), float(1 - times[0] / times[1])


def side_by_side(cfg: dict) -> dict:
    """What each of the two processes runs: every contender once per cycle, rotating."""
    docs = corpus(cfg["sequences"], cfg["vocab"])
    m = cfg["chunks"]
    balanced = pack(docs, MAX_TOKENS, m)
    rows = round(statistics.mean(x["input_ids"].shape[0] for x, _ in balanced))
    contenders = {
        "padding": padded(docs, m),
        "first-fit": pack(docs, MAX_TOKENS, m, balanced=False),
        "balanced": balanced,
        "equal": equal(docs, m, rows),
    }
    real = {n: sum(int((x["input_ids"] != 0).sum()) for x, _ in c) for n, c in contenders.items()}
    shapes = {n: [tuple(x["input_ids"].shape) for x, _ in c] for n, c in contenders.items()}
    given = {n: model_inputs(c) for n, c in contenders.items()}
    example = given["balanced"][0][0]
    split = gpipe.split(llama(cfg), (), example, parts=2)
    pipe = Pipeline(copy.deepcopy(split), schedule="1f1b", loss_fn=summed, loss_reduction="sum")
    for name in NAMES:  # warm-up
        _step(pipe, given[name])
    cycles = []
    for cycle in range(cfg["repeats"]):
        order = NAMES[cycle % len(NAMES) :] + NAMES[: cycle % len(NAMES)]
        found = {}
        for name in order:
            seconds, bubble = _step(pipe, given[name])
            found[name] = {
                "seconds": seconds,
                "bubble": bubble,
                "tokens_per_s": real[name] / seconds,
            }
        cycles.append(found)
    return {"cycles": cycles, "tokens": real, "shapes": shapes}


def main() -> None:
    args = quick_or_repeats(__doc__, repeats=7)
    cfg = {
        "sequences": 32 if args.quick else 128, "chunks": 4, "vocab": 256,
        "width": 32 if args.quick else 64, "layers": 4, "repeats": args.repeats,
    }  # fmt: skip
    found = launch(side_by_side, 2, (cfg,), threads=1)[0]
    cycles = found["cycles"]
    medians = {
        name: {k: statistics.median(c[name][k] for c in cycles) for k in cycles[0][name]}
        for name in NAMES
    }
    ratios = {
        f"{a} / {b} {key}": [c[a][key] / c[b][key] for c in cycles]
        for a, b, key in (
            ("balanced", "padding", "tokens_per_s"),
            ("first-fit", "padding", "tokens_per_s"),
            ("balanced", "equal", "bubble"),
            ("first-fit", "equal", "bubble"),
        )
    }
    results = {
        "machine": machine(),
        "config": cfg,
        "tokens": found["tokens"],
        "shapes": found["shapes"],
        "medians": medians,
        "ratios": {k: summary(v) for k, v in ratios.items()},
        "cycles": cycles,
    }
    path = write_results("bench-packing" + ("-quick" if args.quick else ""), results)
    print(f"{'contender':<10} {'real tokens':>11} {'seconds':>8} {'tokens/s':>9} {'bubble':>7}")
    for name in NAMES:
        m = medians[name]
        print(
            f"{name:<10} {found['tokens'][name]:>11} {m['seconds']:>8.3f} "
            f"{m['tokens_per_s']:>9.0f} {m['bubble']:>7.1%}"
        )
    for key, values in ratios.items():
        s = summary(values)
        print(f"{key}: median {s['median']:.2f} (min {s['min']:.2f}, max {s['max']:.2f})")
    print(f"raw results: {path}")


if __name__ == "__main__":
    main()
