"""Receives posted ahead (``gpipe.comm.receive_ahead``): one receive per channel at a time, the
next posted as soon as a message is taken and none beyond what the step brings; bigger buffers
after a grow envelope; the step's info read off the first message, which stays to be received;
with separate envelopes, a peer's messages taken in the order it sent them; a wait that fails
names the stage and what it waited for; channels through pipes read from the pipes; what an
earlier call (one that failed) left on a channel is dropped, not taken for the next call's;
a peer's abort ends its own call at once, naming the stage that failed, and no other call.

In one process: torch.distributed's point-to-point is replaced by a wire of queued messages
(``Wire``), which fills each posted buffer with the next message of its channel when waited on.
"""

import os
import re
from collections import deque

import pytest
import torch

from gpipe.comm import envelope, payload, receive_ahead
from gpipe.comm.channel_map import ChannelMap
from gpipe.comm.named_pipes import Pipes
from gpipe.comm.receive_ahead import FIRST_CAPACITY, ReceiveAhead
from gpipe.errors import PipelineError, StageError
from gpipe.schedules import Action, Kind

from . import transport_cases

CPU = torch.device("cpu")
PEER = 1  # the global rank of stage 0; this process (rank 0) holds stage 1
ENVELOPES, DATA = "envelopes", "data"  # the two groups of separate envelopes


class _Work:
    def __init__(self, wire, buffer, key):
        self._wire, self._buffer, self._key = wire, buffer, key

    def wait(self, timeout):
        queued = self._wire.queued.get(self._key)
        if not queued:
            raise RuntimeError("[../gloo/transport/tcp/pair.cc] Timed out waiting 500ms for recv")
        sent = queued.popleft()
        if isinstance(sent, Exception):
            raise sent
        assert sent.numel() <= self._buffer.numel(), "a message longer than the buffer posted"
        self._buffer.view(-1)[: sent.numel()].copy_(sent.view(-1))
        return True


class Wire:
    """``dist`` as ReceiveAhead calls it, between this process (rank 0) and its peers: what
    each peer sent, queued per (group, peer, tag); every receive posted, with its buffer's
    size."""

    def __init__(self):
        self.queued: dict[tuple, deque] = {}
        self.posted: list[tuple] = []

    def get_rank(self):
        return 0

    def irecv(self, buffer, src, group=None, tag=0):
        self.posted.append((group, src, tag, buffer.numel() * buffer.element_size()))
        return _Work(self, buffer, (group, src, tag))

    def put(self, item, src=PEER, group=None, tag=0):
        self.queued.setdefault((group, src, tag), deque()).append(item)

    def send(self, message, tag, info=(0, 0, 0), capacity=FIRST_CAPACITY, group=None):
        """``message`` as DistributedTransport sends it in one envelope (after a grow envelope
        where it does not fit ``capacity``)."""
        items, form, structure = payload.encode(message)
        described = envelope.describe(items, form, info, structure)
        if described.total > capacity:
            self.put(envelope.grow_envelope(described.total), group=group, tag=tag)
        self.put(envelope.pack(items, described), group=group, tag=tag)

    def send_separate(self, message, tag, info=(0, 0, 0)):
        """``message`` as DistributedTransport sends it on a device: its description on the
        envelopes' group, then its tensors in one stream on the data group."""
        items, form, structure = payload.encode(message)
        described = envelope.describe(items, form, info, structure)
        self.put(envelope.header(described), group=ENVELOPES, tag=tag)
        for t in items:
            if t is not None:
                self.put(t.detach().clone(), group=DATA, tag=0)


@pytest.fixture
def wire(monkeypatch):
    wire = Wire()
    monkeypatch.setattr(receive_ahead, "dist", wire)
    return wire


def _receiving(separate=False, timeout=0.5) -> ReceiveAhead:
    """Stage 0 on rank 1, stage 1 here (rank 0)."""
    channels = ChannelMap([PEER, 0], None)
    groups = (DATA, ENVELOPES) if separate else (None, None)
    return ReceiveAhead(channels, CPU, *groups, separate=separate, timeout=timeout)


def _programs(*mine: Action, theirs=()) -> list[list[Action]]:
    """Every rank's program, by rank: this one's and stage 0's."""
    return [list(mine), list(theirs)]


