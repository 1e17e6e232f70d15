"""Named pipes between processes of one machine (``gpipe.comm.named_pipes``): a message arrives
whole, in the order sent, each tensor in storage of its own; a send never waits for the reader,
and a full pipe holds up no other; a reader waits no longer than its deadline and sees a closed
writer at once. Here between the two ends of pipes in one process (a pipe is a pipe whoever
holds its ends); ``open_pipes`` itself across two processes."""

import fcntl
import os
import resource
import threading
import time

import pytest
import torch

from gpipe.comm.named_pipes import PipeClosed, Pipes, PipeTimeout

from ..workers import run
from . import transport_cases

BIG = 3 << 20  # bytes: more than a pipe's buffer holds


def _pipes(tags=(0,)) -> tuple[Pipes, Pipes]:
    """A writing end (rank 0, writing to rank 1) and a reading end per tag, as ``open_pipes``
    opens them: both ends non-blocking."""
    outgoing, incoming = {}, {}
    for tag in tags:
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        outgoing[(1, tag)], incoming[(0, tag)] = write, read
    return Pipes(outgoing, {}), Pipes({}, incoming)


def _send(pipes: Pipes, tag: int, message, info=(0, 0, 0)) -> None:
    transport_cases.pipe_send(pipes, (1, tag), message, info)


def _recv(pipes: Pipes, tag: int):
    return transport_cases.pipe_recv(pipes, (0, tag))


def test_a_message_arrives_whole_with_its_info_and_each_tensor_in_storage_of_its_own():
    writer, reader = _pipes()
    sent = (
        torch.randn(3, 5, dtype=torch.float64, requires_grad=True),
        None,
        torch.arange(7),
        torch.empty(0, 4),
    )
    _send(writer, 0, sent, info=(1, 4, 12))
    got, info = _recv(reader, 0)
    assert info == (1, 4, 12)
    assert got[1] is None and len(got) == 4
    for a, b in zip(got, sent, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
            assert a.requires_grad == b.requires_grad
    storages = {t.untyped_storage().data_ptr() for t in got if t is not None and t.numel()}
    assert len(storages) == 2


def test_a_payload_keeps_its_structure_and_plain_leaves():
    writer, reader = _pipes()
    sent = {"hidden": torch.ones(2, 3), "lengths": [3, 1], "name": "x"}
    _send(writer, 0, sent)
    got, _ = _recv(reader, 0)
    assert got.keys() == sent.keys() and got["lengths"] == [3, 1] and got["name"] == "x"
    torch.testing.assert_close(got["hidden"], sent["hidden"])


def test_messages_arrive_in_the_order_sent():
    writer, reader = _pipes()
    for i in range(5):
        _send(writer, 0, torch.full((i + 1,), float(i)))
    for i in range(5):
        got, _ = _recv(reader, 0)
        torch.testing.assert_close(got, torch.full((i + 1,), float(i)))


def test_a_send_bigger_than_the_pipe_returns_at_once_and_flush_waits_until_it_is_read():
    writer, reader = _pipes()
    big = torch.randn(BIG // 4)
    start = time.monotonic()
    _send(writer, 0, big)  # nobody reads yet: the writer thread holds the rest
    assert time.monotonic() - start < 1
    with pytest.raises(PipeTimeout, match="sends not written in 0.2 s"):
        writer.flush(0.2)
    got = []
    reading = threading.Thread(target=lambda: got.append(_recv(reader, 0)[0]))
    reading.start()
    writer.flush(10)
    reading.join(10)
    torch.testing.assert_close(got[0], big)


def test_pipes_numbered_past_1024_wait_for_room_and_for_data_as_others_do(request):
    """A process that has opened many files (or pipelines) gets descriptors past select()'s
    limit of 1024: a message bigger than the pipe still waits for room and for data."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"this process may open only {hard} files, none numbered past 1024")
    if soft != resource.RLIM_INFINITY and soft < 1100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1100, hard))
        request.addfinalizer(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    read, write = os.pipe()
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1030) for fd in (read, write)]  # free ones past 1024
    os.close(read)
    os.close(write)
    for fd in high:
        os.set_blocking(fd, False)
    writer, reader = Pipes({(1, 0): high[1]}, {}), Pipes({}, {(0, 0): high[0]})
    big = torch.randn(BIG // 4)
    _send(writer, 0, big)  # more than the pipe holds: the writer thread waits for room
    got, _ = _recv(reader, 0)  # the reader waits for data between reads
    writer.flush(10)
    torch.testing.assert_close(got, big)
    writer.close()
    reader.close()


def test_a_full_pipe_holds_up_no_other():
    """The reader drains the second pipe before the first: a writer that waited for room in
    the first before writing the second would wait for ever."""
    writer, reader = _pipes(tags=(0, 1))
    first, second = torch.randn(BIG // 4), torch.randn(BIG // 4)
    _send(writer, 0, first)
    _send(writer, 1, second)
    torch.testing.assert_close(_recv(reader, 1)[0], second)
    torch.testing.assert_close(_recv(reader, 0)[0], first)
    writer.flush(10)


def test_nothing_arriving_ends_the_wait_at_its_deadline():
    _, reader = _pipes()
    start = time.monotonic()
    with pytest.raises(PipeTimeout, match="nothing arrived in 0.2 s"):
        reader.recv((0, 0), 0.2)
    assert 0.2 <= time.monotonic() - start < 2


def test_a_closed_writer_is_seen_at_once():
    writer, reader = _pipes()
    writer.close()
    start = time.monotonic()
    with pytest.raises(PipeClosed, match="the sending process closed its end"):
        reader.recv((0, 0), 30)
    assert time.monotonic() - start < 5


def test_a_write_to_a_closed_reader_fails():
    writer, reader = _pipes()
    reader.close()
    with pytest.raises(PipeClosed, match="a write to the pipe failed"):
        _send(writer, 0, torch.ones(4))


def test_pipes_open_between_the_processes_of_one_machine_both_ways_and_leave_no_file():
    results = run(transport_cases.open_pipes_both_ways, 2)
    assert results == {0: "from rank 1", 1: "from rank 0"}


def test_no_pipe_opens_to_a_process_of_another_machine():
    assert run(transport_cases.open_pipes_across_machines, 2) == {0: None, 1: None}
