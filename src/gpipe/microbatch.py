"""Splitting a mini-batch into micro-batches along dim 0 and joining the results back."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["Batch", "as_tuple", "check_batch", "gather", "scatter", "split_sizes", "unpack"]

# A micro-batch as the pipeline carries it: always a tuple of tensors.
Batch = tuple[Tensor, ...]


def as_tuple(value: Tensor | Sequence[Tensor]) -> Batch:
    return (value,) if isinstance(value, Tensor) else tuple(value)


def unpack(batch: Batch) -> Tensor | Batch:
    """What a layer receives: the tensor itself for a batch of one tensor, else the tuple."""
    return batch[0] if len(batch) == 1 else batch


def check_batch(value: object, name: str = "input") -> Batch:
    """A tensor or a non-empty tuple/list of tensors, each with a batch dimension."""
    if isinstance(value, Tensor):
        items: Batch = (value,)
    elif isinstance(value, (tuple, list)) and value and all(isinstance(v, Tensor) for v in value):
        items = tuple(value)
    else:
        given = type(value).__name__
        if isinstance(value, (tuple, list)):
            given += "[" + ", ".join(type(v).__name__ for v in value) + "]"
        raise TypeError(f"{name} must be a Tensor or a tuple of Tensors, got {given}")
    for k, t in enumerate(items):
        if t.dim() == 0:
            raise ValueError(f"{name}[{k}] is a 0-d tensor; it needs a batch dimension (dim 0)")
    rows = {t.size(0) for t in items}
    if len(rows) > 1:
        sizes = [t.size(0) for t in items]
        raise ValueError(f"{name} tensors must share their batch size (dim 0), got {sizes}")
    if items[0].size(0) == 0:
        raise ValueError(f"{name} has an empty batch (dim 0 is 0)")
    return items


def split_sizes(rows: int, chunks: int) -> list[int]:
    """Micro-batch sizes: as even as possible, larger first, never empty.

    10 rows in 4 chunks give [3, 3, 2, 2]; 3 rows in 8 chunks give three micro-batches of 1.
    """
    if rows < 1:
        raise ValueError(f"cannot split {rows} rows into micro-batches")
    n = min(chunks, rows)
    base, extra = divmod(rows, n)
    return [base + 1 if i < extra else base for i in range(n)]


def scatter(batch: Batch, chunks: int) -> list[Batch]:
    """Split every tensor of ``batch`` along dim 0 into at most ``chunks`` micro-batches."""
    sizes = split_sizes(batch[0].size(0), chunks)
    parts = [t.split(sizes, dim=0) for t in batch]
    return [tuple(p[i] for p in parts) for i in range(len(sizes))]


def gather(microbatches: Sequence[Batch]) -> Batch:
    """Concatenate micro-batch outputs back into one batch along dim 0."""
    if len(microbatches) == 1:
        return microbatches[0]
    return tuple(torch.cat(parts, dim=0) for parts in zip(*microbatches, strict=True))