FORWARD_TAG = ChannelMap([PEER, 0], None).tag(Kind.RECV_F, 0, 1)
SKIP_TAG = ChannelMap([PEER, 0], None).tag(Kind.RECV_SKIP, 0, 1)


def _forwards(m: int) -> list[Action]:
    return [Action(1, Kind.RECV_F, i) for i in range(m)]


def test_one_receive_is_posted_per_channel_and_the_next_when_a_message_is_taken(wire):
    ahead = _receiving()
    ahead.begin(_programs(*_forwards(3)), 0)
    assert wire.posted == [(None, PEER, FORWARD_TAG, FIRST_CAPACITY)]
    for i in range(3):
        wire.send(torch.full((2,), float(i)), FORWARD_TAG)
    for i in range(3):
        got = ahead.recv(0, 1, i, Kind.RECV_F)
        torch.testing.assert_close(got, torch.full((2,), float(i)))
        assert len(wire.posted) == min(i + 2, 3)  # none beyond the step's three


def test_a_message_bigger_than_the_buffers_follows_a_grow_envelope_and_later_buffers_grow(wire):
    ahead = _receiving()
    ahead.begin(_programs(*_forwards(2)), 0)
    big = torch.randn(FIRST_CAPACITY // 4)
    wire.send(big, FORWARD_TAG)
    wire.send(torch.ones(1), FORWARD_TAG, capacity=envelope.describe((big,), 0, (0, 0, 0)).total)
    torch.testing.assert_close(ahead.recv(0, 1, 0, Kind.RECV_F), big)
    grown = wire.posted[-1][3]
    assert grown > FIRST_CAPACITY and grown >= big.numel() * 4
    torch.testing.assert_close(ahead.recv(0, 1, 1, Kind.RECV_F), torch.ones(1))


def test_the_info_of_the_first_message_is_read_before_the_step_and_the_message_stays(wire):
    """A later rank learns the step's size from its first message, before it knows its program."""
    ahead = _receiving()
    wire.send(torch.zeros(3), FORWARD_TAG, info=(0, 2, 12))
    wire.send(torch.ones(3), FORWARD_TAG, info=(0, 2, 12))
    assert ahead.peek(0, 1, Kind.RECV_F) == (2, 12)
    assert ahead.peek(0, 1, Kind.RECV_F) == (2, 12)  # the same message, still there
    ahead.begin(_programs(*_forwards(2)), 0)
    torch.testing.assert_close(ahead.recv(0, 1, 0, Kind.RECV_F), torch.zeros(3))
    torch.testing.assert_close(ahead.recv(0, 1, 1, Kind.RECV_F), torch.ones(3))
    assert len(wire.posted) == 2  # the peeked one and the other: no more


def test_a_payload_arrives_with_its_structure_and_requires_grad(wire):
    ahead = _receiving()
    ahead.begin(_programs(*_forwards(1)), 0)
    sent = {"hidden": torch.randn(2, 3, requires_grad=True), "lengths": [2, 1]}
    wire.send(sent, FORWARD_TAG)
    got = ahead.recv(0, 1, 0, Kind.RECV_F)
    assert got["lengths"] == [2, 1] and got["hidden"].requires_grad
    torch.testing.assert_close(got["hidden"], sent["hidden"].detach())


def test_with_separate_envelopes_a_peers_messages_are_taken_in_the_order_it_sent_them(wire):
    """Stage 0 sends micro-batch 0's skip before its activations; asked for the activations
    first, the receiver takes the skip first and keeps it, so each gets its own tensor."""
    theirs = [
        Action(0, Kind.FORWARD, 0),
        Action(0, Kind.SEND_SKIP, 0, 1),
        Action(0, Kind.SEND_F, 0),
    ]
    mine = [Action(1, Kind.RECV_F, 0), Action(1, Kind.RECV_SKIP, 0, 0), Action(1, Kind.FORWARD, 0)]
    ahead = _receiving(separate=True)
    ahead.begin(_programs(*mine, theirs=theirs), 0)
    wire.send_separate(torch.full((2,), 7.0), SKIP_TAG)
    wire.send_separate(torch.full((3,), 1.0), FORWARD_TAG)
    torch.testing.assert_close(ahead.recv(0, 1, 0, Kind.RECV_F), torch.full((3,), 1.0))
    torch.testing.assert_close(ahead.recv(0, 1, 0, Kind.RECV_SKIP), torch.full((2,), 7.0))


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (None, "timed out after 0.5 s"),
        (
            RuntimeError("Connection closed by peer [127.0.0.1]:1234\nmore"),
            "lost stage 0 (Connection closed by peer [127.0.0.1]:1234)",
        ),
    ],
    ids=["silent", "gone"],
)
def test_a_failed_wait_names_the_stage_and_what_it_waited_for(wire, failure, reason):
    ahead = _receiving()
    ahead.begin(_programs(*_forwards(1)), 0)
    if failure is not None:
        wire.put(failure, tag=FORWARD_TAG)
    expected = f"stage 1: {reason} waiting for activations of micro-batch 0 from stage 0"
    with pytest.raises(StageError, match=re.escape(expected)):
        ahead.recv(0, 1, 0, Kind.RECV_F)


