"""Splitting a mini-batch into micro-batches along dim 0 and joining the results back.

A batch is what a layer takes and returns at a stage boundary: one tensor, or a tuple of
tensors (a 1-tuple stays a 1-tuple), as in torchgpipe. ``Pipeline`` also takes any payload
(``gpipe.comm.payload``: dicts, dataclasses, ``ModelOutput`` ...): its rows are dim 0 of its first
tensor leaf that has dimensions, and a leaf is *batched*, split with the rows, when it is a
tensor whose dim 0 has that size; every other leaf (plain values, 0-d tensors, tensors of
another length) is given whole to every micro-batch.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from typing import Any, SupportsIndex

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from gpipe.comm import payload

__all__ = [
    "Batch",
    "as_tuple",
    "check_batch",
    "check_chunks",
    "check_payload",
    "gather",
    "gather_payload",
    "like",
    "payload_to",
    "scatter",
    "scatter_payload",
    "split_sizes",
]

Batch = Tensor | tuple[Tensor, ...]


def as_tuple(batch: Tensor | Sequence[Tensor]) -> tuple[Tensor, ...]:
    """The tensors of ``batch``, as a tuple."""
    return (batch,) if isinstance(batch, Tensor) else tuple(batch)


def like(batch: Batch, items: Sequence[Tensor]) -> Batch:
    """``items`` in the shape of ``batch``: a tensor if it is one, else a tuple."""
    if isinstance(batch, Tensor):
        (item,) = items
        return item
    return tuple(items)


def _type_names(value: object) -> str:
    given = type(value).__name__
    if isinstance(value, (tuple, list)):
        given += "[" + ", ".join(type(v).__name__ for v in value) + "]"
    return given


def check_batch(value: object, name: str = "input", *, batched: bool = True) -> Batch:
    """A tensor or a non-empty tuple of tensors (a list is taken as a tuple); with
    ``batched``, each has a batch dimension and they share its size."""
    if isinstance(value, Tensor):
        batch: Batch = value
    elif isinstance(value, (tuple, list)) and value and all(isinstance(v, Tensor) for v in value):
        batch = tuple(value)
    else:
        raise TypeError(f"{name} must be a Tensor or a tuple of Tensors, got {_type_names(value)}")
    if not batched:
        return batch
    items = as_tuple(batch)
    for k, t in enumerate(items):
        if t.dim() == 0:
            where = name if isinstance(batch, Tensor) else f"{name}[{k}]"
            raise ValueError(f"{where} is a 0-d tensor; it needs a batch dimension (dim 0)")
    rows = {t.size(0) for t in items}
    if len(rows) > 1:
        sizes = [t.size(0) for t in items]
        raise ValueError(f"{name} tensors must share their batch size (dim 0), got {sizes}")
    if items[0].size(0) == 0:
        raise ValueError(f"{name} has an empty batch (dim 0 is 0)")
    return batch


def check_chunks(chunks: object) -> int:
    """``chunks`` as an int: any integer type, or an integral float such as ``42.0``, is taken,
    as torchgpipe takes them."""
    value = 0  # refused below unless chunks is a positive integer
    if isinstance(chunks, float) and chunks.is_integer():
        value = int(chunks)
    elif isinstance(chunks, SupportsIndex):
        with contextlib.suppress(TypeError):  # a tensor of floats has __index__, and refuses
            value = operator.index(chunks)
    if isinstance(chunks, bool) or value <= 0:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    return value


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
    items = as_tuple(batch)
    sizes = split_sizes(items[0].size(0), chunks)
    parts = [t.split(sizes, dim=0) for t in items]
    return [like(batch, [p[i] for p in parts]) for i in range(len(sizes))]


def gather(microbatches: Sequence[Batch]) -> Batch:
    """Concatenate micro-batch outputs back into one batch along dim 0."""
    first = microbatches[0]
    if len(microbatches) == 1:
        return first
    columns = zip(*(as_tuple(mb) for mb in microbatches), strict=True)
    return like(first, [torch.cat(parts, dim=0) for parts in columns])


def _rows_of(leaves: Sequence[Any]) -> int | None:
    return next((t.size(0) for t in leaves if isinstance(t, Tensor) and t.dim() > 0), None)


def check_payload(value: object, name: str = "inputs") -> int:
    """The rows of a payload: a tensor or tuple of tensors as ``check_batch`` takes them, or
    any pytree with a tensor leaf that has a batch dimension."""
    if payload.is_flat(value) and not (isinstance(value, tuple) and None in value):
        return as_tuple(check_batch(value, name))[0].size(0)
    leaves = payload.tensors_of(value)
    rows = _rows_of(leaves)
    if rows is None:
        kinds = ", ".join(sorted({type(v).__name__ for v in pytree.tree_leaves(value)}))
        raise TypeError(
            f"{name} must hold a tensor with a batch dimension (dim 0) to split into "
            f"micro-batches; its leaves are {kinds or 'none'}"
        )
    if rows == 0:
        raise ValueError(f"{name} has an empty batch (dim 0 is 0)")
    return rows


def payload_to(value: Any, device: torch.device) -> Any:
    """A payload with its tensors on ``device``."""
    tensors = payload.tensors_of(value)
    return payload.with_tensors(value, [t.to(device) for t in tensors])


def _batched(leaf: object, rows: int) -> bool:
    return isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.size(0) == rows


def scatter_payload(value: Any, chunks: int) -> list[Any]:
    """Micro-batches of a payload: its batched leaves split along dim 0, the others whole."""
    if payload.is_flat(value) and not (isinstance(value, tuple) and None in value):
        return scatter(value, chunks)
    leaves, spec = payload.flatten(value)
    rows = _rows_of(leaves)
    assert rows is not None, "check_payload first"
    sizes = split_sizes(rows, chunks)
    parts = [leaf.split(sizes) if _batched(leaf, rows) else None for leaf in leaves]
    return [
        pytree.tree_unflatten(
            [leaf if part is None else part[i] for leaf, part in zip(leaves, parts, strict=True)],
            spec,
        )
        for i in range(len(sizes))
    ]


def gather_payload(microbatches: Sequence[Any]) -> Any:
    """The micro-batches' payloads joined: tensors with dimensions concatenated along dim 0,
    0-d tensors stacked (one value per micro-batch), plain values kept where every
    micro-batch has the same, else listed."""
    first = microbatches[0]
    if payload.is_flat(first) and not (isinstance(first, tuple) and None in first):
        return gather(microbatches)
    if len(microbatches) == 1:
        return first
    flat = [payload.flatten(mb) for mb in microbatches]
    spec = flat[0][1]
    joined: list[object] = []
    for column in zip(*(leaves for leaves, _ in flat), strict=True):
        head = column[0]
        if isinstance(head, Tensor):
            joined.append(torch.cat(column) if head.dim() > 0 else torch.stack(column))
        elif all(v == head for v in column[1:]):
            joined.append(head)
        else:
            joined.append(list(column))
    return pytree.tree_unflatten(joined, spec)
