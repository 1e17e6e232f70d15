"""Moving boundary tensors between stages: the protocol, and the transport within a process
(``p2p.DistributedTransport`` moves them between processes).

Transports carry a tensor, a tuple whose items are tensors or None (a gradient nobody
needs), or any payload (``payload``: a pytree of tensors and plain values); they keep its
shape (a 1-tuple stays a 1-tuple) and each tensor's ``requires_grad``, so the receiving
stage knows which gradients to send back. Every wait is
bounded: a peer that never answers ends in a StageError naming the stage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from gpipe.comm import payload
from gpipe.comm.copy_streams import DeviceCopies, Ready
from gpipe.errors import PipelineError, StageError
from gpipe.schedules import RECV_OF, Kind

__all__ = ["InProcessTransport", "Message", "Transport", "what"]

Message = Tensor | tuple[Tensor | None, ...] | Any

_CARRIED = {
    Kind.RECV_F: "activations",
    Kind.RECV_B: "gradients",
    Kind.RECV_SKIP: "skip tensors",
    Kind.RECV_SKIP_B: "skip gradients",
}


def what(kind: Kind, microbatch: int, src: int) -> str:
    return f"{_CARRIED[kind]} of micro-batch {microbatch} from stage {src}"


class Transport(Protocol):
    def send(self, message: Message, src: int, dst: int, microbatch: int, kind: Kind) -> None:
        """Send ``message`` from stage ``src`` to stage ``dst``; ``kind`` is a send kind."""

    def recv(self, src: int, dst: int, microbatch: int, kind: Kind) -> Message:
        """Receive what stage ``src`` sent to stage ``dst``; ``kind`` is the matching receive."""

    def flush(self) -> None:
        """Wait until every send has left, so its tensors may be freed or reused."""


class InProcessTransport:
    """Hands tensors between stages of one process, copying them to the receiver's device
    (between GPUs on copy streams: ``copies``).

    Stages may run on different threads; a receive waits for the matching send, for at most
    ``timeout`` seconds, and gives up at once when ``abort`` is set by a failing peer.
    """

    def __init__(
        self,
        devices: Sequence[torch.device],
        timeout: float = 60.0,
        copies: DeviceCopies | None = None,
    ) -> None:
        self._devices = list(devices)
        self._timeout = timeout
        self._copies = copies if copies is not None else DeviceCopies()
        self._box: dict[tuple[int, int, Kind, int], tuple[Message, Ready | None]] = {}
        self._cond = threading.Condition()
        self.abort = threading.Event()

    def send(self, message: Message, src: int, dst: int, microbatch: int, kind: Kind) -> None:
        ready = self._copies.mark(self._devices[src], self._devices[dst])
        with self._cond:
            self._box[(src, dst, RECV_OF[kind], microbatch)] = (message, ready)
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
                        f"{what(kind, microbatch, src)}",
                    )
                self._cond.wait(min(left, 0.1))
            message, ready = self._box.pop(key)
        device, copies = self._devices[dst], self._copies

        def moved(t: Tensor) -> Tensor:
            return copies.move(t, device, ready).requires_grad_(t.requires_grad)

        if isinstance(message, Tensor):
            return moved(message)
        if payload.is_flat(message):
            return tuple(None if t is None else moved(t) for t in message)
        tensors = payload.tensors_of(message)
        return payload.with_tensors(message, [moved(t) for t in tensors])

    def flush(self) -> None:
        pass

    def wake(self) -> None:
        """Let every waiting receive notice ``abort``."""
        with self._cond:
            self._cond.notify_all()
