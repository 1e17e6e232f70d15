"""Every transport keeps the whole ``Transport`` contract: each member the protocol declares
is there, with the same parameters, so a facade may use any transport through it; and each
carries what the protocol says a transport carries (a tensor, a tuple whose items are tensors
or None, any payload), keeping its form and each tensor's ``requires_grad``, with the step's
info words read off the first message.

The transports are found, not listed: every class of ``gpipe.comm`` that has a method the
protocol declares is one, except the two pieces ``DistributedTransport`` is built of."""

import importlib
import inspect
import pkgutil

import pytest
import torch

import gpipe.comm
from gpipe.comm.distributed import DistributedTransport
from gpipe.comm.in_process import InProcessTransport
from gpipe.comm.transport import Transport
from gpipe.errors import StageError
from gpipe.schedules import Kind

from ..workers import run
from . import transport_cases as cases

# Classes of gpipe.comm with methods of the protocol's names that are no transports themselves.
PARTS = {
    "gpipe.comm.receive_ahead.ReceiveAhead": "the receiving side of DistributedTransport",
    "gpipe.comm.named_pipes.Pipes": "the pipes DistributedTransport writes messages to",
}


def _declared() -> set[str]:
    """The members ``Transport`` declares: its methods and its annotated attributes."""
    methods = {name for name, value in vars(Transport).items() if inspect.isfunction(value)}
    return {n for n in methods if not n.startswith("_")} | set(Transport.__annotations__)


def _transports() -> list[type]:
    """Every class defined in a module of gpipe.comm with a method the protocol declares."""
    methods = {n for n in _declared() if inspect.isfunction(getattr(Transport, n, None))}
    found = {}
    for info in pkgutil.iter_modules(gpipe.comm.__path__, "gpipe.comm."):
        module = importlib.import_module(info.name)
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__ or cls is Transport:
                continue
            name = f"{cls.__module__}.{cls.__qualname__}"
            if methods & set(vars(cls)) and name not in PARTS:
                found[name] = cls
    return [found[name] for name in sorted(found)]


TRANSPORTS = _transports()


def test_the_protocol_declares_what_the_facades_use():
    wanted = {"info", "new_call", "channels", "use_pipes", "begin", "peek", "send", "recv", "flush"}
    assert _declared() >= wanted


def test_the_transports_found_are_the_two_the_facades_use():
    assert {InProcessTransport, DistributedTransport} <= set(TRANSPORTS)


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


def test_a_distributed_transport_is_a_transport(one_process_group):
    assert isinstance(DistributedTransport([0, 0], torch.device("cpu")), Transport)


# A distributed transport peeks only across processes: the first stage of a later rank reads
# the step's size off what the rank before it sends, never off a stage of its own process.
@pytest.mark.parametrize(
    ("make", "peek"),
    [
        (lambda: InProcessTransport([cases.CPU] * 2, timeout=10), True),
        (lambda: DistributedTransport([0, 0], cases.CPU, timeout=10), False),
    ],
    ids=["InProcessTransport", "DistributedTransport-one-process"],
)
def test_both_stages_in_one_process_carry_every_kind_of_message_both_ways(
    make, peek, one_process_group
):
    transport = make()
    transport.begin(cases.PROGRAMS, 0)
    cases.first_stage_sends(transport)
    answered = cases.last_stage_answers(transport, peek)
    sent = [cases.described(m) for m in cases.messages()]
    assert answered == {"info": cases.INFO, "received": sent}
    assert cases.first_stage_receives(transport) == sent


@pytest.mark.parametrize("pipes", [False, True], ids=["gloo", "pipes"])
def test_two_processes_carry_every_kind_of_message_both_ways(pipes):
    results = run(cases.exchange, 2, (pipes,))
    sent = results[0]["sent"]
    assert results[1] == {"info": cases.INFO, "received": sent}
    assert results[0]["back"] == sent


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