def _through_a_pipe() -> tuple[Pipes, ReceiveAhead]:
    """Stage 0's end of a pipe that carries the forward channel, and the receiving side
    that reads from it."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    ahead = _receiving()
    ahead.pipes = Pipes({}, {(PEER, FORWARD_TAG): read})
    return Pipes({(0, FORWARD_TAG): write}, {}), ahead


def test_a_channel_through_a_pipe_is_read_from_the_pipe(wire):
    sender, ahead = _through_a_pipe()
    ahead.begin(_programs(*_forwards(2)), 0)
    assert wire.posted == []  # the kernel holds what arrives: nothing to post
    transport_cases.pipe_send(sender, (0, FORWARD_TAG), torch.ones(2), info=(0, 2, 4))
    assert ahead.peek(0, 1, Kind.RECV_F) == (2, 4)
    torch.testing.assert_close(ahead.recv(0, 1, 0, Kind.RECV_F), torch.ones(2))
    with pytest.raises(StageError, match="stage 1: timed out after 0.5 s waiting for activations"):
        ahead.recv(0, 1, 1, Kind.RECV_F)
    sender.close()
    with pytest.raises(StageError, match="stage 1: lost stage 0 .*closed its end"):
        ahead.recv(0, 1, 1, Kind.RECV_F)


def _a_failed_call(ahead, wire) -> None:
    """Call 1 brings three messages and fails after the first; the other two stay on the wire."""
    ahead.new_call(1)
    ahead.begin(_programs(*_forwards(3)), 0)
    for i in range(3):
        wire.send(torch.full((2,), float(i)), FORWARD_TAG, info=(1, 3, 6))
    ahead.peek(0, 1, Kind.RECV_F)  # taken, then the call fails before it asks for it


def test_what_a_failed_call_left_is_dropped_and_the_next_call_takes_its_own(wire):
    ahead = _receiving()
    _a_failed_call(ahead, wire)
    ahead.new_call(2)
    for i in range(2):
        wire.send(torch.full((2,), 10.0 + i), FORWARD_TAG, info=(2, 2, 4))
    assert ahead.peek(0, 1, Kind.RECV_F) == (2, 4)  # the step's words, not call 1's
    ahead.begin(_programs(*_forwards(2)), 0)
    for i in range(2):
        torch.testing.assert_close(ahead.recv(0, 1, i, Kind.RECV_F), torch.full((2,), 10.0 + i))
    assert not any(wire.queued.values())  # everything sent was taken, and nothing more asked


def test_a_message_of_a_later_call_ends_the_calls_before_it_and_is_kept_for_its_own(wire):
    """Its sender ended this call early (it failed, or gave up waiting) and began a later one,
    two calls on when it refused a step before this process saw it."""
    ahead = _receiving()
    ahead.new_call(1)
    wire.send(torch.ones(2), FORWARD_TAG, info=(3, 1, 2))
    with pytest.raises(StageError, match=r"^stage 1: stage 0 ended this step early and began"):
        ahead.recv(0, 1, 0, Kind.RECV_F)
    ahead.new_call(2)
    with pytest.raises(StageError, match="ended this step early"):
        ahead.peek(0, 1, Kind.RECV_F)
    ahead.new_call(3)
    assert ahead.peek(0, 1, Kind.RECV_F) == (1, 2)
    ahead.begin(_programs(*_forwards(1)), 0)
    torch.testing.assert_close(ahead.recv(0, 1, 0, Kind.RECV_F), torch.ones(2))


def test_with_separate_envelopes_an_earlier_calls_message_is_refused_not_misread(wire):
    """Its tensors are in the peer's one stream, among the next call's: none can be dropped."""
    ahead = _receiving(separate=True)
    ahead.new_call(2)
    wire.send_separate(torch.ones(2), FORWARD_TAG, info=(1, 1, 2))
    with pytest.raises(PipelineError, match="build the pipeline again after a failed step"):
        ahead.peek(0, 1, Kind.RECV_F)


def test_through_a_pipe_what_a_failed_call_left_is_dropped(wire):
    sender, ahead = _through_a_pipe()
    for call, value in ((1, 0.0), (1, 1.0), (2, 2.0)):
        transport_cases.pipe_send(sender, (0, FORWARD_TAG), torch.full((2,), value), (call, 1, 2))
    ahead.new_call(2)
    assert ahead.peek(0, 1, Kind.RECV_F) == (1, 2)
    torch.testing.assert_close(ahead.recv(0, 1, 0, Kind.RECV_F), torch.full((2,), 2.0))
    sender.close()


def _abort(call: int, error: str = "ValueError: no") -> torch.Tensor:
    return envelope.abort_envelope(envelope.Abort(call, 0, error))


@pytest.mark.parametrize("separate", [False, True], ids=["one-envelope", "separate"])
def test_an_abort_ends_its_own_call_naming_the_stage_that_failed_and_no_later_call(wire, separate):
    """An earlier call's abort is dropped like its messages (with separate envelopes too: no
    tensors follow it), never ending this call; this call's ends it, and is kept as heard."""
    ahead = _receiving(separate=separate)
    ahead.new_call(2)
    ahead.begin(_programs(*_forwards(2)), 0)
    group = ENVELOPES if separate else None
    wire.put(_abort(1, "ValueError: of call 1"), group=group, tag=FORWARD_TAG)
    (wire.send_separate if separate else wire.send)(torch.ones(2), FORWARD_TAG, info=(2, 2, 4))
    wire.put(_abort(2, "OutOfMemoryError: " + "x" * 2000), group=group, tag=FORWARD_TAG)
    torch.testing.assert_close(ahead.recv(0, 1, 0, Kind.RECV_F), torch.ones(2))
    told = "stage 1: stopped waiting for activations of micro-batch 1 from stage 0: stage 0 "
    with pytest.raises(StageError, match=re.escape(told + "failed: OutOfMemoryError: xxx")):
        ahead.recv(0, 1, 1, Kind.RECV_F)
    assert ahead.heard is not None and ahead.heard[:2] == (2, 0)
    assert len(ahead.heard.error) == 1024  # cut: an abort fits any buffer a channel posts
    ahead.new_call(3)
    assert ahead.heard is None


