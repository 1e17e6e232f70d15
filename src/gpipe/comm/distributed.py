"""Moving boundary tensors between processes over torch.distributed, without round trips.

Every channel (a peer process and a tag) carries one envelope per message (``envelope``),
so a message's description and its data travel in one transfer. Receives are posted ahead:
at the start of a step, one per channel that will carry anything, and the next one as soon
as the previous message is taken, so a transfer overlaps the computation before it is
needed. Both ends track how big the receiver's posted buffers are; a message that would not
fit is preceded by a small *grow* envelope, after which the receiver posts bigger ones, so
shapes may change from step to step and micro-batch to micro-batch with no set-up step.
Sends are reaped as they complete, freeing their buffers during the step.

On CUDA, NCCL moves the tensors and the envelopes (descriptions only) travel on a gloo
group, so the host never reads device memory to learn a shape. NCCL matches messages
between two processes in the order they were sent whatever their tags, so tensors are
received in each peer's send order, which the schedule tells.
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
from gpipe.comm.named_pipes import PipeClosed, Pipes, PipeTimeout
from gpipe.comm.transport import Message, what
from gpipe.errors import PipelineError, StageError
from gpipe.schedules import RECV_KINDS, RECV_OF, SEND_KINDS, Action, Kind

__all__ = ["DistributedTransport"]

_FIRST_CAPACITY = 16 * 1024  # bytes a channel's buffers hold until a message needs more
_BACKWARD = (Kind.SEND_B, Kind.RECV_B, Kind.SEND_SKIP_B, Kind.RECV_SKIP_B)
_NEIGHBOURS = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)


@dataclass
class _Arrived:
    """A message taken off the wire, with what its envelope said."""

    message: Message
    info: tuple[int, ...]
    channel: tuple[int, int, Kind]  # (source stage, destination stage, receive kind)


@dataclass
class _Inbox:
    """One receiving channel: the receive posted on it, messages taken but not yet asked for,
    and how many more to post this step."""

    capacity: int = _FIRST_CAPACITY
    posted: tuple[dist.Work, Tensor] | None = None
    ready: deque[_Arrived] = field(default_factory=deque)
    to_post: int = 0


@functools.lru_cache(maxsize=64)
def _receives(program: tuple[Action, ...]) -> dict[tuple[int, int, Kind], int]:
    """How many messages each (source stage, destination stage, kind) channel brings."""
    counts: dict[tuple[int, int, Kind], int] = {}
    for a in program:
        if a.kind in RECV_KINDS:
            key = (a.other_stage, a.stage, a.kind)
            counts[key] = counts.get(key, 0) + 1  # type: ignore[index]
    return counts


class DistributedTransport:
    """Point-to-point transfers over torch.distributed (gloo on CPU, NCCL on CUDA).

    ``stage_to_rank`` maps stages to ranks of ``group``. ``begin(program)`` posts the
    receives of a step; ``recv`` waits at most ``timeout`` seconds for a message, so a peer
    that died or stalls ends in a StageError naming the stage. ``info`` (the step's
    micro-batch and row counts) travels in every envelope; ``peek`` reads it from the first
    message of a channel before the step's program is known.
    """

    def __init__(
        self,
        stage_to_rank: Sequence[int],
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        timeout: float = 60.0,
        envelope_group: dist.ProcessGroup | None = None,
    ) -> None:
        self._stage_to_rank = list(stage_to_rank)
        self._device = device
        self._group = group
        # separate envelopes (descriptions on a CPU group, tensors on ``group``) for devices
        # whose tensors the host cannot read without synchronizing
        self._separate = device.type != "cpu" or envelope_group is not None
        self._envelope_group = envelope_group if envelope_group is not None else group
        self._timeout = datetime.timedelta(seconds=timeout)
        self._timeout_s = timeout
        self._me = dist.get_rank()
        self._pending: deque[tuple[dist.Work, object]] = deque()  # sends not yet complete
        self._inboxes: dict[tuple[int, int], _Inbox] = {}  # (peer rank, tag)
        self._capacity: dict[tuple[int, int], int] = {}  # a receiver's buffers, as sent to
        self._local: dict[int, deque[Message]] = {}  # between two stages of this process
        # separate envelopes: each peer's messages to this process in the order it sends them
        self._sends_from: dict[int, deque[tuple[int, int, Kind]]] = {}
        self._pipes: Pipes | None = None  # to processes of this machine (``use_pipes``)
        self.info: tuple[int, ...] = (0,) * envelope.N_INFO

    # -- channels -------------------------------------------------------------------------
    def _rank(self, stage: int) -> int:
        return self._global(self._stage_to_rank[stage])

    def _global(self, rank: int) -> int:
        return rank if self._group is None else dist.get_global_rank(self._group, rank)

    def _tag(self, kind: Kind, src: int, dst: int) -> int:
        """One tag per channel: forward and backward traffic into each stage, and each pair of
        stages that exchange skips, so that their messages never match each other's."""
        backward = kind in _BACKWARD
        if kind in _NEIGHBOURS:
            return 2 * dst + backward
        n = len(self._stage_to_rank)
        return 2 * n + 2 * (src * n + dst) + backward

    def _inbox(self, src: int, dst: int, kind: Kind) -> tuple[tuple[int, int], _Inbox]:
        key = (self._rank(src), self._tag(kind, src, dst))
        inbox = self._inboxes.get(key)
        if inbox is None:
            inbox = self._inboxes[key] = _Inbox()
        return key, inbox

    def channels(
        self, stages: Sequence[int], skips: Sequence[tuple[int, int]]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (peer rank, tag) channels this process receives and sends on, holding
        ``stages``, with skip routes ``skips``: what ``pipes.open_pipes`` needs."""
        n = len(self._stage_to_rank)
        pairs = [(s - 1, s, Kind.RECV_F) for s in range(1, n)]
        pairs += [(s + 1, s, Kind.RECV_B) for s in range(n - 1)]
        pairs += [(a, b, Kind.RECV_SKIP) for a, b in skips]
        pairs += [(b, a, Kind.RECV_SKIP_B) for a, b in skips]
        receives, sends = [], []
        for src, dst, kind in pairs:
            if self._rank(src) == self._rank(dst):
                continue
            if dst in stages:
                receives.append((self._rank(src), self._tag(kind, src, dst)))
            if src in stages:
                sends.append((self._rank(dst), self._tag(kind, src, dst)))
        return receives, sends

    def use_pipes(self, pipes: Pipes | None) -> None:
        """Send to and receive from the processes ``pipes`` reach through them, not gloo."""
        if pipes is not None and self._separate:
            raise PipelineError("pipes carry CPU tensors; this transport's are on a device")
        self._pipes = pipes

    def _piped(self, key: tuple[int, int], incoming: bool) -> bool:
        pipes = self._pipes
        return pipes is not None and key in (pipes.incoming if incoming else pipes.outgoing)

    # -- a step ---------------------------------------------------------------------------
    def begin(self, programs: Sequence[Sequence[Action]], rank: int) -> None:
        """Post the first receive of every channel that rank ``rank``'s program receives on
        (``programs`` are every rank's, in the pipeline group's numbering)."""
        program = tuple(programs[rank])
        if self._separate:
            self._plan_order(programs, rank)
        for (src, dst, kind), count in _receives(program).items():
            if self._rank(src) == self._me:
                continue
            key, inbox = self._inbox(src, dst, kind)
            if self._piped(key, incoming=True):
                continue  # the kernel holds what arrives: nothing to post
            inbox.to_post = count - len(inbox.ready) - (inbox.posted is not None)
            if inbox.to_post < 0:
                raise PipelineError(f"stage {dst}: more messages arrived than the step expects")
            if inbox.posted is None and inbox.to_post:
                self._post(*self._inbox(src, dst, kind))

    def _plan_order(self, programs: Sequence[Sequence[Action]], rank: int) -> None:
        """For separate envelopes: the order in which each peer sends to this rank, less the
        messages already taken (by ``peek``), which must be the first ones."""
        self._sends_from = {}
        for peer, program in enumerate(programs):
            if peer == rank:
                continue
            order: deque[tuple[int, int, Kind]] = deque()
            for a in program:
                dst = a.other_stage
                if a.kind in SEND_KINDS and self._stage_to_rank[dst] == rank:  # type: ignore[index]
                    order.append((a.stage, dst, RECV_OF[a.kind]))  # type: ignore[arg-type]
            self._sends_from[self._global(peer)] = order
        for (peer, _), inbox in self._inboxes.items():
            for arrived in inbox.ready:
                order = self._sends_from.get(peer, deque())
                if not order or order[0] != arrived.channel:
                    raise PipelineError("a message arrived ahead of the order it was sent in")
                order.popleft()

    def peek(self, src: int, dst: int, kind: Kind) -> tuple[int, ...]:
        """The info words of the next message from stage ``src``, which stays to be received."""
        _, inbox = self._inbox(src, dst, kind)
        if not inbox.ready:
            inbox.ready.append(self._take_one(src, dst, 0, kind))
        return inbox.ready[0].info

    def _post(self, key: tuple[int, int], inbox: _Inbox) -> None:
        buffer = torch.empty(inbox.capacity, dtype=torch.uint8)
        work = dist.irecv(buffer, src=key[0], group=self._envelope_group, tag=key[1])
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
        order = self._sends_from.get(self._rank(src))
        if order:
            while order[0] != (src, dst, kind):
                earlier = order.popleft()
                _, inbox = self._inbox(*earlier)
                inbox.ready.append(self._take_one(earlier[0], earlier[1], -1, earlier[2]))
            order.popleft()
        return self._take_one(src, dst, microbatch, kind)

    def _take_one(self, src: int, dst: int, microbatch: int, kind: Kind) -> _Arrived:
        """Wait for the next envelope of a channel and read it; post the receive after it."""
        key, inbox = self._inbox(src, dst, kind)
        if self._piped(key, incoming=True):
            return self._take_piped(key, src, dst, microbatch, kind)
        while True:
            if inbox.posted is None:
                inbox.to_post = max(inbox.to_post, 1)
                self._post(key, inbox)
            work, buffer = inbox.posted  # type: ignore[misc]
            self._wait(work, dst, src, microbatch, kind)
            inbox.posted = None
            words = envelope.header_words(buffer)
            if words[0] != envelope.GROW:
                break
            inbox.capacity = words[1]  # the message follows in a bigger buffer
        items, form, info, used, structure = envelope.read(buffer, words)
        if self._separate:
            items = self._fetch(items, key[0], dst, src, microbatch, kind)
        elif used < buffer.numel() - buffer.numel() // 8:  # much slack: do not keep it alive
            items = tuple(None if t is None else t.clone() for t in items)
        if inbox.to_post > 0:
            self._post(key, inbox)
        return _Arrived(payload.decode(items, form, structure), info, (src, dst, kind))

    def _take_piped(
        self, key: tuple[int, int], src: int, dst: int, microbatch: int, kind: Kind
    ) -> _Arrived:
        assert self._pipes is not None
        try:
            items, form, info, structure = self._pipes.recv(key, self._timeout_s)
        except PipeTimeout as exc:
            raise StageError(
                dst,
                f"timed out after {self._timeout_s:g} s waiting for {what(kind, microbatch, src)}",
            ) from exc
        except PipeClosed as exc:
            raise StageError(
                dst, f"lost stage {src} ({exc}) waiting for {what(kind, microbatch, src)}"
            ) from exc
        return _Arrived(payload.decode(items, form, structure), info, (src, dst, kind))

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
            self._wait(work, dst, src, microbatch, kind)
            out.append(buffer.requires_grad_(t.requires_grad))
        return tuple(out)

    # -- the Transport protocol ------------------------------------------------------------
    def send(self, message: Message, src: int, dst: int, microbatch: int, kind: Kind) -> None:
        peer, tag = self._rank(dst), self._tag(kind, src, dst)
        if peer == self._me:
            self._local.setdefault(tag, deque()).append(message)
            return
        self._reap()
        items, form, structure = payload.encode(message)
        if self._piped((peer, tag), incoming=False):
            described = envelope.describe(items, form, self.info, structure, aligned=False)
            parts = [t.detach().contiguous() for t in items if t is not None]
            try:
                self._pipes.send((peer, tag), [envelope.header(described), *parts])  # type: ignore[union-attr]
            except PipeClosed as exc:
                raise StageError(src, f"lost stage {dst} ({exc}) sending to it") from exc
            return
        described = envelope.describe(items, form, self.info, structure)
        if self._separate:
            self._send_separate(items, described, peer, tag)
            return
        capacity = self._capacity.get((peer, tag), _FIRST_CAPACITY)
        if described.total > capacity:
            self._isend(envelope.grow_envelope(described.total), peer, tag, self._group)
            self._capacity[(peer, tag)] = described.total
        self._isend(envelope.pack(items, described), peer, tag, self._group)

    def _send_separate(
        self, items: tuple[Tensor | None, ...], described: envelope.Described, peer: int, tag: int
    ) -> None:
        header = envelope.header(described)
        capacity = self._capacity.get((peer, tag), _FIRST_CAPACITY)
        if header.numel() > capacity:
            self._isend(envelope.grow_envelope(header.numel()), peer, tag, self._envelope_group)
            self._capacity[(peer, tag)] = header.numel()
        self._isend(header, peer, tag, self._envelope_group)
        for t in items:
            if t is not None:
                self._isend(t.detach().contiguous(), peer, None, self._group)

    def _isend(
        self, tensor: Tensor, peer: int, tag: int | None, group: dist.ProcessGroup | None
    ) -> None:
        """``tag=None``: the tensors of separate envelopes, in one stream per pair of
        processes, as NCCL delivers them whatever the tag."""
        work = dist.isend(tensor, dst=peer, group=group, tag=0 if tag is None else tag)
        self._pending.append((work, tensor))

    def _reap(self) -> None:
        """Forget the sends that completed, so their buffers are freed now."""
        pending = self._pending
        while pending and pending[0][0].is_completed():
            pending.popleft()

    def recv(self, src: int, dst: int, microbatch: int, kind: Kind) -> Message:
        if self._rank(src) == self._me:
            tag = self._tag(kind, src, dst)
            try:
                return self._local[tag].popleft()
            except (KeyError, IndexError):
                raise StageError(dst, f"nothing sent yet: {what(kind, microbatch, src)}") from None
        self._reap()
        _, inbox = self._inbox(src, dst, kind)
        if inbox.ready:
            return inbox.ready.popleft().message
        return self._take(src, dst, microbatch, kind).message

    def flush(self) -> None:
        """Wait until every send has completed (the step's end)."""
        pending, self._pending = self._pending, deque()
        for work, _ in pending:
            work.wait(self._timeout)
        if self._pipes is not None:
            try:
                self._pipes.flush(self._timeout_s)
            except (PipeTimeout, PipeClosed) as exc:
                raise PipelineError(f"sends did not complete: {exc}") from exc
