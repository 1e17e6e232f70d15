"""Joining and leaving the default process group, the device and backend a rank uses, and
waiting for a collective at most the pipeline's timeout."""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from gpipe.errors import StageError, first_line

__all__ = [
    "backend_for",
    "bounded_wait",
    "default_device",
    "finish_process_group",
    "init_process_group",
    "rank_device",
]


def default_device() -> torch.device:
    """This rank's device when none is given: ``cuda:LOCAL_RANK`` where CUDA is, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def rank_device(device: torch.device | str | None) -> torch.device:
    """This rank's device: ``device`` as given, a bare ``"cuda"`` this process's GPU
    (``cuda:LOCAL_RANK``), None the default (``default_device``). A GPU this machine does not
    have is refused at once; where it comes from the local rank, on every process of the
    machine alike, so that none is left waiting for a peer that failed."""
    resolved = default_device() if device is None else torch.device(device)
    if resolved.type != "cuda":
        return resolved
    count = torch.cuda.device_count()
    if resolved.index is None or device is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local > count:
            raise ValueError(
                f"{local} processes on this machine and {count} CUDA device(s): each process "
                "takes cuda:LOCAL_RANK; start one process per GPU, or pass device='cpu'"
            )
        resolved = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if resolved.index >= count:
        raise ValueError(f"device {resolved}: this machine has {count} CUDA device(s)")
    return resolved


def init_process_group(device: torch.device, timeout: float = 60.0) -> None:
    """Join the default process group from torchrun's environment, if not joined yet:
    NCCL for CUDA devices, gloo otherwise."""
    if dist.is_initialized():
        return
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [v for v in needed if v not in os.environ]
    if missing:
        raise RuntimeError(
            "Pipeline needs a process group and found no torchrun environment (missing "
            f"{', '.join(missing)}): run under torchrun or gpipe.launch, or call "
            "torch.distributed.init_process_group first"
        )
    dist.init_process_group(
        backend_for(device), timeout=datetime.timedelta(seconds=max(timeout, 60.0))
    )


def backend_for(device: torch.device) -> str:
    """The process group's backend for ``device`` (and, on CUDA, make it the current one):
    gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo beside it for the few small CPU
    tensors the bookkeeping exchanges (row counts, flags, timings), which NCCL refuses."""
    if device.type != "cuda":
        return "gloo"
    torch.cuda.set_device(device)
    return "cpu:gloo,cuda:nccl"


def finish_process_group() -> None:
    """Leave the default process group cleanly before the process exits.

    A rank that exits while its peer is still reading the last collective's bytes can make
    gloo abort the peer; waiting at a barrier and destroying the group first prevents that.
    A peer that has failed already does not make this one fail too.
    """
    if not dist.is_initialized():
        return
    # A peer that is gone already (DistBackendError is a RuntimeError) leaves nothing to wait for.
    with contextlib.suppress(RuntimeError):
        dist.barrier()
    dist.destroy_process_group()


_WATCH_S = 0.05  # seconds between two looks of a ``watch`` while a wait goes on


def bounded_wait(
    work: dist.Work,
    timeout: float,
    stage: int,
    what: str,
    who: str = "a peer",
    watch: Callable[[], None] | None = None,
) -> None:
    """Wait at most ``timeout`` seconds for ``work`` (a collective or transfer started with
    ``async_op=True``). A peer that stops answering, or is gone, ends the wait in a
    StageError naming ``stage`` and ``what`` it waited for ("waiting for the loss ...");
    ``who`` names the peer when it is lost ("a replica"). ``watch`` is called every 50 ms
    while the wait goes on, and may end it by raising (a peer said that it failed); the wait
    itself ends as soon as ``work`` completes."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        slice_s = left if watch is None else min(left, _WATCH_S)
        try:
            work.wait(datetime.timedelta(seconds=max(slice_s, 0.001)))
            return
        except RuntimeError as exc:  # gloo: "Operation timed out!", or its connection closed
            first = first_line(exc)
            timed_out = "timed out" in first.lower() or "timeout" in first.lower()
            if not timed_out or slice_s >= left:
                reason = f"timed out after {timeout:g} s" if timed_out else f"lost {who} ({first})"
                raise StageError(stage, f"{reason} {what}") from exc
        assert watch is not None  # only a watched wait waits in slices
        watch()
