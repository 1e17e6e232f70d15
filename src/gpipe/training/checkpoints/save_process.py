"""A rank's checkpoints written by a process of its own, so that writing one takes nothing
from training but idle CPU time.

A thread that writes beside the training thread shares its Python lock: ``torch.save``
hands it back and forth thousands of times a checkpoint, and each time the training thread
may wait. ``SaveProcess`` instead keeps a copy of the rank's state in shared memory (made
once, refilled at every save while training waits), and a helper process, at the lowest
CPU priority, turns it into the checkpoint: ``torch.distributed.checkpoint``'s save over a
process group of the helpers alone, then description, digests, manifest last, rename,
check and retention, as ``finish_save`` and ``prune_checkpoints`` do. The helper dies with
its rank (Linux's parent-death signal): a checkpoint it leaves half written stays a
``.partial`` folder, never loaded, cleared by the next start.

Starting a helper costs an interpreter and an import of torch (about two seconds of one
core), once per run; ``CheckpointWriter`` uses one where the state is large enough for that
to pay.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import sys
import traceback
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["SaveProcess", "shared_memory_room", "state_bytes"]

_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent thread ends
_STARTING = 300.0  # seconds a helper may take to start (an interpreter, torch, its group)


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in the state: the helper's shared buffer of that index."""

    index: int


@dataclass(frozen=True)
class _Peers:
    """How the helpers of the writing ranks find each other: rank, count, and the store
    that the first rank's process serves."""

    rank: int
    world: int
    host: str
    port: int
    timeout: float