def test_an_abort_of_a_later_call_ends_this_one_and_then_its_own(wire):
    ahead = _receiving()
    ahead.new_call(1)
    wire.put(_abort(2), tag=FORWARD_TAG)
    with pytest.raises(StageError, match="stage 0 ended this step early"):
        ahead.peek(0, 1, Kind.RECV_F)
    ahead.new_call(2)
    with pytest.raises(StageError, match="activations of micro-batch 0 from stage 0: stage 0 fa"):
        ahead.peek(0, 1, Kind.RECV_F)


def test_a_wait_outside_the_program_hears_an_abort_through_a_pipe_and_only_its_calls(wire):
    """``check`` takes what has arrived, waiting for nothing: an earlier call's abort is
    dropped, this call's raises."""
    sender, ahead = _through_a_pipe()
    ahead.new_call(2)
    ahead.begin(_programs(*_forwards(1)), 0)
    transport_cases.pipe_send(sender, (0, FORWARD_TAG), torch.ones(2), (2, 1, 2))
    torch.testing.assert_close(ahead.recv(0, 1, 0, Kind.RECV_F), torch.ones(2))
    ahead.check(1, "the loss to be taken")  # nothing arrived
    sender.send((0, FORWARD_TAG), [_abort(1)])
    ahead.check(1, "the loss to be taken")  # call 1's: dropped
    sender.send((0, FORWARD_TAG), [_abort(2, "ValueError: backward once")])
    told = "stage 1: stopped waiting for the loss to be taken: stage 0 failed: ValueError: back"
    with pytest.raises(StageError, match=re.escape(told)):
        ahead.check(1, "the loss to be taken")
    sender.close()
