"""Moving boundary tensors between stages: in one process, or across processes.

Both transports carry a tensor, or a tuple whose items are tensors or None (a gradient nobody
needs), keep that shape (a 1-tuple stays a 1-tuple), and keep each tensor's
``requires_grad`` so the receiving stage knows which gradients to send back. Every wait is
bounded: a peer that never answers ends in a StageError naming the stage.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .errors import PipelineError, StageError
from .schedule import RECV_OF, Kind

__all__ = ["DistributedTransport", "InProcessTransport", "Message", "Transport"]

Message = Tensor | tuple[Tensor | None, ...]

_CARRIED = {
    Kind.RECV_F: "activations",
    Kind.RECV_B: "gradients",
    Kind.RECV_SKIP: "skip tensors",
    Kind.RECV_SKIP_B: "skip gradients",
}


def _what(kind: Kind, microbatch: int, src: int) -> str:
    return f"{_CARRIED[kind]} of micro-batch {microbatch} from stage {src}"


def _items(message: Message) -> tuple[Tensor | None, ...]:
    return (message,) if isinstance(message, Tensor) else tuple(message)


class Transport(Protocol):
    def send(self, message: Message, src: int, dst: int, microbatch: int, kind: Kind) -> None:
        """Send ``message`` from stage ``src`` to stage ``dst``; ``kind`` is a send kind."""

    def recv(self, src: int, dst: int, microbatch: int, kind: Kind) -> Message:
        """Receive what stage ``src`` sent to stage ``dst``; ``kind`` is the matching receive."""

    def flush(self) -> None:
        """Wait until every send has left, so its tensors may be freed or reused."""


class InProcessTransport:
    """Hands tensors between stages of one process, copying them to the receiver's device.

    Stages may run on different threads; a receive waits for the matching send, for at most
    ``timeout`` seconds, and gives up at once when ``abort`` is set by a failing peer.
    """

    def __init__(self, devices: Sequence[torch.device], timeout: float = 60.0) -> None:
        self._devices = list(devices)
        self._timeout = timeout
        self._box: dict[tuple[int, int, Kind, int], Message] = {}
        self._cond = threading.Condition()
        self.abort = threading.Event()

    def send(self, message: Message, src: int, dst: int, microbatch: int, kind: Kind) -> None:
        with self._cond:
            self._box[(src, dst, RECV_OF[kind], microbatch)] = message
            self._cond.notify_all()

    def recv(self, src: int, dst: int, microbatch: int, kind: Kind) -> Message:
        key = (src, dst, kind, microbatch)
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while key not in self._box:
                if self.abort.is_set():
                    raise PipelineError(f"stage {dst}: stopped because another stage failed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageError(
                        dst,
                        f"timed out after {self._timeout:g} s waiting for "
                        f"{_what(kind, microbatch, src)}",
                    )
                self._cond.wait(min(left, 0.1))
            message = self._box.pop(key)
        device = self._devices[dst]

        def moved(t: Tensor) -> Tensor:
            return t.detach().to(device, non_blocking=True).requires_grad_(t.requires_grad)

        if isinstance(message, Tensor):
            return moved(message)
        return tuple(None if t is None else moved(t) for t in message)

    def flush(self) -> None:
        pass

    def wake(self) -> None:
        """Let every waiting receive notice ``abort``."""
        with self._cond:
            self._cond.notify_all()


# --------------------------------------------------------------------------------------------
# Across processes: a fixed-size header says what follows, then one message per tensor.
# The header is [number of items, 1 if the message is a bare tensor, then per item its dtype
# code, requires_grad, number of dimensions and sizes, or -1 for None].

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
_HEADER = 32  # int64 slots; a longer description follows in a second message


def _header_words(message: Message) -> list[int]:
    items = _items(message)
    words = [len(items), int(isinstance(message, Tensor))]
    for t in items:
        if t is None:
            words.append(-1)
            continue
        if t.dtype not in _DTYPE_CODE:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between stages")
        words += [_DTYPE_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    return words


def _parse(words: list[int]) -> tuple[bool, list[tuple[torch.dtype, bool, list[int]] | None]]:
    """Whether the message is a bare tensor, and each item's dtype, requires_grad and shape."""
    items: list[tuple[torch.dtype, bool, list[int]] | None] = []
    pos = 2
    for _ in range(words[0]):
        code = words[pos]
        if code < 0:
            items.append(None)
            pos += 1
            continue
        ndim = words[pos + 2]
        items.append((_DTYPES[code], bool(words[pos + 1]), words[pos + 3 : pos + 3 + ndim]))
        pos += 3 + ndim
    return bool(words[1]), items


