"""The wire format between processes: a message's description and its tensors in one buffer.

A message is a tensor, or a tuple of tensors and Nones. On the wire it is one contiguous
byte buffer, so that one transfer carries it whole and the receiver needs no second round
trip to learn what follows:

    int64 words   kind, total bytes, number of items, 1 if a bare tensor, info words...,
                  then per item: dtype code, requires_grad, ndim, sizes...   (-1 for None)
    payload       each tensor's bytes, every one starting on a 64-byte boundary

``info`` words ride along with every message (the step's micro-batch and row counts), so
that a stage learns them from its first input instead of from a collective. A *grow*
envelope carries no message: it tells the receiver to post bigger buffers from now on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "GROW",
    "MESSAGE",
    "Described",
    "describe",
    "grow_envelope",
    "pack",
    "read",
]

MESSAGE, GROW = 1, 2
N_INFO = 2  # words of step information in every envelope
_ALIGN = 64
_FIXED = 4 + N_INFO  # kind, total bytes, items, bare, info

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Described:
    """What an envelope says: the header words, and where each tensor lies in the buffer."""

    words: list[int]
    offsets: list[int]  # payload offset of each item (-1 for None)
    total: int  # bytes of the whole buffer: header and payload

    @property
    def header_bytes(self) -> int:
        return 8 * len(self.words)


def describe(items: tuple[Tensor | None, ...], bare: bool, info: tuple[int, ...]) -> Described:
    """The header of ``items`` and the layout of their bytes after it."""
    if len(info) != N_INFO:
        raise ValueError(f"an envelope carries {N_INFO} info words, got {len(info)}")
    words = [MESSAGE, 0, len(items), int(bare), *info]
    for t in items:
        if t is None:
            words.append(-1)
            continue
        if t.dtype not in _DTYPE_CODE:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between stages")
        words += [_DTYPE_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    offsets, position = [], _aligned(8 * len(words))
    for t in items:
        if t is None:
            offsets.append(-1)
            continue
        offsets.append(position)
        position = _aligned(position + t.numel() * t.element_size())
    words[1] = position
    return Described(words, offsets, position)


def pack(items: tuple[Tensor | None, ...], described: Described) -> Tensor:
    """One CPU byte buffer holding the header and a copy of every tensor."""
    buffer = torch.empty(described.total, dtype=torch.uint8)
    header = torch.tensor(described.words, dtype=torch.int64)
    buffer[: described.header_bytes].view(torch.int64).copy_(header)
    for t, offset in zip(items, described.offsets, strict=True):
        if t is not None:
            size = t.numel() * t.element_size()
            buffer[offset : offset + size].view(t.dtype).view(t.shape).copy_(t.detach())
    return buffer


def grow_envelope(capacity: int) -> Tensor:
    """A header-only buffer that tells the receiver its buffers must hold ``capacity`` bytes."""
    words = [GROW, capacity, 0, 0, *([0] * N_INFO)]
    return torch.tensor(words, dtype=torch.int64).view(torch.uint8)


def header_words(buffer: Tensor) -> list[int]:
    """The int64 words at the start of a received buffer: the fixed ones, then the items'."""
    head = buffer[: 8 * _FIXED].view(torch.int64).tolist()
    if head[0] != MESSAGE:
        return head
    n_items = head[2]
    words, needed = head, _FIXED + 3 * n_items
    while len(words) < needed:  # each item needs at least 3 words; shapes add more
        words = buffer[: 8 * needed].view(torch.int64).tolist()
        needed = _FIXED + _item_words(words[_FIXED:], n_items)
    return words


def _item_words(words: list[int], n_items: int) -> int:
    """How many words the first ``n_items`` item descriptions take, as far as known."""
    position = 0
    for _ in range(n_items):
        if position >= len(words):
            return position + 3  # not read yet: at least three more
        if words[position] < 0:
            position += 1
        elif position + 2 >= len(words):
            return position + 3
        else:
            position += 3 + words[position + 2]
    return position


def read(
    buffer: Tensor, words: list[int]
) -> tuple[tuple[Tensor | None, ...], bool, tuple[int, ...], int]:
    """The items of a received MESSAGE buffer as views into it, whether the message was a
    bare tensor, its info words and the bytes it used."""
    n_items, bare = words[2], bool(words[3])
    info = tuple(words[4 : 4 + N_INFO])
    position, offset = _FIXED, _aligned(8 * (_FIXED + _item_words(words[_FIXED:], n_items)))
    items: list[Tensor | None] = []
    for _ in range(n_items):
        code = words[position]
        if code < 0:
            items.append(None)
            position += 1
            continue
        requires_grad, ndim = bool(words[position + 1]), words[position + 2]
        shape = words[position + 3 : position + 3 + ndim]
        position += 3 + ndim
        dtype = _DTYPES[code]
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        t = buffer[offset : offset + nbytes].view(dtype).view(shape)
        items.append(t.requires_grad_(requires_grad) if requires_grad else t)
        offset = _aligned(offset + nbytes)
    return tuple(items), bare, info, words[1]
