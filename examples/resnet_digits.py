"""A small ResNet trained pipelined: BatchNorm, and residual shortcuts that cross the cut.

The model (``gpipe.models.resnet``) is an ``nn.Sequential`` whose residual blocks are
written as two layers: the first stashes the block's input (``gpipe.skip.stash``), the second
pops it and adds it back. Cut between them, the shortcut travels straight from one process to
the other. BatchNorm layers become ``DeferredBatchNorm`` (``deferred_batch_norm=True``): each
micro-batch is normalized by its own statistics, and the running statistics used at test time
are tracked once per mini-batch.

It trains on scikit-learn's handwritten digits (8x8 images, shipped inside scikit-learn,
nothing to download) in 2 processes (K = 2, checkpoint "always"), then trains the same model
without the pipeline on the same mini-batches and prints both test accuracies.

    pip install '.[examples]'
    python examples/resnet_digits.py
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.nn.functional import cross_entropy

import gpipe
from gpipe.models.resnet import resnet


def digits_resnet() -> nn.Sequential:
    """Stem, three residual blocks (two layers each), head: eight layers."""
    return resnet((32, 64, 64))


# The cut falls inside the second block: its shortcut crosses from stage 0 to stage 1.
BALANCE = [4, 4]


def digits(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The 1,797 digits as (N, 1, 8, 8) images in [0, 1], split 80/20 by a fixed shuffle."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return images[train], labels[train], images[test], labels[test]


def batches(n: int, batch_size: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """The mini-batches of every epoch, as row indices: both runs see exactly these."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        out += [order[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]
    return out


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return (logits.argmax(1) == labels).float().mean().item()


def pipelined(args: argparse.Namespace) -> dict[str, float]:
    """One of two processes: train through gpipe.Pipeline, then evaluate on the test set."""
    torch.manual_seed(args.seed)
    x, y, x_test, y_test = digits(args.seed)
    pipe = gpipe.Pipeline(
        digits_resnet(),
        BALANCE,
        chunks=args.chunks,
        checkpoint="always",
        loss_fn=cross_entropy,
        deferred_batch_norm=True,
    )
    optimizer = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, args.lr, total_steps=len(batches(len(y), args.batch_size, args.epochs, 0))
    )
    start = time.perf_counter()
    for rows in batches(len(y), args.batch_size, args.epochs, args.seed):
        optimizer.zero_grad()
        pipe.step(x[rows], y[rows])
        optimizer.step()
        schedule.step()
    seconds = time.perf_counter() - start
    pipe.eval()
    logits = pipe(x_test)  # the test set's logits on the last stage, None elsewhere
    result = {"seconds": seconds}
    if logits is not None:
        result["accuracy"] = accuracy(logits, y_test)
    return result


def unpipelined(args: argparse.Namespace) -> dict[str, float]:
    """The same model and mini-batches in one process, with PyTorch's own BatchNorm."""
    torch.manual_seed(args.seed)
    x, y, x_test, y_test = digits(args.seed)
    model = digits_resnet()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, args.lr, total_steps=len(batches(len(y), args.batch_size, args.epochs, 0))
    )
    start = time.perf_counter()
    for rows in batches(len(y), args.batch_size, args.epochs, args.seed):
        optimizer.zero_grad()
        cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.step()
        schedule.step()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        return {"seconds": seconds, "accuracy": accuracy(model(x_test), y_test)}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = gpipe.launch(pipelined, 2, (args,), threads=1)
    piped = {
        "accuracy": results[1]["accuracy"],
        "seconds": max(r["seconds"] for r in results.values()),
    }
    torch.set_num_threads(1)
    plain = unpipelined(args)
    print(
        f"pipelined (K=2, chunks={args.chunks}, checkpoint always, deferred BatchNorm): "
        f"test accuracy {piped['accuracy']:.1%} in {piped['seconds']:.0f} s"
    )
    print(
        f"without the pipeline, same mini-batches:                                  "
        f"test accuracy {plain['accuracy']:.1%} in {plain['seconds']:.0f} s"
    )
    return {"pipelined": piped, "unpipelined": plain}


if __name__ == "__main__":
    main()
