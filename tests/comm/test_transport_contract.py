"""Every transport keeps the whole ``Transport`` contract: each member the protocol declares
is there, with the same parameters, so a facade may use any transport through it."""

import inspect

import pytest
import torch
import torch.distributed as dist

from gpipe.comm.distributed import DistributedTransport
from gpipe.comm.transport import InProcessTransport, Transport
from gpipe.errors import StageError
from gpipe.schedules import Kind

TRANSPORTS = [InProcessTransport, DistributedTransport]


def _declared() -> set[str]:
    """The members ``Transport`` declares: its methods and its annotated attributes."""
    methods = {name for name, value in vars(Transport).items() if inspect.isfunction(value)}
    return {n for n in methods if not n.startswith("_")} | set(Transport.__annotations__)


def test_the_protocol_declares_what_the_facades_use():
    wanted = {"info", "channels", "use_pipes", "begin", "peek", "send", "recv", "flush"}
    assert _declared() >= wanted


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda c: c.__name__)
def test_every_declared_member_is_there(transport):
    missing = sorted(name for name in _declared() if not hasattr(transport, name))
    assert not missing, f"{transport.__name__} lacks {missing}"


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda c: c.__name__)
def test_methods_take_the_declared_parameters(transport):
    for name in _declared():
        declared = getattr(Transport, name, None)
        if not inspect.isfunction(declared):
            continue
        got = list(inspect.signature(getattr(transport, name)).parameters)
        assert got == list(inspect.signature(declared).parameters), name


def test_an_in_process_transport_is_a_transport():
    assert isinstance(InProcessTransport([torch.device("cpu")] * 2), Transport)


def test_a_distributed_transport_is_a_transport():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert isinstance(DistributedTransport([0, 0], torch.device("cpu")), Transport)
    finally:
        if started:
            dist.destroy_process_group()


def test_in_process_peek_reads_the_info_of_the_first_message_and_leaves_it():
    transport = InProcessTransport([torch.device("cpu")] * 2, timeout=0.2)
    transport.begin([[]], 0)
    assert transport.channels([0, 1], [(0, 1)]) == ([], [])
    transport.use_pipes(None)
    transport.info = (3, 12)
    x = torch.ones(4, 2)
    transport.send(x, 0, 1, 1, Kind.SEND_F)
    transport.info = (9, 9)
    transport.send(x, 0, 1, 0, Kind.SEND_F)
    assert transport.peek(0, 1, Kind.RECV_F) == (9, 9)  # micro-batch 0's
    torch.testing.assert_close(transport.recv(0, 1, 0, Kind.RECV_F), x)
    assert transport.peek(0, 1, Kind.RECV_F) == (3, 12)
    transport.flush()
    with pytest.raises(StageError, match="timed out after 0.2 s waiting for gradients"):
        transport.peek(1, 0, Kind.RECV_B)
