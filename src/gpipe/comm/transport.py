"""The contract of a transport, which moves boundary tensors between stages.

Two classes keep it: ``InProcessTransport`` (``in_process``) between stages of one process,
and ``DistributedTransport`` (``distributed``) between processes. The executor sends and
receives through it; ``Pipeline`` also opens its channels, starts each step and reads the
step's size from the first message.

Transports carry a tensor, a tuple whose items are tensors or None (a gradient nobody
needs), or any payload (``payload``: a pytree of tensors and plain values); they keep its
shape (a 1-tuple stays a 1-tuple) and each tensor's ``requires_grad``, so the receiving
stage knows which gradients to send back. Every wait is bounded: a peer that never answers
ends in a StageError naming the stage, and a call that failed leaves nothing that a later
call would take for its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from gpipe.comm.message import Message, what
from gpipe.comm.named_pipes import Pipes
from gpipe.schedules import Action, Kind

__all__ = ["Message", "Transport", "what"]


@runtime_checkable
class Transport(Protocol):
    """What the executor and the facades need of a transport: a class that has all of it is
    one. Stages are numbered in the pipeline; a channel is a (peer rank, tag) pair, as
    ``named_pipes.open_pipes`` takes them; ``skips`` are (stashing, popping) stage pairs."""

    info: tuple[int, ...]
    """The step's info words (micro-batch and row counts), carried by every message sent."""

    def new_call(self) -> int:
        """Begin the next call (a step, an evaluation, a forward), which every rank does in
        step, before anything else of the call; returns its number, the same on every rank.
        A message an earlier call sent and never received (it failed on some stage) is
        dropped as it arrives, not taken for this call's."""

    def channels(
        self, stages: Sequence[int], skips: Sequence[tuple[int, int]]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The channels to other processes that ``stages`` and ``skips`` receive and send on."""

    def use_pipes(self, pipes: Pipes | None) -> None:
        """Carry the channels that ``pipes`` has open over them from now on (None: none)."""

    def begin(self, programs: Sequence[Sequence[Action]], rank: int) -> None:
        """Get ready for a step in which rank ``rank`` runs ``programs[rank]``."""

    def peek(self, src: int, dst: int, kind: Kind) -> tuple[int, ...]:
        """The info words of the next message from stage ``src``, left to be received."""

    def send(self, message: Message, src: int, dst: int, microbatch: int, kind: Kind) -> None:
        """Send ``message`` from stage ``src`` to stage ``dst``; ``kind`` is a send kind."""

    def recv(self, src: int, dst: int, microbatch: int, kind: Kind) -> Message:
        """Receive what stage ``src`` sent to stage ``dst``; ``kind`` is the matching receive."""

    def flush(self) -> None:
        """Wait until every send has left, so its tensors may be freed or reused."""
