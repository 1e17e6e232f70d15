"""The receiving side of ``DistributedTransport``: receives posted ahead on every channel.

At the start of a step one receive is posted per channel that will carry anything, and the
next one as soon as the previous message is taken. A *grow* envelope makes the channel post
bigger buffers from then on. With separate envelopes (CUDA), a peer's tensors arrive in the
order it sent them whatever their channel, so the messages sent before the one asked for are
taken first and kept, each for its own channel.

A message of an earlier call (one that failed on some stage before it received everything
sent to it) is dropped as it arrives, and the channel waits for the next; one of the next
call (its sender ended this call early) is kept for that call, and ends this one.

An *abort* (``envelope.Abort``: a peer's call failed) ends the call it belongs to at once,
in a StageError that names the stage that failed and its error, and is kept as ``heard``
for the transport to pass on; an abort of an earlier call is dropped like any message of
one, and one of a later call ends this call as that call's messages do.
"""

from __future__ import annotations

import datetime
import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe.comm import envelope, payload
from gpipe.comm.channel_map import ChannelMap
from gpipe.comm.message import Message, what
from gpipe.comm.named_pipes import PipeClosed, Pipes, PipeTimeout
from gpipe.errors import PipelineError, StageError
from gpipe.schedules import RECV_KINDS, RECV_OF, SEND_KINDS, Action, Kind

__all__ = ["FIRST_CAPACITY", "ReceiveAhead"]

FIRST_CAPACITY = 16 * 1024  # bytes a channel's buffers hold until a message needs more

_Channel = tuple[int, int, Kind]  # (source stage, destination stage, receive kind)


@dataclass
class _Arrived:
    """A message taken off the wire, with what its envelope said."""

    message: Message
    info: tuple[int, ...]  # the step's words
    channel: _Channel
    call: int  # the number of the call it was sent in
    abort: envelope.Abort | None = None  # an abort in place of a message


@dataclass
class _Inbox:
    """One receiving channel: the receive posted on it, messages taken but not yet asked for,
    and how many more to post this step."""

    capacity: int = FIRST_CAPACITY
    posted: tuple[dist.Work, Tensor] | None = None
    ready: deque[_Arrived] = field(default_factory=deque)
    to_post: int = 0


def _failed(abort: envelope.Abort, waited_for: str) -> str:
    return f"stopped waiting for {waited_for}: stage {abort.stage} failed: {abort.error}"


def _ended_early(src: int, waited_for: str) -> str:
    return (
        f"stage {src} ended this step early and began the next (it failed, or gave up "
        f"waiting) while this one waited for {waited_for}"
    )


@functools.lru_cache(maxsize=64)
def _receives(program: tuple[Action, ...]) -> dict[_Channel, int]:
    """How many messages each (source stage, destination stage, kind) channel brings."""
    counts: dict[_Channel, int] = {}
    for a in program:
        if a.kind in RECV_KINDS:
            assert a.other_stage is not None  # a receive names its source
            key = (a.other_stage, a.stage, a.kind)
            counts[key] = counts.get(key, 0) + 1
    return counts


