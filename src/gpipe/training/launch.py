"""Starting K local processes for a one-machine run, on torchrun's elastic launcher."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from gpipe.comm.process_group import finish_process_group
from gpipe.errors import PipelineError

__all__ = ["LaunchError", "launch", "threads_per_process"]

_OWN_STORES = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # read by torchrun's c10d rendezvous


class LaunchError(PipelineError):
    """A launched process failed; the message carries each failed rank's error."""


def threads_per_process(local_processes: int) -> int:
    """Intra-op threads for each of ``local_processes`` processes sharing this machine: the
    cores this process may run on (its affinity mask, which containers and ``taskset``
    narrow), shared out evenly, at least one. Without this each process would start one
    thread per core and the processes would oversubscribe the machine."""
    if isinstance(local_processes, bool) or not isinstance(local_processes, int):
        raise ValueError(f"local_processes must be a positive integer, got {local_processes!r}")
    if local_processes < 1:
        raise ValueError(f"local_processes must be a positive integer, got {local_processes!r}")
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // local_processes)


@record
def _entry(fn: Callable[..., Any], threads: int | None, *args: Any) -> Any:
    if threads is not None:
        torch.set_num_threads(threads)
    result = fn(*args)
    finish_process_group()
    return result


def _reason(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
    text = str(message).strip() or f"exit code {failure.exitcode}"
    return text.splitlines()[-1] if "Traceback" in text else text


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    threads: int | str | None = "auto",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    start_method: str = "spawn",
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nprocs`` new processes on this machine; returns rank -> result.

    Each process finds torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), so
    ``gpipe.Pipeline`` inside ``fn`` joins the process group by itself. ``fn`` must be
    importable by name (a module-level function). ``threads`` sets each process's intra-op
    thread count: ``"auto"`` (the default) shares this machine's cores among the processes
    (``threads_per_process``), an int sets it, None leaves PyTorch's default. If any process
    fails, the others are stopped; then torchrun's agent starts them all again, up to
    ``max_restarts`` times (each new process finds TORCHELASTIC_RESTART_COUNT above 0), and
    after that LaunchError names the failed ranks.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if threads == "auto":
        threads = threads_per_process(nprocs)
    elif threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ValueError(f"threads must be 'auto', None or a positive integer, got {threads!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a non-negative integer, got {max_restarts!r}")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"gpipe-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
    )
    # The agent's store outlives a restart, and the addresses the lost processes left in it
    # would have the new ones connect to dead peers: each attempt gets a store of its own.
    shared = os.environ.get(_OWN_STORES)
    os.environ[_OWN_STORES] = "1"
    try:
        return elastic_launch(config, _entry)(fn, threads, *args)
    except ChildFailedError as exc:
        lines = [f"rank {rank}: {_reason(f)}" for rank, f in sorted(exc.failures.items())]
        raise LaunchError("launched processes failed:\n" + "\n".join(lines)) from None
    finally:
        if shared is None:
            del os.environ[_OWN_STORES]
        else:
            os.environ[_OWN_STORES] = shared