@dataclass(frozen=True)
class _Job:
    """One checkpoint for the helper to write."""

    step: int
    root: str
    description: dict[str, Any]
    skeleton: Any
    retention: Any


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in ``state``."""
    leaves = pytree.tree_leaves(state)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, Tensor))


def shared_memory_room() -> float:
    """Bytes free in ``/dev/shm``, where the shared copies live (unbounded where it is not
    a folder of its own); containers often give it 64 MiB."""
    try:
        found = os.statvfs("/dev/shm")
    except OSError:
        return float("inf")
    return float(found.f_bavail * found.f_frsize)


@contextlib.contextmanager
def _main_left_behind() -> Iterator[None]:
    """Start a process without running the starter's main module again: a started process
    imports ``__main__`` by its path or name unless it has neither, and a user's training
    script with no ``if __name__ == "__main__"`` guard would train again in the helper."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class SaveProcess:
    """This rank's helper process and the shared copy of its state. ``start`` is collective
    over ``writers`` (every rank that writes): the first one serves the store through which
    the helpers form their own process group."""

    def __init__(self, writers: dist.ProcessGroup | None, timeout: float) -> None:
        self._writers, self._timeout = writers, timeout
        self._process: Any = None
        self._conn: Any = None
        self._store: Any = None  # served by the first rank's process, for the helpers
        self._buffers: list[Tensor] = []
        self._step: int | None = None  # of the save in flight
        self._reply: tuple[Any, ...] | None = None

    def start(self) -> None:
        """Start the helper and wait until the helpers' group is formed; collective."""
        distributed = dist.is_initialized()
        rank = dist.get_rank(self._writers) if distributed else 0
        world = dist.get_world_size(self._writers) if distributed else 1
        where: list[Any] = [None]
        if rank == 0 and world > 1:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            wait = datetime.timedelta(seconds=self._timeout)
            self._store = dist.TCPStore(host, 0, None, True, wait, wait_for_workers=False)
            where[0] = (host, self._store.port)
        if world > 1:
            first = dist.get_global_rank(self._writers, 0) if self._writers else 0
            dist.broadcast_object_list(where, src=first, group=self._writers)
        host, port = where[0] or ("", 0)
        peers = _Peers(rank, world, host, port, self._timeout)
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        lineage = (os.getppid(), os.getpid())
        self._process = context.Process(
            target=_serve, args=(child, peers, lineage), name="gpipe-save", daemon=True
        )
        with _main_left_behind():
            self._process.start()
        child.close()
        weakref.finalize(self, _shut_down, self._process, self._conn)
        try:
            self._receive(_STARTING, "starting")
        except BaseException:
            self.abandon()
            raise

    def submit(
        self, step: int, state: Any, root: Path, description: dict[str, Any], retention: Any
    ) -> None:
        """Copy ``state`` into the shared buffers and have the helper write it as step
        ``step``'s checkpoint; returns once the copy is made."""
        tensors = [t for t in pytree.tree_leaves(state) if isinstance(t, Tensor)]
        if [(b.shape, b.dtype) for b in self._buffers] != [(t.shape, t.dtype) for t in tensors]:
            flats, places = _shared_layout(tensors)
            self._buffers = _views(flats, places)
            self._conn.send(("buffers", flats, places))
        with torch.no_grad():
            for buffer, tensor in zip(self._buffers, tensors, strict=True):
                buffer.copy_(tensor.detach())
        counter = iter(range(len(tensors)))
        skeleton = pytree.tree_map_only(Tensor, lambda _: _Slot(next(counter)), state)
        self._conn.send(("save", _Job(step, str(root), description, skeleton, retention)))
        self._step, self._reply = step, None

    @property
    def in_flight(self) -> int | None:
        """The step being written, if any."""
        if self._step is not None and self._reply is None:
            with contextlib.suppress(EOFError, OSError):  # ended: wait() says so
                if self._conn.poll():
                    self._reply = self._conn.recv()
        return self._step if self._reply is None else None

    def wait(self) -> tuple[Path, list[Path], str | None] | None:
        """Wait for the save in flight: its checkpoint, what retention removed, and why it
        did not verify (None if it did). None when no save was in flight."""
        if self._step is None:
            return None
        step, self._step = self._step, None
        reply, self._reply = self._reply, None
        if reply is None:
            _hurry(self._process.pid)  # training waits for it now: idle time is not enough
            reply = self._receive(None, f"writing the checkpoint of step {step}")
        if reply[0] == "failed":
            raise _failure(f"saving the checkpoint of step {step} failed", reply[1])
        return Path(reply[1]), [Path(p) for p in reply[2]], reply[3]

    def _receive(self, seconds: float | None, doing: str) -> tuple[Any, ...]:
        """The helper's next reply; its death, or no reply in ``seconds``, is an error."""
        waited = 0.0
        try:
            while not self._conn.poll(1.0):
                waited += 1.0
                if not self._process.is_alive():
                    break
                if seconds is not None and waited >= seconds:
                    raise RuntimeError(f"the process {doing} gave no answer in {seconds:.0f} s")
            reply = self._conn.recv()
        except (EOFError, OSError):  # it ended before it answered
            self._process.join(timeout=10)
            raise RuntimeError(
                f"the process {doing} ended (exit code {self._process.exitcode})"
            ) from None
        if reply[0] == "failed" and doing == "starting":
            raise _failure("the checkpoint writing process failed to start", reply[1])
        return reply

    def abandon(self) -> None:
        """Stop the helper at once, a checkpoint in flight left unfinished."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()
        self._step = None

    def close(self) -> None:
        """Stop the helper once it has nothing to do."""
        if self._process is not None:
            _shut_down(self._process, self._conn)


_Place = tuple[torch.dtype, int, torch.Size]  # a tensor's dtype, offset and shape in its flat


def _shared_layout(tensors: list[Tensor]) -> tuple[dict[torch.dtype, Tensor], list[_Place]]:
    """One flat tensor in shared memory per dtype, and where each tensor lies in its flat:
    a file descriptor per dtype rather than one per tensor (a large model's optimizer state
    has thousands of tensors, more than a process may hold open)."""
    totals: dict[torch.dtype, int] = {}
    places = []
    for t in tensors:
        places.append((t.dtype, totals.get(t.dtype, 0), t.shape))
        totals[t.dtype] = totals.get(t.dtype, 0) + t.numel()
    flats = {d: torch.empty(n, dtype=d).share_memory_() for d, n in totals.items()}
    return flats, places


def _views(flats: dict[torch.dtype, Tensor], places: list[_Place]) -> list[Tensor]:
    return [flats[d][at : at + shape.numel()].view(shape) for d, at, shape in places]


def _hurry(pid: int) -> None:
    """Let the helper run as an ordinary process, where the system allows it (leaving
    ``SCHED_IDLE`` needs a nice limit or privilege): on a machine with no idle CPU it would
    otherwise never finish while training waits for it."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))


