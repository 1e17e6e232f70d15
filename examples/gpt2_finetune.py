"""Fine-tuning a Hugging Face GPT-2 pipelined: ``gpipe.split`` cuts it, ``Pipeline`` trains it.

GPT-2 is not an ``nn.Sequential``: its forward takes ``input_ids`` and ``labels``, computes its
own loss, returns a ``ModelOutput``, and its output projection is its token embedding.
``gpipe.split`` traces it with ``torch.export`` and cuts it in two where the parameters are
most even; the embedding, used by both stages, is held by each and its gradients summed.

The model is split on the meta device: each of the 2 processes allocates only its own stage
and loads it by the original model's names, from ``--weights`` (a state dict such as this
script saves; for a model too large for one process, give ``load_original_state_dict`` a
lazily read mapping, e.g. over ``safetensors.safe_open``) or, without it, from a freshly
initialized model. It trains on the text ``gpipe train`` uses (this Python's standard
library, bytes as tokens), with the model's own loss averaged over tokens, prints the
validation loss before and after, and saves the weights under the original names: an
unsplit ``GPT2LMHeadModel`` loads them as they are, which the script checks.

    pip install '.[examples]'
    python examples/gpt2_finetune.py --steps 300 --out gpt2-bytes.pt
    python examples/gpt2_finetune.py --weights gpt2-bytes.pt --lr 1e-4   # fine-tune again
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import gpipe
from gpipe.data import BatchSampler, ByteDataset, stdlib_corpus


def config(seq_len: int) -> GPT2Config:
    """A small GPT-2 over bytes: 256 tokens, 4 blocks of width 128."""
    return GPT2Config(
        vocab_size=256,
        n_positions=seq_len,
        n_embd=128,
        n_layer=4,
        n_head=4,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )


def initial_weights(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The weights to start from, by the model's own names."""
    if args.weights:
        return torch.load(args.weights, map_location="cpu", weights_only=True)
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(config(args.seq_len)).state_dict()


def batch_of(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": tokens, "labels": tokens}  # the model shifts the labels itself


def save_atomically(state: dict[str, torch.Tensor], path: str) -> None:
    folder = Path(path).resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, delete=False, suffix=".tmp") as handle:
        torch.save(state, handle)
    os.replace(handle.name, path)


def finetune(args: argparse.Namespace) -> dict[str, float]:
    """One of the two processes."""
    torch.manual_seed(args.seed)
    data = ByteDataset.split(stdlib_corpus(args.data_bytes))
    with torch.device("meta"):
        model = GPT2LMHeadModel(config(args.seq_len))
    example = batch_of(torch.zeros(2, args.seq_len, dtype=torch.long, device="meta"))
    split = gpipe.split(model, (), example, parts=2)
    pipe = gpipe.Pipeline(
        split,
        chunks=args.chunks,
        schedule="1f1b",
        loss_fn=lambda out: out.loss,  # GPT-2's own loss: a mean over its tokens
    )
    split.load_original_state_dict(initial_weights(args), module=pipe)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.0)

    val = BatchSampler(data.val, args.batch_size, args.seq_len, seed=1)
    held_out = [val.next()[0] for _ in range(args.val_batches)]

    def validation_loss() -> float:
        pipe.eval()
        losses = [float(pipe.evaluate(batch_of(tokens))) for tokens in held_out]
        pipe.train()
        return sum(losses) / len(losses)

    before = validation_loss()
    train = BatchSampler(data.train, args.batch_size, args.seq_len, seed=args.seed)
    start = time.perf_counter()
    for _ in range(args.steps):
        tokens, _ = train.next()
        optimizer.zero_grad()
        pipe.step(batch_of(tokens))
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
    seconds = time.perf_counter() - start
    after = validation_loss()

    pieces: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, split.original_state_dict(module=pipe))
    if dist.get_rank() == 0 and args.out:
        merged = {k: v for piece in pieces if piece for k, v in piece.items()}
        save_atomically(merged, args.out)
    return {"before": before, "after": after, "seconds": seconds}


def unsplit_loss(args: argparse.Namespace) -> float:
    """The saved weights in an unsplit GPT2LMHeadModel, on the same validation batches."""
    model = GPT2LMHeadModel(config(args.seq_len))
    model.load_state_dict(torch.load(args.out, map_location="cpu", weights_only=True))
    model.eval()
    data = ByteDataset.split(stdlib_corpus(args.data_bytes))
    val = BatchSampler(data.val, args.batch_size, args.seq_len, seed=1)
    with torch.no_grad():
        losses = [float(model(**batch_of(val.next()[0])).loss) for _ in range(args.val_batches)]
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weights", help="a state dict to start from (the model's own names)")
    parser.add_argument("--out", default="gpt2-bytes.pt", help="where to save the weights")
    parser.add_argument("--data-bytes", type=int, default=2_000_000)
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = gpipe.launch(finetune, 2, (args,), threads=1)
    result = results[0]
    print(
        f"pipelined GPT-2 (K=2, gpipe.split parts=2, chunks={args.chunks}): validation loss "
        f"{result['before']:.3f} -> {result['after']:.3f} in {args.steps} steps "
        f"({result['seconds']:.0f} s); uniform over bytes is {math.log(256):.3f}"
    )
    if args.out:
        result["unsplit"] = unsplit_loss(args)
        print(
            f"unsplit GPT2LMHeadModel on the saved weights ({args.out}): validation loss "
            f"{result['unsplit']:.3f}"
        )
    return result


if __name__ == "__main__":
    main()
