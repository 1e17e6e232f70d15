"""The transport between stages of one process: a hand-over box, with copies between devices."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from gpipe.comm import envelope, payload
from gpipe.comm.copy_streams import DeviceCopies, Ready
from gpipe.comm.message import Message, what
from gpipe.comm.named_pipes import Pipes
from gpipe.errors import PipelineError, StageError
from gpipe.schedules import RECV_OF, Action, Kind

__all__ = ["InProcessTransport"]

_Key = tuple[int, int, Kind, int]  # (source stage, destination stage, receive kind, micro-batch)
_Found = TypeVar("_Found")


class InProcessTransport:
    """Hands tensors between stages of one process, copying them to the receiver's device
    (between GPUs on copy streams: ``copies``).

    Stages may run on different threads; a receive waits for the matching send, for at most
    ``timeout`` seconds, and gives up at once when ``abort`` is set by a failing peer (then
    ``wake`` lets the waiting receives see it). Every stage lives in this process, so there
    is nothing to post ahead and no channel to another process.
    """

    info: tuple[int, ...] = (0,) * (envelope.N_INFO - 1)  # the step's words, as carried

    def __init__(
        self,
        devices: Sequence[torch.device],
        timeout: float = 60.0,
        copies: DeviceCopies | None = None,
    ) -> None:
        self._devices = list(devices)
        self._timeout = timeout
        self._copies = copies if copies is not None else DeviceCopies()
        self._box: dict[_Key, tuple[Message, Ready | None, tuple[int, ...]]] = {}
        self._cond = threading.Condition()
        self.abort = threading.Event()
        self._calls = 0  # calls begun (``new_call``)

    def channels(
        self, stages: Sequence[int], skips: Sequence[tuple[int, int]]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """None: every stage is in this process."""
        return [], []

    def use_pipes(self, pipes: Pipes | None) -> None:
        """Pipes reach other processes, and no stage is in another: only None is taken."""
        if pipes is not None:
            raise PipelineError("an in-process transport has no other process to reach")

    def new_call(self) -> int:
        """Forget what a failed call left sent and never received; the call's number."""
        with self._cond:
            self._box.clear()
        self._calls += 1
        return self._calls

    def begin(self, programs: Sequence[Sequence[Action]], rank: int) -> None:
        """Nothing to post ahead: a send puts its message straight where the receive looks."""

    def send(self, message: Message, src: int, dst: int, microbatch: int, kind: Kind) -> None:
        ready = self._copies.mark(self._devices[src], self._devices[dst])
        with self._cond:
            self._box[(src, dst, RECV_OF[kind], microbatch)] = (message, ready, self.info)
            self._cond.notify_all()

    def peek(self, src: int, dst: int, kind: Kind) -> tuple[int, ...]:
        """The info words of the earliest micro-batch's message from stage ``src``, which
        stays to be received."""

        def earliest() -> _Key | None:
            sent = [key for key in self._box if key[:3] == (src, dst, kind)]
            return min(sent, key=lambda key: key[3], default=None)

        with self._cond:
            key = self._wait_for(earliest, dst, what(kind, 0, src))
            return self._box[key][2]

    def recv(self, src: int, dst: int, microbatch: int, kind: Kind) -> Message:
        key = (src, dst, kind, microbatch)
        with self._cond:
            self._wait_for(
                lambda: key if key in self._box else None, dst, what(kind, microbatch, src)
            )
            message, ready, _ = self._box.pop(key)
        device, copies = self._devices[dst], self._copies

        def moved(t: Tensor) -> Tensor:
            return copies.move(t, device, ready).requires_grad_(t.requires_grad)

        if isinstance(message, Tensor):
            return moved(message)
        if payload.is_flat(message):
            return tuple(None if t is None else moved(t) for t in message)
        tensors = payload.tensors_of(message)
        return payload.with_tensors(message, [moved(t) for t in tensors])

    def _wait_for(self, find: Callable[[], _Found | None], dst: int, awaited: str) -> _Found:
        """Wait, holding ``_cond``, until ``find`` finds something, ``abort`` is set or the
        timeout passes."""
        deadline = time.monotonic() + self._timeout
        while (found := find()) is None:
            if self.abort.is_set():
                raise PipelineError(f"stage {dst}: stopped because another stage failed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise StageError(dst, f"timed out after {self._timeout:g} s waiting for {awaited}")
            self._cond.wait(min(left, 0.1))
        return found

    def flush(self) -> None:
        """Nothing to wait for: a send has handed its message over when it returns."""

    def wake(self) -> None:
        """Let every waiting receive notice ``abort``."""
        with self._cond:
            self._cond.notify_all()
