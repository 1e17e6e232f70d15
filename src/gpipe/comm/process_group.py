"""Joining and leaving the default process group, and the device and backend a rank uses."""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["backend_for", "default_device", "finish_process_group", "init_process_group"]


def default_device() -> torch.device:
    """This rank's device when none is given: ``cuda:LOCAL_RANK`` where CUDA is, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


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
