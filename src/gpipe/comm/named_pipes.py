"""Channels between processes of one machine: a named pipe per direction and tag.

gloo's point-to-point over loopback TCP costs tens of microseconds per call and a round
trip of the receiver's readiness per message; a pipe hands bytes to the kernel and back in
a few. A message is its envelope's header, then each tensor's bytes (``envelope``'s stream
layout), written straight from the tensors by one background thread per process, so a send
never blocks the step however full the pipe (nor one full pipe another), and read straight
into storage of each tensor's own, with a deadline. A peer that dies closes its end, and the
read sees it at once.

The pipes are opened collectively (``open_pipes``) over a gloo group, between the ranks of
one machine, and unlinked as soon as both ends are open: nothing is left on disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import select
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe.comm import envelope

__all__ = ["PipeClosed", "PipeTimeout", "Pipes", "Received", "open_pipes"]

Channel = tuple[int, int]  # (peer rank, tag)
_PIPE_BYTES = 1 << 20  # asked of the kernel; it may grant less


class Received(NamedTuple):
    """A message read off a pipe: its envelope's kind (``envelope.MESSAGE`` or ``ABORT``), its
    tensors, each in storage of its own, their form, its info words and its structure."""

    kind: int
    items: tuple[Tensor | None, ...]
    form: int
    info: tuple[int, ...]
    structure: bytes


class PipeTimeout(TimeoutError):
    """Nothing arrived before the deadline."""


class PipeClosed(ConnectionError):
    """The other end is gone (its process ended)."""


def _advance(parts: list[memoryview], written: int) -> None:
    """Drop the first ``written`` bytes of ``parts``."""
    while parts and written >= len(parts[0]):
        written -= len(parts[0])
        parts.pop(0)
    if parts and written:
        parts[0] = parts[0][written:]


@dataclass
class _Backlog:
    """What could not be written at once, per pipe, in order; and the first error met."""

    queued: dict[int, list[tuple[list[memoryview], list[Tensor]]]] = field(default_factory=dict)
    error: OSError | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)

    def __len__(self) -> int:
        return sum(len(q) for q in self.queued.values())


class _Writer:
    """One thread per process that writes what pipes had no room for: each pipe's messages
    in order, but the pipes independently of each other. A reader takes its messages in its
    own program's order, so it may wait on one pipe before it drains another: a write that
    waited for room in the second would hold up the first, and both processes would wait
    for ever (two stages per process in a V exchange messages both ways on two pipes)."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[tuple[int, _Backlog]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._thread = threading.Thread(target=self._run, name="gpipe-pipe-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pending: dict[int, _Backlog] = {}  # pipes with messages left to write
        while True:
            if not pending:
                fd, backlog = self._work.get()
                pending[fd] = backlog
            while not self._work.empty():
                fd, backlog = self._work.get()
                pending[fd] = backlog
            # poll, not select: select refuses descriptors past 1024, which a process that
            # has opened many files or pipelines reaches
            poller = select.poll()
            poller.register(self._wake_read, select.POLLIN)
            for fd in pending:
                poller.register(fd, select.POLLOUT)
            for fd, _ in poller.poll():
                if fd == self._wake_read:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_read, 4096)
                elif _write_some(fd, pending[fd]):
                    del pending[fd]

    def put(self, fd: int, backlog: _Backlog) -> None:
        self._work.put((fd, backlog))
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is already pending
            os.write(self._wake_write, b"\0")


def _write_some(fd: int, backlog: _Backlog) -> bool:
    """Write what ``fd`` takes of its oldest message; True once it has nothing left."""
    with backlog.cond:
        queued = backlog.queued.get(fd)
        if not queued:
            return True
        parts, _ = queued[0]
    try:
        _advance(parts, os.writev(fd, parts))
    except BlockingIOError:
        return False
    except OSError as exc:
        backlog.error = exc
        parts.clear()
    if parts:
        return False
    with backlog.cond:
        queued.pop(0)
        backlog.cond.notify_all()
        return not queued


_writer: _Writer | None = None
_writer_lock = threading.Lock()


def _shared_writer() -> _Writer:
    global _writer
    with _writer_lock:
        if _writer is None or not _writer._thread.is_alive():
            _writer = _Writer()
        return _writer


