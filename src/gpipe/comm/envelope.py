"""The wire format between processes: a message's description and its tensors together.

A message is a tensor, a tuple of tensors and Nones, or any payload (``payload``): its
tensors, and the pickled structure that puts them back in place. On the wire it is its
header, int64 words, followed by the bytes of every tensor, so that one transfer carries it
whole and the receiver needs no second round trip to learn what follows:

    kind, total bytes, header words, number of items, form, structure bytes, info words...,
    then per item: dtype code, requires_grad, ndim, sizes...        (-1 for None),
    then the structure's bytes, in as many words as they fill

``form`` says how the tensors make up the message (``payload.FLAT_TUPLE``, ``TENSOR`` or
``TREE``); only a tree has structure bytes.

Laid out as one buffer (``aligned``), every tensor starts on a 64-byte boundary, so that the
receiver can use views into the buffer it received; laid out as a stream (pipes), the bytes
follow each other and the receiver reads each tensor into storage of its own.

``info`` words ride along with every message: the number of the call it belongs to (a step, an
evaluation, a forward: ``Transport.new_call``), so that what a failed call left on the wire is
told apart from the next call's messages, and the step's micro-batch and row counts, so that a
stage learns them from its first input instead of from a collective. A *grow*
envelope carries no message: it tells the receiver to post bigger buffers from now on. An
*abort* envelope carries none either: it says that a stage failed in a call, and with what
error (``Abort``), so that a peer waiting in that call raises at once rather than at its
timeout; its words are a message's with no items, the call, the stage and the error's bytes
in the places of the info and the structure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "ABORT",
    "FIXED_BYTES",
    "GROW",
    "MESSAGE",
    "Abort",
    "abort_envelope",
    "abort_of",
    "N_INFO",
    "Described",
    "Item",
    "describe",
    "grow_envelope",
    "header_words",
    "items_of",
    "pack",
    "read",
]

MESSAGE, GROW, ABORT = 1, 2, 3
N_INFO = 3  # words of information in every envelope: the call, then the step's two
_ALIGN = 64
_ERROR_BYTES = 1024  # of an abort's error, at most: it fits any receive a channel posts
_FIXED = 6 + N_INFO  # kind, total bytes, header words, items, form, structure bytes, info
FIXED_BYTES = 8 * _FIXED

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
class Item:
    """One tensor of a message as its header describes it."""

    dtype: torch.dtype
    requires_grad: bool
    shape: list[int]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class Described:
    """A message's header words, and where each tensor's bytes begin (-1 for None)."""

    words: list[int]
    offsets: list[int]
    total: int  # bytes of the whole message: header and payload

    @property
    def header_bytes(self) -> int:
        return 8 * len(self.words)


def describe(
    items: tuple[Tensor | None, ...],
    form: int,
    info: tuple[int, ...],
    structure: bytes = b"",
    *,
    aligned: bool = True,
) -> Described:
    """The header of ``items`` (and of the ``structure`` they fill) and the layout of their
    bytes after it."""
    if len(info) != N_INFO:
        raise ValueError(f"an envelope carries {N_INFO} info words, got {len(info)}")
    words = [MESSAGE, 0, 0, len(items), form, len(structure), *info]
    for t in items:
        if t is None:
            words.append(-1)
            continue
        if t.dtype not in _DTYPE_CODE:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between stages")
        words += [_DTYPE_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    if structure:
        padded = structure + bytes(-len(structure) % 8)
        words += torch.frombuffer(bytearray(padded), dtype=torch.int64).tolist()
    words[2] = len(words)
    step = _aligned if aligned else (lambda n: n)
    offsets, position = [], step(8 * len(words))
    for t in items:
        if t is None:
            offsets.append(-1)
            continue
        offsets.append(position)
        position = step(position + t.numel() * t.element_size())
    words[1] = position
    return Described(words, offsets, position)


def header(described: Described) -> Tensor:
    """The header words as a byte tensor."""
    return torch.tensor(described.words, dtype=torch.int64).view(torch.uint8)


def pack(items: tuple[Tensor | None, ...], described: Described) -> Tensor:
    """One CPU byte buffer holding the header and a copy of every tensor."""
    buffer = torch.empty(described.total, dtype=torch.uint8)
    buffer[: described.header_bytes].copy_(header(described))
    for t, offset in zip(items, described.offsets, strict=True):
        if t is not None:
            size = t.numel() * t.element_size()
            buffer[offset : offset + size].view(t.dtype).view(t.shape).copy_(t.detach())
    return buffer


def grow_envelope(capacity: int) -> Tensor:
    """A header-only buffer that tells the receiver its buffers must hold ``capacity`` bytes."""
    words = [GROW, capacity, _FIXED, 0, 0, 0, *([0] * N_INFO)]
    return torch.tensor(words, dtype=torch.int64).view(torch.uint8)


class Abort(NamedTuple):
    """Stage ``stage`` failed in call number ``call`` with ``error`` (one line)."""

    call: int
    stage: int
    error: str


def abort_envelope(abort: Abort) -> Tensor:
    """The envelope that tells a peer of ``abort``: header words alone, the error's bytes
    (cut to 1 KiB) where a message's structure goes."""
    said = abort.error.encode()[:_ERROR_BYTES]
    padded = said + bytes(-len(said) % 8)
    text = torch.frombuffer(bytearray(padded), dtype=torch.int64).tolist() if padded else []
    words = [ABORT, 0, _FIXED + len(text), 0, 0, len(said), abort.call, abort.stage, 0, *text]
    words[1] = 8 * len(words)
    return torch.tensor(words, dtype=torch.int64).view(torch.uint8)