class ReceiveAhead:
    """Receives of this process (global rank ``me``) over ``channels``: envelopes on
    ``envelope_group``, and with ``separate`` the tensors after them on ``group``, into
    ``device``'s memory; from the peers ``pipes`` reach, over the pipes instead."""

    def __init__(
        self,
        channels: ChannelMap,
        device: torch.device,
        group: dist.ProcessGroup | None,
        envelope_group: dist.ProcessGroup | None,
        separate: bool,
        timeout: float,
    ) -> None:
        self._channels = channels
        self._device = device
        self._group = group
        self._envelope_group = envelope_group
        self._separate = separate
        self._timeout = datetime.timedelta(seconds=timeout)
        self._timeout_s = timeout
        self._me = dist.get_rank()
        self._inboxes: dict[tuple[int, int], _Inbox] = {}  # (peer rank, tag)
        # separate envelopes: each peer's messages to this process in the order it sends them
        self._sends_from: dict[int, deque[_Channel]] = {}
        self.pipes: Pipes | None = None
        self._call = 0  # the call whose messages are taken: earlier ones are dropped
        self._channel_of: dict[tuple[int, int], _Channel] = {}  # each inbox's, for the watch
        self.heard: envelope.Abort | None = None  # the abort that ended this call here

    def new_call(self, call: int) -> None:
        """Take the messages of call ``call`` from now on; those of earlier calls, kept or
        still to arrive, are dropped (one of this call's, which ended the last call here
        early, is kept)."""
        self._call = call
        self.heard = None
        for inbox in self._inboxes.values():
            inbox.ready = deque(a for a in inbox.ready if a.call >= call)

    def _inbox(self, src: int, dst: int, kind: Kind) -> tuple[tuple[int, int], _Inbox]:
        key = (self._channels.rank(src), self._channels.tag(kind, src, dst))
        inbox = self._inboxes.get(key)
        if inbox is None:
            inbox = self._inboxes[key] = _Inbox()
            self._channel_of[key] = (src, dst, kind)
        return key, inbox

    def _piped(self, key: tuple[int, int]) -> bool:
        return self.pipes is not None and key in self.pipes.incoming

    def begin(self, programs: Sequence[Sequence[Action]], rank: int) -> None:
        """Post the first receive of every channel that rank ``rank``'s program receives on
        (``programs`` are every rank's, in the pipeline group's numbering)."""
        program = tuple(programs[rank])
        if self._separate:
            self._plan_order(programs, rank)
        for (src, dst, kind), count in _receives(program).items():
            if self._channels.rank(src) == self._me:
                continue
            key, inbox = self._inbox(src, dst, kind)
            if self._piped(key):
                continue  # the kernel holds what arrives: nothing to post
            inbox.to_post = count - len(inbox.ready) - (inbox.posted is not None)
            if inbox.to_post < 0:
                raise PipelineError(f"stage {dst}: more messages arrived than the step expects")
            if inbox.posted is None and inbox.to_post:
                self._post(key, inbox)

    def _plan_order(self, programs: Sequence[Sequence[Action]], rank: int) -> None:
        """For separate envelopes: the order in which each peer sends to this rank, less the
        messages already taken (by ``peek``), which must be the first ones."""
        self._sends_from = {}
        for peer, program in enumerate(programs):
            if peer == rank:
                continue
            order: deque[_Channel] = deque()
            for a in program:
                dst = a.other_stage
                if (
                    a.kind in SEND_KINDS
                    and dst is not None
                    and self._channels.stage_to_rank[dst] == rank
                ):
                    order.append((a.stage, dst, RECV_OF[a.kind]))
            self._sends_from[self._channels.global_rank(peer)] = order
        for (peer, _), inbox in self._inboxes.items():
            for arrived in inbox.ready:
                if arrived.abort is not None:
                    continue  # no tensors follow it
                order = self._sends_from.get(peer, deque())
                if not order or order[0] != arrived.channel:
                    raise PipelineError("a message arrived ahead of the order it was sent in")
                order.popleft()

    def peek(self, src: int, dst: int, kind: Kind) -> tuple[int, ...]:
        """The info words of the next message from stage ``src``, which stays to be received."""
        _, inbox = self._inbox(src, dst, kind)
        if not inbox.ready:
            inbox.ready.append(self._take_one(src, dst, 0, kind))
        self._of_this_call(inbox, 0)
        return inbox.ready[0].info

    def recv(self, src: int, dst: int, microbatch: int, kind: Kind) -> Message:
        """The next message of a channel: one taken already, or the one on its way."""
        _, inbox = self._inbox(src, dst, kind)
        if inbox.ready:
            self._of_this_call(inbox, microbatch)
            return inbox.ready.popleft().message
        return self._take(src, dst, microbatch, kind).message

    def _of_this_call(self, inbox: _Inbox, microbatch: int) -> None:
        """A StageError, the message kept, if the first message ``inbox`` took already
        belongs to a later call than this one: its sender ended this one early
        (``_take_one``); one, the abort taken, if it is an abort of this call."""
        arrived = inbox.ready[0]
        src, dst, kind = arrived.channel
        if arrived.call > self._call:
            raise StageError(dst, _ended_early(src, what(kind, microbatch, src)))
        if arrived.abort is not None:
            inbox.ready.popleft()
            raise self._aborted(arrived.abort, dst, what(kind, microbatch, src))

    def _aborted(self, abort: envelope.Abort, dst: int, waited_for: str) -> StageError:
        """The error that ``abort``, of this call, ends it with on stage ``dst``."""
        self.heard = abort
        return StageError(dst, _failed(abort, waited_for))

    def check(self, stage: int, waited_for: str) -> None:
        """Raise at once, waiting for nothing, where an abort of this call has arrived: for a
        wait outside the program (for the loss, say), where a peer that failed would
        otherwise hold ``stage`` until the timeout. Messages of earlier calls are dropped,
        and those of later calls kept for them, ending nothing: the peer may have ended the
        wait an instant ago, and begun its next call. Separate envelopes (CUDA) are not
        looked at: their tensors follow in order."""
        if self._separate:
            return
        for key, inbox in self._inboxes.items():
            src, dst, kind = self._channel_of[key]
            while not inbox.ready and self._arrived(key, inbox):
                if self._piped(key):
                    arrived = self._take_piped(key, src, dst, -1, kind)
                else:
                    arrived = self._take_posted(key, inbox, src, dst, -1, kind)
                if arrived.call >= self._call:
                    inbox.ready.append(arrived)
            if not inbox.ready:
                continue
            first = inbox.ready[0]
            if first.call == self._call and first.abort is not None:
                inbox.ready.popleft()
                raise self._aborted(first.abort, stage, waited_for)

    def _arrived(self, key: tuple[int, int], inbox: _Inbox) -> bool:
        if self._piped(key):
            assert self.pipes is not None
            return self.pipes.readable(key)
        return inbox.posted is not None and inbox.posted[0].is_completed()

    def _post(self, key: tuple[int, int], inbox: _Inbox) -> None:
        buffer = torch.empty(inbox.capacity, dtype=torch.uint8)
        work = dist.irecv(buffer, src=key[0], group=self._envelope_group, tag=key[1])
        assert work is not None  # None only where this process is not in the group
        inbox.posted = (work, buffer)
        inbox.to_post -= 1

    def _wait(self, work: dist.Work, dst: int, src: int, microbatch: int, kind: Kind) -> None:
        try:
            work.wait(self._timeout)
        except RuntimeError as exc:
            text = str(exc).lower()
            reason = (
                f"timed out after {self._timeout_s:g} s"
                if "timed out" in text or "timeout" in text
                else f"lost stage {src} ({str(exc).splitlines()[0]})"
            )
            raise StageError(dst, f"{reason} waiting for {what(kind, microbatch, src)}") from exc

    def _take(self, src: int, dst: int, microbatch: int, kind: Kind) -> _Arrived:
        """The next message of a channel. With separate envelopes, the peer's messages sent
        before it are taken first (and kept for their own channels): NCCL delivers tensors
        between two processes in the order they were sent."""
        order = self._sends_from.get(self._channels.rank(src))
        if order:
            while order[0] != (src, dst, kind):
                earlier = order.popleft()
                _, inbox = self._inbox(*earlier)
                inbox.ready.append(self._take_one(earlier[0], earlier[1], -1, earlier[2]))
            order.popleft()
        return self._take_one(src, dst, microbatch, kind)

    def _take_one(self, src: int, dst: int, microbatch: int, kind: Kind) -> _Arrived:
        """The next message of a channel that belongs to this call. One of an earlier call
        (it failed before taking it) is dropped. One of the next call means that its sender
        ended this call early (it failed, or gave up waiting): it is kept for that call,
        and this one ends here too."""
        key, inbox = self._inbox(src, dst, kind)
        piped = self._piped(key)
        while True:
            if piped:
                arrived = self._take_piped(key, src, dst, microbatch, kind)
            else:
                arrived = self._take_posted(key, inbox, src, dst, microbatch, kind)
            if arrived.call == self._call:
                if arrived.abort is not None:
                    raise self._aborted(arrived.abort, dst, what(kind, microbatch, src))
                return arrived
            if arrived.call > self._call:
                inbox.ready.append(arrived)
                raise StageError(dst, _ended_early(src, what(kind, microbatch, src)))
            if not piped:
                inbox.to_post += 1  # the dropped message took a receive this call counts on

    def _take_posted(
        self, key: tuple[int, int], inbox: _Inbox, src: int, dst: int, microbatch: int, kind: Kind
    ) -> _Arrived:
        """The next message of a channel through the receives posted on it; the receive
        after it posted."""
        buffer, words = self._envelope(key, inbox, src, dst, microbatch, kind)
        if words[0] == envelope.ABORT:  # no tensors follow it, on any group
            if inbox.to_post > 0:
                self._post(key, inbox)
            _, _, info, said = envelope.items_of(words)
            abort = envelope.abort_of(info, said)
            return _Arrived(None, (), (src, dst, kind), abort.call, abort)
        items, form, info, used, structure = envelope.read(buffer, words)
        if self._separate:
            if info[0] != self._call:  # its tensors are in the peer's stream: none can be told
                raise PipelineError(
                    f"stage {dst}: a message of another call than this one arrived from stage "
                    f"{src} (a call failed); with separate envelopes (CUDA) it cannot be set "
                    "aside: build the pipeline again after a failed step"
                )
            items = self._fetch(items, key[0], dst, src, microbatch, kind)
        elif used < buffer.numel() - buffer.numel() // 8:  # much slack: do not keep it alive
            items = tuple(None if t is None else t.clone() for t in items)
        if inbox.to_post > 0:
            self._post(key, inbox)
        message = payload.decode(items, form, structure)
        return _Arrived(message, info[1:], (src, dst, kind), info[0])

    def _envelope(
        self,
        key: tuple[int, int],
        inbox: _Inbox,
        src: int,
        dst: int,
        microbatch: int,
        kind: Kind,
    ) -> tuple[Tensor, list[int]]:
        """The next message envelope of a channel and its header words, after any grow
        envelopes (each makes the channel post bigger buffers)."""
        while True:
            if inbox.posted is None:
                inbox.to_post = max(inbox.to_post, 1)
                self._post(key, inbox)
            assert inbox.posted is not None  # posted just above if it was not
            work, buffer = inbox.posted
            self._wait(work, dst, src, microbatch, kind)
            inbox.posted = None
            words = envelope.header_words(buffer)
            if words[0] != envelope.GROW:
                return buffer, words
            inbox.capacity = words[1]  # the message follows in a bigger buffer

    def _take_piped(
        self, key: tuple[int, int], src: int, dst: int, microbatch: int, kind: Kind
    ) -> _Arrived:
        assert self.pipes is not None
        try:
            got = self.pipes.recv(key, self._timeout_s)
        except PipeTimeout as exc:
            waited = f"waiting for {what(kind, microbatch, src)}"
            raise StageError(dst, f"timed out after {self._timeout_s:g} s {waited}") from exc
        except PipeClosed as exc:
            raise StageError(
                dst, f"lost stage {src} ({exc}) waiting for {what(kind, microbatch, src)}"
            ) from exc
        if got.kind == envelope.ABORT:
            abort = envelope.abort_of(got.info, got.structure)
            return _Arrived(None, (), (src, dst, kind), abort.call, abort)
        message = payload.decode(got.items, got.form, got.structure)
        return _Arrived(message, got.info[1:], (src, dst, kind), got.info[0])

    def _fetch(
        self,
        described: tuple[Tensor | None, ...],
        peer: int,
        dst: int,
        src: int,
        microbatch: int,
        kind: Kind,
    ) -> tuple[Tensor | None, ...]:
        """Separate envelopes: receive the tensors themselves, in the order they were sent."""
        out: list[Tensor | None] = []
        for t in described:
            if t is None:
                out.append(None)
                continue
            buffer = torch.empty(t.shape, dtype=t.dtype, device=self._device)
            work = dist.irecv(buffer, src=peer, group=self._group, tag=0)
            assert work is not None  # None only where this process is not in the group
            self._wait(work, dst, src, microbatch, kind)
            out.append(buffer.requires_grad_(t.requires_grad))
        return tuple(out)
