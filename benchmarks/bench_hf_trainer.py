"""What Hugging Face's Trainer costs around the pipeline: a ``PipelineTrainer`` step against
the same work done by hand, ``Pipeline.step`` on the same model and micro-batches, then
clipping and the optimizer's step.

Two processes (K = 2, one thread each) hold one ``PipelineTrainer`` on a Llama (cut by its
plan). The by-hand contender runs on that trainer's own pipeline, with its own AdamW over
the same parameters, the same batch split into the same micro-batches. A callback
interleaves them: each cycle runs one step of each, the by-hand one before the trainer's in
even cycles and after it in odd ones. A trainer step is the time from one step's end to the
next's, less the by-hand step run between them (so it includes what the Trainer does
around ``training_step``: fetching and collating the batch, callbacks, logging, the
scheduler); every time is the slower rank's. The ratio is taken per cycle.

    python -m benchmarks.bench_hf_trainer            # 21 cycles, ~2 minutes on 2 cores
    python -m benchmarks.bench_hf_trainer --quick    # a tiny model, to check that it runs
"""

from __future__ import annotations

import statistics
import tempfile
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from gpipe import launch

from .common import machine, quick_or_repeats, summary, write_results

WARMUP = 3


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"hidden": 32, "layers": 2, "seq": 16, "batch": 8, "chunks": 2}
    return {"hidden": 256, "layers": 4, "seq": 128, "batch": 16, "chunks": 4}


def _rows(n: int, seq: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, vocab, (seq,), generator=g)} for _ in range(n)]


def _collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([r["input_ids"] for r in rows])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _slowest(seconds: float) -> float:
    took = torch.tensor([seconds])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _measure(sizes: dict[str, int], cycles: int, out: str) -> dict[str, Any]:
    """One process: the trainer, and the by-hand steps its callback interleaves."""
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from gpipe.integrations.transformers import PipelineTrainer

    hidden, vocab = sizes["hidden"], 256
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=sizes["layers"], num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=sizes["seq"], use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    steps = WARMUP + cycles
    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=sizes["batch"],
        learning_rate=1e-4, max_grad_norm=1.0, logging_steps=10, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, log_level="error",
    )  # fmt: skip
    data = _rows(sizes["batch"] * steps, sizes["seq"], vocab)
    trainer = PipelineTrainer(
        model=LlamaForCausalLM(config), args=args, train_dataset=data, data_collator=_collate,
        chunks=sizes["chunks"],
    )  # fmt: skip
    pipe = trainer.pipeline
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    batch = _collate(data[: sizes["batch"]])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    targets = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    chunks = sizes["chunks"]
    microbatches = list(
        zip(
            [dict(zip(inputs, parts, strict=True)) for parts in zip(
                *(v.chunk(chunks) for v in inputs.values()), strict=True)],
            targets.chunk(chunks),
            strict=True,
        )
    )  # fmt: skip

    hand: list[float] = []  # each by-hand step, the slower rank's
    ends: list[float] = []  # when each trainer step ended, here
    between: list[float] = []  # the by-hand block before each step's end, here

    def by_hand() -> float:
        """One step by hand; returns how long the block took here (barrier included)."""
        began = perf_counter()
        dist.barrier()
        start = perf_counter()
        pipe.step(microbatches=microbatches)
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        hand.append(_slowest(perf_counter() - start))
        return perf_counter() - began

    class Interleave(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            between.append(by_hand() if len(ends) % 2 == 0 else 0.0)  # even: by hand first

        def on_step_end(self, *_: Any, **__: Any) -> None:
            ends.append(perf_counter())
            after.append(by_hand() if len(ends) % 2 == 0 else 0.0)  # odd: by hand after

    after: list[float] = []  # the by-hand block after each step's end, here
    trainer.add_callback(Interleave())
    trainer.train()
    # a trainer step: from the last one's end to its own, less the by-hand blocks between
    steps = [ends[i] - ends[i - 1] - after[i - 1] - between[i] for i in range(1, len(ends))]
    return {"trainer": steps[WARMUP - 1 :], "by_hand": hand[WARMUP:]}


def main() -> None:
    args = quick_or_repeats(__doc__, 21)
    sizes = _sizes(args.quick)
    with tempfile.TemporaryDirectory() as out:
        found = launch(_measure, 2, (sizes, args.repeats, out), threads=1)
    per_rank = [found[0], found[1]]
    trainer = [max(a, b) for a, b in zip(*(r["trainer"] for r in per_rank), strict=True)]
    by_hand = per_rank[0]["by_hand"]  # already the slower rank's
    ratios = [t / h for t, h in zip(trainer, by_hand, strict=True)]
    result = {
        "machine": machine(),
        "sizes": sizes,
        "cycles": args.repeats,
        "trainer_s": summary(trainer),
        "pipeline_step_s": summary(by_hand),
        "ratio_per_cycle": summary(ratios),
        "raw": {"trainer": trainer, "by_hand": by_hand},
    }
    print(
        f"Llama hidden {sizes['hidden']}, {sizes['layers']} layers, batch {sizes['batch']} x "
        f"{sizes['seq']} tokens, chunks {sizes['chunks']}, K = 2, {args.repeats} cycles"
    )
    print(f"PipelineTrainer step      median {statistics.median(trainer) * 1e3:8.1f} ms")
    print(f"Pipeline.step by hand     median {statistics.median(by_hand) * 1e3:8.1f} ms")
    print(
        f"ratio per cycle           median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    path = write_results("hf-trainer-quick" if args.quick else "hf-trainer", result)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