def abort_of(info: tuple[int, ...], said: bytes) -> Abort:
    """The abort of an ABORT envelope whose header (``items_of``) gives ``info`` and the
    structure ``said``."""
    return Abort(info[0], info[1], said.decode(errors="replace"))


def header_words(buffer: Tensor) -> list[int]:
    """The header's int64 words at the start of a received buffer."""
    head = buffer[:FIXED_BYTES].view(torch.int64).tolist()
    if head[0] == GROW or head[2] == _FIXED:
        return head
    return buffer[: 8 * head[2]].view(torch.int64).tolist()


def items_of(words: list[int]) -> tuple[list[Item | None], int, tuple[int, ...], bytes]:
    """What a MESSAGE (or ABORT) header describes: its items, their form, its info and
    structure."""
    n_items, form, n_structure = words[3], words[4], words[5]
    info = tuple(words[6 : 6 + N_INFO])
    items: list[Item | None] = []
    position = _FIXED
    for _ in range(n_items):
        code = words[position]
        if code < 0:
            items.append(None)
            position += 1
            continue
        ndim = words[position + 2]
        shape = words[position + 3 : position + 3 + ndim]
        items.append(Item(_DTYPES[code], bool(words[position + 1]), shape))
        position += 3 + ndim
    structure = b""
    if n_structure:
        packed = torch.tensor(words[position : position + -(-n_structure // 8)], dtype=torch.int64)
        structure = packed.view(torch.uint8).numpy().tobytes()[:n_structure]
    return items, form, info, structure


def read(
    buffer: Tensor, words: list[int]
) -> tuple[tuple[Tensor | None, ...], int, tuple[int, ...], int, bytes]:
    """The items of a received MESSAGE buffer (``aligned`` layout) as views into it, their
    form, the info words, the bytes it used and the structure."""
    described, form, info, structure = items_of(words)
    offset = _aligned(8 * words[2])
    items: list[Tensor | None] = []
    for item in described:
        if item is None:
            items.append(None)
            continue
        t = buffer[offset : offset + item.nbytes].view(item.dtype).view(item.shape)
        items.append(t.requires_grad_(True) if item.requires_grad else t)
        offset = _aligned(offset + item.nbytes)
    return tuple(items), form, info, words[1], structure
