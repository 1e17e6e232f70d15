"""Living with torchrun's elastic agent: which job and attempt a worker is, joining the
process group afresh on every attempt, and the fault tests' way to lose a process at a
chosen point (a real SIGKILL)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from gpipe.comm.process_group import backend_for, init_process_group

__all__ = ["KILL_VARIABLE", "job_id", "join_process_group", "kill_point", "restart_count"]

# For tests only: JSON such as {"rank": 1, "step": 7, "at": "step", "once": "/tmp/x/killed"}.
# The process of global rank ``rank`` (any process that reads the variable, without one)
# kills itself with SIGKILL when it reaches ``at`` of step ``step``: "step" as it starts
# training that step, "save" once it has written its part of that step's checkpoint (before
# the checkpoint is complete), "node" like "step" but taking its torchrun agent down first,
# as a machine that is lost would. With ``once``, it does so only if that file does not exist
# yet, and creates it first; without, only on the agent's first attempt. A list of such plans
# (benchmarks/soak.py's) is followed plan by plan.
KILL_VARIABLE = "GPIPE_TEST_KILL"
_KILL_POINTS = ("step", "save", "node")


def job_id() -> str | None:
    """The id of the torchrun job this process is a worker of (its rendezvous id), if any."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def restart_count() -> int:
    """How many times this worker's agent has restarted its processes after a failure (0 on
    the first attempt, and outside torchrun). A restart that only admits or loses a machine
    keeps the count, so a job learns that it was here before from its run folder too."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


_STORE_KEY = "gpipe/attempt-store"  # in the agent's store: "PORT NONCE" of this attempt's own


def join_process_group(device: torch.device, timeout: float) -> None:
    """Join the default process group from torchrun's environment, as
    ``gpipe.comm.process_group.init_process_group`` does, unless joined already.

    Where the agent lends its own store to the workers (TORCHELASTIC_USE_AGENT_STORE, the
    default of torchrun's c10d rendezvous), that store outlives a restart, and the addresses
    the previous attempt's processes left in it would have the new ones connect to dead
    peers. So rank 0 opens a store of this attempt's own and announces it in the agent's;
    the others take the announcement that leads to a live store holding its nonce.
    """
    if dist.is_initialized():
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        init_process_group(device, timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, wait = os.environ["MASTER_ADDR"], datetime.timedelta(seconds=max(timeout, 60.0))
    agent = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=wait)
    store: dist.Store
    if rank == 0:
        nonce = uuid.uuid4().hex
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=wait, wait_for_workers=False)
        store.set("gpipe/nonce", nonce)
        agent.set(_STORE_KEY, f"{store.port} {nonce}")
    else:
        store = _attempt_store(agent, host, wait)
    backend = backend_for(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=wait)


def _attempt_store(agent: dist.Store, host: str, wait: datetime.timedelta) -> dist.Store:
    """The store rank 0 of this attempt opened: an announcement left by an earlier attempt
    leads to a port where nothing listens, or to a store without its nonce."""
    deadline = time.monotonic() + wait.total_seconds()
    probe = datetime.timedelta(seconds=2)
    while True:
        port, nonce = agent.get(_STORE_KEY).decode().split()
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=probe)
            if store.get("gpipe/nonce").decode() == nonce:
                store.set_timeout(wait)
                return store
        except RuntimeError:  # DistStoreError and DistNetworkError are RuntimeErrors
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank 0 announced no live store of this attempt in torchrun's agent store at "
                f"{host} within {wait.total_seconds():g} s"
            )
        time.sleep(0.1)


def _planned_kills() -> list[dict[str, object]]:
    text = os.environ.get(KILL_VARIABLE)
    if not text:
        return []
    plans = json.loads(text)
    plans = plans if isinstance(plans, list) else [plans]
    for plan in plans:
        if not isinstance(plan, dict) or plan.get("at", "step") not in _KILL_POINTS:
            raise ValueError(
                f"{KILL_VARIABLE} must be JSON with rank, step and at (one of {_KILL_POINTS}), "
                f"or a list of such plans, got {text!r}"
            )
    return plans


def kill_point(at: str, step: int, lineage: tuple[int, int] | None = None) -> None:
    """Kill this process with SIGKILL here if ``GPIPE_TEST_KILL`` plans it (tests only).

    ``lineage`` is ``(agent, trainer)`` where this is a trainer's helper process (the one
    that writes its checkpoints): the planned loss is the trainer's, so it goes first."""
    for plan in _planned_kills():
        _follow(plan, at, step, lineage)


def _follow(plan: dict[str, object], at: str, step: int, lineage: tuple[int, int] | None) -> None:
    wanted = plan.get("at", "step")
    if ("save" if wanted == "save" else "step") != at:
        return
    rank = plan.get("rank", int(os.environ.get("RANK", "0")))
    if rank != int(os.environ.get("RANK", "0")) or plan.get("step") != step:
        return
    once = plan.get("once")
    if once is None:
        if restart_count() > 0:
            return
    else:
        try:
            Path(str(once)).touch(exist_ok=False)
        except FileExistsError:
            return
    agent, trainer = lineage if lineage is not None else (os.getppid(), os.getpid())
    if wanted == "node":
        os.kill(agent, signal.SIGKILL)
    if trainer != os.getpid():
        os.kill(trainer, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