class Pipes:
    """The pipe ends one process holds: ``outgoing[(peer, tag)]`` and ``incoming[...]``."""

    def __init__(self, outgoing: dict[Channel, int], incoming: dict[Channel, int]) -> None:
        self.outgoing = outgoing
        self.incoming = incoming
        self._backlog = _Backlog()
        self._writer = _shared_writer()
        fds = [*outgoing.values(), *incoming.values()]
        self._finalizer = weakref.finalize(self, _close_all, fds)

    def send(self, channel: Channel, parts: list[Tensor]) -> None:
        """Write contiguous CPU tensors, in order, as one message. What the pipe has room for
        is written now (the tensors may then be freed at once); the rest is left to the
        writer thread, and the tensors must not change until it is written (``flush``)."""
        backlog = self._backlog
        if backlog.error is not None:
            raise PipeClosed(f"a write to the pipes failed: {backlog.error}")
        fd = self.outgoing[channel]
        views = [_bytes_of(t) for t in parts if t.numel()]
        with backlog.cond:
            waiting = backlog.queued.setdefault(fd, [])
            if not waiting:  # nothing ahead of it: write what fits now
                try:
                    _advance(views, os.writev(fd, views))
                except BlockingIOError:
                    pass
                except OSError as exc:
                    raise PipeClosed(f"a write to the pipe failed: {exc}") from exc
                if not views:
                    return
            waiting.append((views, parts))
        self._writer.put(fd, backlog)

    def recv(self, channel: Channel, timeout: float) -> Received:
        """The next message of ``channel`` (``envelope``), read whole within ``timeout``."""
        fd = self.incoming[channel]
        deadline = time.monotonic() + timeout
        fixed = torch.empty(envelope.FIXED_BYTES, dtype=torch.uint8)
        self._read_into(fd, _bytes_of(fixed), deadline, timeout)
        words = fixed.view(torch.int64).tolist()
        extra = 8 * words[2] - envelope.FIXED_BYTES
        if extra:
            rest = torch.empty(extra, dtype=torch.uint8)
            self._read_into(fd, _bytes_of(rest), deadline, timeout)
            words += rest.view(torch.int64).tolist()
        described, form, info, structure = envelope.items_of(words)
        tensors: list[Tensor | None] = []
        for item in described:
            if item is None:
                tensors.append(None)
                continue
            t = torch.empty(item.shape, dtype=item.dtype)
            if item.nbytes:
                self._read_into(fd, _bytes_of(t), deadline, timeout)
            tensors.append(t.requires_grad_(item.requires_grad))
        return Received(words[0], tuple(tensors), form, info, structure)

    def readable(self, channel: Channel) -> bool:
        """Whether bytes wait to be read on ``channel`` now (a closed writer alone is not)."""
        poller = select.poll()
        poller.register(self.incoming[channel], select.POLLIN)
        return any(events & select.POLLIN for _, events in poller.poll(0))

    @staticmethod
    def _read_into(fd: int, view: memoryview, deadline: float, timeout: float) -> None:
        while view:
            try:
                got = os.readv(fd, [view])
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipeTimeout(f"nothing arrived in {timeout:g} s") from None
                _readable_within(fd, left)
                continue
            if got == 0:
                raise PipeClosed("the sending process closed its end")
            view = view[got:]

    def flush(self, timeout: float) -> None:
        """Wait until everything sent is written (or a write failed)."""
        backlog = self._backlog
        deadline = time.monotonic() + timeout
        with backlog.cond:
            while len(backlog) and backlog.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipeTimeout(f"sends not written in {timeout:g} s")
                backlog.cond.wait(left)
        if backlog.error is not None:
            raise PipeClosed(f"a write to the pipes failed: {backlog.error}")

    def close(self) -> None:
        self._finalizer()


def _bytes_of(t: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, to read into or write from."""
    array = t.detach().view(-1).view(torch.uint8).numpy()
    return memoryview(array)  # type: ignore[arg-type]  # numpy declares __buffer__ from 3.12 on


def _readable_within(fd: int, seconds: float) -> None:
    """Wait until ``fd`` has something to read (or its writer closed it), at most ``seconds``."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll(max(seconds * 1000, 0))


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _grow(fd: int) -> None:
    """Ask for a bigger pipe buffer, so that writes block less often; best effort."""
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)


def open_pipes(
    receives: Iterable[Channel], sends: Iterable[Channel], group: dist.ProcessGroup | None
) -> Pipes | None:
    """Open a pipe for every channel between this process and a peer on the same machine.

    Collective over ``group`` (every rank calls it, with the channels it receives and sends
    on, in global ranks). Channels with peers on other machines are left out; returns None
    when there are none to open. The pipes live in a fresh folder that is removed once both
    ends of every pipe are open.
    """
    me = dist.get_rank()
    size = dist.get_world_size(group)
    hosts: list[tuple[int, str] | None] = [None] * size
    dist.all_gather_object(hosts, (me, socket.gethostname()), group=group)
    host_of = dict(item for item in hosts if item is not None)
    mine = host_of[me]
    receives = [c for c in receives if host_of.get(c[0]) == mine and c[0] != me]
    sends = [c for c in sends if host_of.get(c[0]) == mine and c[0] != me]
    folder: list[str | None] = [None]
    first = dist.get_global_rank(group, 0) if group is not None else 0
    if me == first:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        folder[0] = tempfile.mkdtemp(prefix="gpipe-pipes-", dir=base)
    dist.broadcast_object_list(folder, src=first, group=group)
    root = folder[0]
    assert root is not None

    def path(src: int, dst: int, tag: int) -> str:
        return os.path.join(root, f"{src}-{dst}-{tag}")

    incoming: dict[Channel, int] = {}
    outgoing: dict[Channel, int] = {}
    try:
        for peer, tag in receives:
            os.mkfifo(path(peer, me, tag), 0o600)
        dist.barrier(group=group)
        for peer, tag in receives:  # a read end opens without a writer
            fd = os.open(path(peer, me, tag), os.O_RDONLY | os.O_NONBLOCK)
            _grow(fd)
            incoming[(peer, tag)] = fd
        dist.barrier(group=group)
        for peer, tag in sends:  # every read end is open: the write ends open at once
            fd = os.open(path(me, peer, tag), os.O_WRONLY | os.O_NONBLOCK)
            outgoing[(peer, tag)] = fd  # non-blocking: a full pipe is the writer thread's
        dist.barrier(group=group)
        for peer, tag in receives:  # both ends are open: the names are no longer needed
            os.unlink(path(peer, me, tag))
        dist.barrier(group=group)
        if me == first:
            os.rmdir(root)
    except BaseException:
        _close_all([*incoming.values(), *outgoing.values()])
        raise
    if not incoming and not outgoing:
        return None
    return Pipes(outgoing, incoming)
