"""Fine-tuning a Hugging Face Llama on packed sequences of very different lengths, pipelined.

The documents are the top-level pieces of this Python's standard library (the text between
two blank lines: a function, a class, a block of imports), bytes as tokens. Their lengths
follow a long tail: most are a few hundred bytes, a few fill ``--max-tokens``. Padding each
to the longest would spend most of the step on padding; instead ``gpipe.data.pack`` packs
several documents into each row and the rows into ``--chunks`` micro-batches of near-equal
tokens, and ``Pipeline.step(microbatches=...)`` runs them as given.

Packed rows keep their documents apart by their ``position_ids``, which restart at 0 with
each document: with no ``attention_mask``, transformers builds a block-diagonal causal mask
from them (SDPA and eager attention), so a packed row trains exactly like its documents each
alone (tests/data/test_packed_split.py). ``gpipe.split`` traces the model with ``input_ids`` and
``position_ids``; the first stage builds the mask and the rotary tables, and the second
receives them with the hidden states. Each micro-batch's loss is a mean over its tokens,
weighed by ``counts_of``, so the step's loss is the mean over all the step's tokens.

    pip install '.[examples]'
    python examples/packed_finetune.py --steps 60
"""

from __future__ import annotations

import argparse
import math
import re
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import gpipe
from gpipe.data import check_packed, counts_of, pack, stdlib_corpus


def config(max_tokens: int) -> LlamaConfig:
    """A small Llama over bytes: 256 tokens, 4 blocks of width 128."""
    return LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_tokens,
        use_cache=False,
        attn_implementation="sdpa",
    )


def documents(max_bytes: int, max_tokens: int) -> list[torch.Tensor]:
    """The standard library's top-level pieces as byte tensors, each cut at ``max_tokens``."""
    text = stdlib_corpus(max_bytes)
    pieces = re.split(rb"\n\n\n+", text)
    return [
        torch.tensor(list(p[:max_tokens]), dtype=torch.long) for p in pieces if len(p.strip()) > 16
    ]


def model_inputs(microbatches: list) -> list:
    """What the model reads of a packed micro-batch: its tokens and their positions."""
    return [
        ({"input_ids": x["input_ids"], "position_ids": x["position_ids"]}, y)
        for x, y in microbatches
    ]


def token_mean(out, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def finetune(args: argparse.Namespace) -> dict[str, float]:
    """One of the two processes."""
    docs = documents(args.data_bytes, args.max_tokens)
    held_out, train = docs[: args.docs_per_step], docs[args.docs_per_step :]
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config(args.max_tokens))
    first = pack(train[: args.docs_per_step], args.max_tokens, args.chunks)
    split = gpipe.split(model, (), model_inputs(first)[0][0], parts=2)
    pipe = gpipe.Pipeline(split, schedule="1f1b", loss_fn=token_mean)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.0)

    def packed(batch: list[torch.Tensor]) -> tuple[list, torch.Tensor]:
        microbatches = pack(batch, args.max_tokens, args.chunks)
        for i, (x, _) in enumerate(microbatches):
            check_packed(x, f"microbatches[{i}] inputs")
        return model_inputs(microbatches), counts_of(microbatches)

    val, val_counts = packed(held_out)

    def validation_loss() -> float:
        pipe.eval()
        loss = float(pipe.evaluate(microbatches=val, counts=val_counts))
        pipe.train()
        return loss

    before = validation_loss()
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    tokens = 0
    start = time.perf_counter()
    for step in range(args.steps):
        at = (step * args.docs_per_step) % (len(train) - args.docs_per_step)
        batch = [train[i] for i in order[at : at + args.docs_per_step].tolist()]
        microbatches, counts = packed(batch)
        optimizer.zero_grad()
        pipe.step(microbatches=microbatches, counts=counts)
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        tokens += sum(len(d) for d in batch)
    seconds = time.perf_counter() - start
    return {"before": before, "after": validation_loss(), "seconds": seconds, "tokens": tokens}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--docs-per-step", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per packed row")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--data-bytes", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = gpipe.launch(finetune, 2, (args,), threads=1)[0]
    print(
        f"pipelined Llama on packed documents (K=2, chunks={args.chunks}, rows of "
        f"{args.max_tokens}): validation loss {result['before']:.3f} -> {result['after']:.3f} "
        f"in {args.steps} steps, {result['tokens'] / result['seconds']:.0f} tokens/s; uniform "
        f"over bytes is {math.log(256):.3f}"
    )
    return result


if __name__ == "__main__":
    main()