def _failure(what: str, trace: str) -> RuntimeError:
    """The helper's error as one line that says what failed and why, its traceback a note."""
    lines = trace.strip().splitlines()
    error = RuntimeError(f"{what} in the writing process: {lines[-1] if lines else 'no reason'}")
    error.add_note(f"the writing process's traceback:\n{trace}")
    return error


def _shut_down(process: Any, conn: Any) -> None:
    with contextlib.suppress(OSError, ValueError):
        conn.send(("stop",))
    process.join(timeout=10)
    if process.is_alive():
        process.kill()
        process.join(timeout=10)


def _tie_to_parent(parent: int) -> None:
    """Die with the rank that started this process, and take only idle CPU time."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        try:  # run only when no other task of the machine wants the CPU
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, 19)
    if os.getppid() != parent:  # it died before the signal was set
        os._exit(1)


def _join(peers: _Peers) -> None:
    """The helpers' own process group, over the store the first rank serves."""
    if peers.world == 1:
        return
    wait = datetime.timedelta(seconds=peers.timeout)
    store = dist.TCPStore(peers.host, peers.port, None, False, wait)
    prefixed = dist.PrefixStore("gpipe-save/", store)
    dist.init_process_group(
        "gloo", store=prefixed, rank=peers.rank, world_size=peers.world, timeout=wait
    )


def _serve(conn: Any, peers: _Peers, lineage: tuple[int, int]) -> None:
    """The helper: form the group, then write each checkpoint asked for until told to stop
    or the rank is gone."""
    _tie_to_parent(lineage[1])
    torch.set_num_threads(1)
    try:
        _join(peers)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready",))
    buffers: list[Tensor] = []
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "stop":
            break
        if message[0] == "buffers":
            buffers = _views(message[1], message[2])
            continue
        try:
            conn.send(("saved", *_write(message[1], buffers, lineage)))
        except BaseException:
            conn.send(("failed", traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()


def _write(job: _Job, buffers: list[Tensor], lineage: tuple[int, int]) -> tuple[Any, ...]:
    """One checkpoint, whole: the state's files, then what completes it."""
    import torch.distributed.checkpoint as dcp

    from gpipe.training.checkpoints.format import begin_save, finish_save, verify_checkpoint
    from gpipe.training.checkpoints.retention import prune_checkpoints
    from gpipe.training.elastic import kill_point

    root, step = Path(job.root), job.step
    state = pytree.tree_map_only(_Slot, lambda slot: buffers[slot.index], job.skeleton)
    partial = begin_save(root, step, None)
    dcp.save(state, checkpoint_id=partial, no_dist=not dist.is_initialized())
    path = finish_save(
        root, step, job.description, None, on_written=lambda: kill_point("save", step, lineage)
    )
    if dist.is_initialized() and dist.get_rank() != 0:
        return str(path), [], None
    problems = verify_checkpoint(path, checksums=False)
    if problems:  # never prune on the strength of a checkpoint that does not verify
        return str(path), [], "; ".join(problems)
    removed = prune_checkpoints(root, job.retention, written=path)
    return str(path), [str(p) for p in removed], None
