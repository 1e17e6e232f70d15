"""Moving boundary tensors between processes over torch.distributed, without round trips.

Every channel (a peer process and a tag: ``channel_map``) carries one envelope per message
(``envelope``), so a message's description and its data travel in one transfer. Receives are
posted ahead (``receive_ahead``), so a transfer overlaps the computation before it is needed.
Both ends track how big the receiver's posted buffers are; a message that would not fit is
preceded by a small *grow* envelope, after which the receiver posts bigger ones, so shapes
may change from step to step and micro-batch to micro-batch with no set-up step. Sends are
reaped as they complete, freeing their buffers during the step.

On CUDA, NCCL moves the tensors and the envelopes (descriptions only) travel on a gloo
group, so the host never reads device memory to learn a shape. NCCL matches messages
between two processes in the order they were sent whatever their tags, so tensors are
received in each peer's send order, which the schedule tells.

A call that fails here sends an abort (``abort``) on every channel this process sends on,
without waiting for it to be taken, so that the peers waiting in that call raise at once
and pass it on, rather than wait for their timeout.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe.comm import envelope, payload
from gpipe.comm.channel_map import ChannelMap
from gpipe.comm.message import Message, what
from gpipe.comm.named_pipes import PipeClosed, Pipes, PipeTimeout
from gpipe.comm.process_group import bounded_wait
from gpipe.comm.receive_ahead import FIRST_CAPACITY, ReceiveAhead
from gpipe.errors import PipelineError, StageError
from gpipe.schedules import SEND_KINDS, Action, Kind

__all__ = ["DistributedTransport"]

_Sent = tuple[int, int, int]  # a send's source stage, destination stage and micro-batch


class DistributedTransport:
    """Point-to-point transfers over torch.distributed (gloo on CPU, NCCL on CUDA).

    ``stage_to_rank`` maps stages to ranks of ``group``. ``begin(program)`` posts the
    receives of a step; ``recv`` waits at most ``timeout`` seconds for a message, and
    ``flush`` as long for each send to be taken, so a peer that died or stalls ends in a
    StageError naming the stage. ``info`` (the step's micro-batch and row counts) travels in
    every envelope after the call's number (``new_call``); ``peek`` reads it from the first
    message of a channel before the step's program is known.
    """

    info: tuple[int, ...] = (0,) * (envelope.N_INFO - 1)  # the call's number goes first

    def __init__(
        self,
        stage_to_rank: Sequence[int],
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        timeout: float = 60.0,
        envelope_group: dist.ProcessGroup | None = None,
    ) -> None:
        self._map = ChannelMap(stage_to_rank, group)
        self._group = group
        # separate envelopes (descriptions on a CPU group, tensors on ``group``) for devices
        # whose tensors the host cannot read without synchronizing
        self._separate = device.type != "cpu" or envelope_group is not None
        self._envelope_group = envelope_group if envelope_group is not None else group
        self._timeout_s = timeout
        self._me = dist.get_rank()
        self._receiving = ReceiveAhead(
            self._map, device, group, self._envelope_group, self._separate, timeout
        )
        # sends not yet complete, each with its source stage, destination and micro-batch
        self._pending: deque[tuple[dist.Work, object, _Sent]] = deque()
        mine = [s for s in range(len(stage_to_rank)) if self._map.rank(s) == self._me]
        self._first = min(mine, default=0)  # the stage a failed flush through pipes names
        self._capacity: dict[tuple[int, int], int] = {}  # a receiver's buffers, as sent to
        self._local: dict[int, deque[Message]] = {}  # between two stages of this process
        self._pipes: Pipes | None = None  # to processes of this machine (``use_pipes``)
        self._call = 0  # the call this process is in (``new_call``), sent in every envelope
        self._aborted = 0  # the last call this process sent an abort for
        # aborts sent over torch.distributed, kept until taken but never waited for: a peer
        # that is past the call takes one only in its next call, and drops it
        self._aborts: deque[tuple[dist.Work, Tensor]] = deque()
        # this call's sends still to come on each gloo channel (its program's, from ``begin``)
        self._to_send: dict[tuple[int, int], int] | None = None

    def channels(
        self, stages: Sequence[int], skips: Sequence[tuple[int, int]]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (peer rank, tag) channels this process receives and sends on, holding
        ``stages``, with skip routes ``skips``: what ``named_pipes.open_pipes`` needs."""
        return self._map.listed(stages, skips)

    def use_pipes(self, pipes: Pipes | None) -> None:
        """Send to and receive from the processes ``pipes`` reach through them, not gloo."""
        if pipes is not None and self._separate:
            raise PipelineError("pipes carry CPU tensors; this transport's are on a device")
        self._pipes = self._receiving.pipes = pipes

    def new_call(self) -> int:
        """Begin the next call, and return its number: what this process kept of the last
        one (a call that failed) is dropped, and so is every earlier call's message that
        arrives from now on."""
        self._call += 1
        self._local.clear()
        self._to_send = None
        while self._aborts and self._aborts[0][0].is_completed():
            self._aborts.popleft()
        self._receiving.new_call(self._call)
        return self._call

    def begin(self, programs: Sequence[Sequence[Action]], rank: int) -> None:
        """Post the first receive of every channel that rank ``rank``'s program receives on
        (``programs`` are every rank's, in the pipeline group's numbering)."""
        self._receiving.begin(programs, rank)
        self._to_send = {}
        for a in programs[rank]:
            if a.kind in SEND_KINDS and a.other_stage is not None:
                dst = a.other_stage
                key = (self._map.rank(dst), self._map.tag(a.kind, a.stage, dst))
                self._to_send[key] = self._to_send.get(key, 0) + 1

    def peek(self, src: int, dst: int, kind: Kind) -> tuple[int, ...]:
        """The info words of the next message from stage ``src``, which stays to be received."""
        return self._receiving.peek(src, dst, kind)

    def send(self, message: Message, src: int, dst: int, microbatch: int, kind: Kind) -> None:
        """Send ``message`` from stage ``src`` to stage ``dst``: queued for a stage of this
        process, else on its way, in one envelope or through a pipe."""
        peer, tag = self._map.rank(dst), self._map.tag(kind, src, dst)
        if peer == self._me:
            self._local.setdefault(tag, deque()).append(message)
            return
        self._reap()
        if self._to_send is not None and (peer, tag) in self._to_send:
            self._to_send[(peer, tag)] -= 1
        sent = (src, dst, microbatch)
        items, form, structure = payload.encode(message)
        info = (self._call, *self.info)
        if self._pipes is not None and (peer, tag) in self._pipes.outgoing:
            described = envelope.describe(items, form, info, structure, aligned=False)
            parts = [t.detach().contiguous() for t in items if t is not None]
            try:
                self._pipes.send((peer, tag), [envelope.header(described), *parts])
            except PipeClosed as exc:
                raise StageError(src, f"lost stage {dst} ({exc}) sending to it") from exc
            return
        described = envelope.describe(items, form, info, structure)
        if self._separate:
            self._send_separate(items, described, peer, tag, sent)
            return
        capacity = self._capacity.get((peer, tag), FIRST_CAPACITY)
        if described.total > capacity:
            self._isend(envelope.grow_envelope(described.total), peer, tag, self._group, sent)
            self._capacity[(peer, tag)] = described.total
        self._isend(envelope.pack(items, described), peer, tag, self._group, sent)

    def _send_separate(
        self,
        items: tuple[Tensor | None, ...],
        described: envelope.Described,
        peer: int,
        tag: int,
        sent: _Sent,
    ) -> None:
        header = envelope.header(described)
        capacity = self._capacity.get((peer, tag), FIRST_CAPACITY)
        group = self._envelope_group
        if header.numel() > capacity:
            self._isend(envelope.grow_envelope(header.numel()), peer, tag, group, sent)
            self._capacity[(peer, tag)] = header.numel()
        self._isend(header, peer, tag, group, sent)
        for t in items:
            if t is not None:
                self._isend(t.detach().contiguous(), peer, None, self._group, sent)

    def _isend(
        self,
        tensor: Tensor,
        peer: int,
        tag: int | None,
        group: dist.ProcessGroup | None,
        sent: _Sent,
    ) -> None:
        """``tag=None``: the tensors of separate envelopes, in one stream per pair of
        processes, as NCCL delivers them whatever the tag."""
        try:
            work = dist.isend(tensor, dst=peer, group=group, tag=0 if tag is None else tag)
        except RuntimeError as exc:  # gloo closes a pair after a timeout on it: for good
            src, dst, _ = sent
            raise StageError(src, f"lost stage {dst} ({str(exc).splitlines()[0]})") from exc
        assert work is not None  # None only where this process is not in the group
        self._pending.append((work, tensor, sent))

    def _reap(self) -> None:
        """Forget the sends that completed, so their buffers are freed now."""
        pending = self._pending
        while pending and pending[0][0].is_completed():
            pending.popleft()

    def recv(self, src: int, dst: int, microbatch: int, kind: Kind) -> Message:
        """Receive what stage ``src`` sent to stage ``dst``, waiting at most the timeout."""
        if self._map.rank(src) == self._me:
            tag = self._map.tag(kind, src, dst)
            try:
                return self._local[tag].popleft()
            except (KeyError, IndexError):
                raise StageError(dst, f"nothing sent yet: {what(kind, microbatch, src)}") from None
        self._reap()
        return self._receiving.recv(src, dst, microbatch, kind)

    @property
    def heard(self) -> envelope.Abort | None:
        """The abort of this call that a receive took (a peer's call failed), or None."""
        return self._receiving.heard

    def abort(self, stage: int, error: str, channels: Iterable[tuple[int, int]]) -> None:
        """Tell the peers that this call failed: stage ``stage`` with ``error`` (one line),
        or, where this call ended on an abort it ``heard``, that one's stage and error. Sent
        once per call on each of ``channels`` (peer rank, tag), except to the stage that
        failed; best effort, waiting for nothing: a peer that is gone, or past this call,
        finds out by its own timeout, or drops it in its next call. Over gloo, once the
        call's program is known, only where it still had something to send: the peer takes
        the abort in this call then, and leaves none on the group for a later pipeline."""
        if self._aborted == self._call:
            return
        self._aborted = self._call
        told = self.heard or envelope.Abort(self._call, stage, error)
        failed = self._map.rank(told.stage)
        message = envelope.abort_envelope(told)
        for peer, tag in channels:
            if peer in (failed, self._me):
                continue
            with contextlib.suppress(PipeClosed, RuntimeError):  # gone: it will not wait
                if self._pipes is not None and (peer, tag) in self._pipes.outgoing:
                    self._pipes.send((peer, tag), [message])
                    continue
                if self._to_send is not None and not self._to_send.get((peer, tag)):
                    continue  # the peer takes nothing more of this call on it
                work = dist.isend(message, dst=peer, group=self._envelope_group, tag=tag)
                assert work is not None  # None only where this process is not in the group
                self._aborts.append((work, message))

    def check(self, stage: int, waited_for: str) -> None:
        """Raise the StageError that what arrived already ends this call with on ``stage``,
        waiting for nothing: a peer's abort, or a message of its next call; for a wait
        outside the program (``waited_for``), which no receive of it would end."""
        self._receiving.check(stage, waited_for)

    def flush(self) -> None:
        """Wait until every send has completed (the step's end), each at most the timeout."""
        pending, self._pending = self._pending, deque()
        for work, _, (src, dst, microbatch) in pending:
            taken = f"waiting for stage {dst} to take micro-batch {microbatch} from stage {src}"
            bounded_wait(work, self._timeout_s, src, taken, f"stage {dst}")
        if self._pipes is not None:
            try:
                self._pipes.flush(self._timeout_s)
            except (PipeTimeout, PipeClosed) as exc:
                raise StageError(self._first, f"sends did not complete: {exc}") from exc
