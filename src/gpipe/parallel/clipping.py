"""Clipping gradients by their global norm when each rank of a pipeline holds only some."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.comm.process_group import bounded_wait

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    counted: Iterable[nn.Parameter],
    scaled: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float,
    *,
    device: torch.device,
    group: dist.ProcessGroup | None,
    timeout: float,
    stage: int,
) -> Tensor:
    """The norm of the ``counted`` parameters' gradients over every rank of ``group``, with
    every ``scaled`` gradient multiplied so that the norm is at most ``max_norm``; returns the
    norm before clipping. Collective over ``group``; waits at most ``timeout`` seconds for
    the other ranks' norms, then raises StageError naming ``stage``, this rank's."""
    grads = [p.grad.detach() for p in counted if p.grad is not None]
    if norm_type == float("inf"):
        local = max((g.abs().max() for g in grads), default=torch.tensor(0.0))
        total = local.to(device, torch.float64).reshape(1)
        op = dist.ReduceOp.MAX
    else:
        local = sum(
            (g.double().norm(norm_type) ** norm_type for g in grads),
            torch.zeros((), dtype=torch.float64, device=device),
        )
        total = local.reshape(1).clone()
        op = dist.ReduceOp.SUM
    work = dist.all_reduce(total, op=op, group=group, async_op=True)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    bounded_wait(work, timeout, stage, f"waiting for the gradient norms of ranks {ranks}")
    norm = total[0] if norm_type == float("inf") else total[0] ** (1.0 / norm_type)
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for p in scaled:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