class DistributedTransport:
    """Point-to-point sends and receives over torch.distributed (gloo on CPU, NCCL on CUDA).

    ``stage_to_rank`` maps stages to ranks of ``group``. Sends are asynchronous and kept until
    ``flush``; receives wait at most ``timeout`` seconds. Shapes and dtypes travel in a header
    before the data, so they may change from micro-batch to micro-batch.
    """

    def __init__(
        self,
        stage_to_rank: Sequence[int],
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        timeout: float = 60.0,
    ) -> None:
        self._stage_to_rank = list(stage_to_rank)
        self._device = device
        self._group = group
        self._timeout = datetime.timedelta(seconds=timeout)
        self._timeout_s = timeout
        self._pending: list[tuple[dist.Work, Tensor]] = []
        self._me = dist.get_rank()
        # between two stages of this very process (interleaved on one rank): no network
        self._local: dict[int, deque[Message]] = {}

    def _peer(self, stage: int) -> int:
        rank = self._stage_to_rank[stage]
        return rank if self._group is None else dist.get_global_rank(self._group, rank)

    def _tag(self, kind: Kind, src: int, dst: int) -> int:
        """One tag per channel: forward and backward traffic into each stage, and each pair of
        stages that exchange skips, so that their messages never match each other's."""
        backward = kind in (Kind.SEND_B, Kind.RECV_B, Kind.SEND_SKIP_B, Kind.RECV_SKIP_B)
        if kind in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B):
            return 2 * dst + backward
        n = len(self._stage_to_rank)
        return 2 * n + 2 * (src * n + dst) + backward

    def _isend(self, tensor: Tensor, peer: int, tag: int) -> None:
        work = dist.isend(tensor, dst=peer, group=self._group, tag=tag)
        self._pending.append((work, tensor))

    def send(self, message: Message, src: int, dst: int, microbatch: int, kind: Kind) -> None:
        peer, tag = self._peer(dst), self._tag(kind, src, dst)
        if peer == self._me:
            self._local.setdefault(tag, deque()).append(message)
            return
        words = _header_words(message)
        header = torch.zeros(_HEADER, dtype=torch.int64)
        if len(words) <= _HEADER:
            header[: len(words)] = torch.tensor(words)
            self._isend(header.to(self._device), peer, tag)
        else:
            header[0] = -len(words)
            self._isend(header.to(self._device), peer, tag)
            self._isend(torch.tensor(words, dtype=torch.int64, device=self._device), peer, tag)
        for t in _items(message):
            if t is not None:
                self._isend(t.detach().contiguous(), peer, tag)

    def _irecv(
        self, buffer: Tensor, peer: int, tag: int, dst: int, src: int, microbatch: int, kind: Kind
    ) -> Tensor:
        try:
            dist.irecv(buffer, src=peer, group=self._group, tag=tag).wait(self._timeout)
        except RuntimeError as exc:
            text = str(exc).lower()
            reason = (
                f"timed out after {self._timeout_s:g} s"
                if "timed out" in text or "timeout" in text
                else f"lost stage {src} ({str(exc).splitlines()[0]})"
            )
            raise StageError(dst, f"{reason} waiting for {_what(kind, microbatch, src)}") from exc
        return buffer

    def recv(self, src: int, dst: int, microbatch: int, kind: Kind) -> Message:
        peer, tag = self._peer(src), self._tag(kind, src, dst)
        if peer == self._me:
            try:
                return self._local[tag].popleft()
            except (KeyError, IndexError):
                raise StageError(dst, f"nothing sent yet: {_what(kind, microbatch, src)}") from None
        where = (dst, src, microbatch, kind)
        header = torch.empty(_HEADER, dtype=torch.int64, device=self._device)
        words = self._irecv(header, peer, tag, *where).tolist()
        if words[0] < 0:
            extended = torch.empty(-words[0], dtype=torch.int64, device=self._device)
            words = self._irecv(extended, peer, tag, *where).tolist()
        bare, items = _parse(words)
        message: list[Tensor | None] = []
        for item in items:
            if item is None:
                message.append(None)
                continue
            dtype, requires_grad, shape = item
            buffer = torch.empty(shape, dtype=dtype, device=self._device)
            message.append(self._irecv(buffer, peer, tag, *where).requires_grad_(requires_grad))
        return message[0] if bare else tuple(message)  # type: ignore[return-value]

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait(self._timeout)
