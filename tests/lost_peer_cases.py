"""What each process runs in tests/test_pipeline.py's silent-peer tests: a peer that stops
answering in one wait of a step (a collective, or a send's completion) ends the step on every
other rank in a StageError naming its stage, within the pipeline's timeout.

One rank is the silent peer: it stays out of the wait until every other rank has reported
its error (``PATIENCE`` at most), then joins it late, so that the collective its peers gave
up on completes and the shared processes stay in step for the next test. Transfers leave no
such way back (gloo closes a pair whose send timed out), so the send case runs on a group
of its own.
"""

import os
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.functional import mse_loss

from gpipe import Pipeline
from gpipe.comm.process_group import init_process_group

from .small_models import BALANCES, batch, bn_model, mlp

TIMEOUT = 1.0  # Pipeline(timeout=): the seconds each wait may take
PATIENCE = 10.0  # the silent peer waits at most this long for the others' errors


class _Silent(Exception):
    """Ends the silent peer's own step once it has taken part late."""


def _hear_out(folder: str) -> None:
    """Wait until every other rank has reported (or ``PATIENCE`` has passed)."""
    others = dist.get_world_size() - 1
    deadline = time.monotonic() + PATIENCE
    while len(os.listdir(folder)) < others and time.monotonic() < deadline:
        time.sleep(0.02)


def _report(folder: str, wait: Callable[[], object]) -> dict:
    """``wait()`` on a rank whose peer is silent: its error, and the seconds it took."""
    start = time.monotonic()
    try:
        wait()
        error = "no error"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    Path(folder, str(dist.get_rank())).write_text(error)
    return {"error": error, "seconds": seconds}


def _last_is_silent(folder: str, wait: Callable[[], object]) -> dict:
    """``wait()`` on every rank, the last one late."""
    if dist.get_rank() < dist.get_world_size() - 1:
        return _report(folder, wait)
    _hear_out(folder)
    wait()  # completes the collective its peers gave up on
    return {}


def _scaled_step(data_parallel: int) -> tuple[Pipeline, torch.amp.GradScaler, torch.optim.SGD]:
    """A step with a loss scaler of an MLP over world / ``data_parallel`` stages."""
    init_process_group(torch.device("cpu"))
    k = dist.get_world_size() // data_parallel
    pipe = Pipeline(
        mlp(),
        BALANCES[k],
        chunks=2,
        loss_fn=mse_loss,
        data_parallel=data_parallel,
        timeout=TIMEOUT,
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = batch(8)
    pipe.step(x, y, scaler=scaler)
    return pipe, scaler, optimizer


def found_inf_stages(folder: str) -> dict:
    """The found-inf flag of loss scaling, reduced over the stages: the last is silent."""
    pipe, scaler, optimizer = _scaled_step(1)
    return _last_is_silent(folder, lambda: pipe.unscale_(scaler, optimizer))


def found_inf_replicas(folder: str) -> dict:
    """The found-inf flag, reduced over the replicas of one stage: the last is silent."""
    init_process_group(torch.device("cpu"))
    pipe, scaler, optimizer = _scaled_step(dist.get_world_size())
    return _last_is_silent(folder, lambda: pipe.unscale_(scaler, optimizer))


def clipping(folder: str) -> dict:
    """The gradient norm, summed over the stages: the last is silent."""
    pipe, _, _ = _scaled_step(1)
    return _last_is_silent(folder, lambda: pipe.clip_grad_norm_(1.0))


def batch_norm(folder: str) -> dict:
    """Deferred BatchNorm statistics, gathered over the replicas at the end of a step: the
    last replica runs its step, then is silent at the merge."""
    init_process_group(torch.device("cpu"))
    pipe = Pipeline(
        bn_model(),
        [6],
        chunks=2,
        loss_fn=lambda o, t: o.pow(2).mean(),
        deferred_batch_norm=True,
        data_parallel=dist.get_world_size(),
        timeout=TIMEOUT,
    )
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    if dist.get_rank() < dist.get_world_size() - 1:
        return _report(folder, lambda: pipe.step(x, x))
    replicas = pipe.replicas
    merge = replicas.merge_batch_norm

    def late(modules: list[nn.Module], stage: int) -> None:
        _hear_out(folder)
        merge(modules, stage)
        raise _Silent

    replicas.merge_batch_norm = late
    with suppress(_Silent):
        pipe.step(x, x)
    return {}


class _Stall(torch.autograd.Function):
    """The identity, whose backward waits until the peers have reported, then ends the step."""

    @staticmethod
    def forward(ctx, x: Tensor, folder: str) -> Tensor:
        ctx.folder = folder
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        _hear_out(ctx.folder)
        raise _Silent


class _Stalls(nn.Module):
    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def forward(self, x: Tensor) -> Tensor:
        return _Stall.apply(x, self.folder)


def sends(folder: str) -> dict:
    """Stage 1's last gradients, which stage 0 stops taking: its first backward stalls while
    the receive of the next gradients is posted, not the one after (gloo: a send completes
    when the receiver takes it). Its own group: gloo closes the pair of a send that timed
    out."""
    init_process_group(torch.device("cpu"))
    group = dist.new_group([0, 1])
    model = nn.Sequential(nn.Linear(4, 4), _Stalls(folder), nn.Linear(4, 4)).double()
    pipe = Pipeline(
        model,
        [2, 1],
        chunks=3,
        loss_fn=mse_loss,
        group=group,
        local_pipes=False,
        timeout=TIMEOUT,
    )
    x = torch.randn(6, 4, dtype=torch.float64)
    if pipe.is_last:
        return _report(folder, lambda: pipe.step(x, x))
    with suppress(_Silent):
        pipe.step(x, x)
    return {}
