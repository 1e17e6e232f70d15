"""What Hugging Face's Trainer costs around the pipeline: a ``PipelineTrainer`` step against
the same work done by hand, ``Pipeline.step`` on the same model and micro-batches, then
clipping and the optimizer's step.

Two processes (K = 2, one thread each) hold one ``PipelineTrainer`` on a Llama (cut by its
plan) and, for the by-hand contender, a ``Pipeline`` over the same Llama (seeded alike, cut
the same way) with its own AdamW, fed one batch of the same size in the same micro-batches
with the same loss. A callback
interleaves them: each cycle runs one step of each, the by-hand one before the trainer's in
even cycles and after it in odd ones. A trainer step is the time from one step's end to the
next's, less the by-hand step run between them (so it includes what the Trainer does
around ``training_step``: fetching and collating the batch, callbacks, logging, the
scheduler); every time is the slower rank's. The ratio is taken per cycle.

    python -m benchmarks.bench_hf_trainer                          # 31 cycles, ~3 minutes
    python -m benchmarks.bench_hf_trainer --model tiny --repeats 61  # the fixed cost per step
    python -m benchmarks.bench_hf_trainer --quick                  # to check that it runs
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gpipe
from gpipe import launch

from .common import machine, summary, write_results

WARMUP = 3


MODELS = {
    # steps of about a second on 2 cores: what the Trainer adds, against real work
    "llama": {"hidden": 256, "layers": 4, "seq": 128, "batch": 16, "chunks": 4},
    # steps of tens of milliseconds: the Trainer's fixed cost per step, laid bare
    "tiny": {"hidden": 32, "layers": 2, "seq": 16, "batch": 8, "chunks": 2},
}


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
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=sizes["layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=sizes["seq"],
        use_cache=False,
    )
    torch.manual_seed(0)
    steps = WARMUP + cycles
    args = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=sizes["batch"],
        learning_rate=1e-4,
        max_grad_norm=1.0,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        log_level="error",
    )
    data = _rows(sizes["batch"] * steps, sizes["seq"], vocab)
    trainer = PipelineTrainer(
        model=LlamaForCausalLM(config),
        args=args,
        train_dataset=data,
        data_collator=_collate,
        chunks=sizes["chunks"],
    )
    # by hand: the same model (seeded alike) cut the same way, the same micro-batches
    torch.manual_seed(0)
    split = gpipe.split(LlamaForCausalLM(config), parts=2)
    batch = _collate(data[: sizes["batch"]])
    tokens = batch["input_ids"][:, 1:].numel()

    def loss_fn(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = outputs.logits.float()
        summed = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return summed / tokens

    pipe = gpipe.Pipeline(split, chunks=sizes["chunks"], loss_fn=loss_fn, loss_reduction="sum")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)

    hand: list[float] = []  # each by-hand step, the slower rank's
    ends: list[float] = []  # when each trainer step ended, here
    between: list[float] = []  # the by-hand block before each step's end, here

    def by_hand() -> float:
        """One step by hand; returns how long the block took here (barrier included)."""
        began = perf_counter()
        dist.barrier()
        start = perf_counter()
        pipe.step(inputs, targets)
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    parser.add_argument("--repeats", type=int, default=31, help="cycles (after 3 to warm up)")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 3 cycles")
    args = parser.parse_args()
    if args.quick:
        args.model, args.repeats = "tiny", 3
    sizes = MODELS[args.model]
    with tempfile.TemporaryDirectory() as out:
        found = launch(_measure, 2, (sizes, args.repeats, out), threads=1)
    per_rank = [found[0], found[1]]
    trainer = [max(a, b) for a, b in zip(*(r["trainer"] for r in per_rank), strict=True)]
    by_hand = per_rank[0]["by_hand"]  # already the slower rank's
    ratios = [t / h for t, h in zip(trainer, by_hand, strict=True)]
    result = {
        "machine": machine(),
        "model": args.model,
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
    name = "hf-trainer-quick" if args.quick else f"hf-trainer-{args.model}"
    path = write_results(name, result)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
