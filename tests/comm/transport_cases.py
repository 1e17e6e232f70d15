"""What the transports carry, as each process of tests/comm/test_transport_contract.py and
tests/comm/test_named_pipes.py runs it (importable by name).

The exchange: stage 0 sends one message per micro-batch of every kind a transport carries (a
tensor, a 1-tuple, a tuple with a None, a payload, a tensor bigger than the first buffers),
stage 1 reads the step's info off the first, receives them all and sends each back as the
gradients. ``described`` turns what arrived into plain values to compare.
"""

import os
import socket
import tempfile

import torch
import torch.distributed as dist

from gpipe.comm import envelope, named_pipes, payload
from gpipe.comm.distributed import DistributedTransport
from gpipe.comm.named_pipes import open_pipes
from gpipe.comm.process_group import init_process_group
from gpipe.schedules import Action, Kind

CPU = torch.device("cpu")
INFO = (5, 16)  # the step's info words: micro-batches and rows
TAG = 5


def messages() -> list:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(4, 3, dtype=torch.float64, generator=g).requires_grad_(True),
        (torch.randn(2, generator=g),),
        (torch.randn(2, 2, generator=g).requires_grad_(True), None, torch.arange(3)),
        {"hidden": torch.randn(3, 2, generator=g), "lengths": [2, 1], "name": "x"},
        torch.randn(64 * 1024, generator=g),  # more than the first buffers hold
    ]


N = len(messages())
# each rank's program of the exchange, stage s on rank s
PROGRAMS = [
    [Action(0, kind, i) for kind in (Kind.SEND_F, Kind.RECV_B) for i in range(N)],
    [Action(1, kind, i) for kind in (Kind.RECV_F, Kind.SEND_B) for i in range(N)],
]


def pipe_send(pipes, channel, message, info=(0, 0, 0)) -> None:
    """``message`` as ``DistributedTransport`` writes it to a pipe: its header, its tensors."""
    items, form, structure = payload.encode(message)
    described = envelope.describe(items, form, info, structure, aligned=False)
    parts = [t.detach().contiguous() for t in items if t is not None]
    pipes.send(channel, [envelope.header(described), *parts])


def pipe_recv(pipes, channel, timeout: float = 10.0):
    """The next message of ``channel``, and its info words."""
    got = pipes.recv(channel, timeout)
    return payload.decode(got.items, got.form, got.structure), got.info


def described(message):
    """A message as plain values: its form, and each tensor's values, dtype and requires_grad."""
    if isinstance(message, torch.Tensor):
        return ("tensor", message.tolist(), str(message.dtype), message.requires_grad)
    if isinstance(message, tuple):
        return ("tuple", [described(m) if m is not None else None for m in message])
    if isinstance(message, dict):
        return ("dict", {k: described(v) for k, v in message.items()})
    return message


def first_stage_sends(transport) -> None:
    transport.info = INFO
    for i, message in enumerate(messages()):
        transport.send(message, 0, 1, i, Kind.SEND_F)


def last_stage_answers(transport, peek: bool = True) -> dict:
    """Stage 1: the info of the first message (with ``peek``), then every message, each sent
    back."""
    info = transport.peek(0, 1, Kind.RECV_F) if peek else INFO
    transport.begin(PROGRAMS, 1)
    got = [transport.recv(0, 1, i, Kind.RECV_F) for i in range(N)]
    for i, message in enumerate(got):
        transport.send(message, 1, 0, i, Kind.SEND_B)
    transport.flush()
    return {"info": tuple(info), "received": [described(m) for m in got]}


def first_stage_receives(transport) -> list:
    got = [transport.recv(1, 0, i, Kind.RECV_B) for i in range(N)]
    transport.flush()
    return [described(m) for m in got]


def exchange(pipes: bool) -> dict:
    """The exchange between two processes through a ``DistributedTransport``, over gloo or
    over pipes."""
    init_process_group(CPU)
    rank = dist.get_rank()
    transport = DistributedTransport([0, 1], CPU, timeout=30)
    if pipes:
        opened = open_pipes(*transport.channels([rank], []), None)
        assert opened is not None
        transport.use_pipes(opened)
    if rank == 1:
        return last_stage_answers(transport)
    transport.begin(PROGRAMS, 0)
    first_stage_sends(transport)
    return {"sent": [described(m) for m in messages()], "back": first_stage_receives(transport)}


def open_pipes_both_ways() -> str:
    """A pipe each way between two ranks, a message through each; the folder the pipes were
    made in is gone once they are open."""
    init_process_group(CPU)
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    made = []
    mkdtemp = tempfile.mkdtemp

    def recorded(**kwargs):
        made.append(mkdtemp(**kwargs))
        return made[-1]

    named_pipes.tempfile.mkdtemp = recorded
    try:
        pipes = open_pipes([(peer, TAG)], [(peer, TAG)], None)
    finally:
        named_pipes.tempfile.mkdtemp = mkdtemp
    assert pipes is not None
    assert list(pipes.outgoing) == list(pipes.incoming) == [(peer, TAG)]
    assert not any(os.path.exists(folder) for folder in made)
    pipe_send(pipes, (peer, TAG), {"rank": torch.tensor([rank]), "text": f"from rank {rank}"})
    pipes.flush(10)
    got, _ = pipe_recv(pipes, (peer, TAG))
    pipes.close()
    assert got["rank"].item() == peer
    return got["text"]


def open_pipes_across_machines():
    """Rank 1 says it is on another machine: no pipe opens, on either rank."""
    init_process_group(CPU)
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    hostname = socket.gethostname
    if rank == 1:
        named_pipes.socket.gethostname = lambda: "elsewhere"
    try:
        return open_pipes([(peer, TAG)], [(peer, TAG)], None)
    finally:
        named_pipes.socket.gethostname = hostname
