"""Clipping gradients by their global norm when each rank of a pipeline holds only some."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    counted: Iterable[nn.Parameter],
    scaled: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float,
    *,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> Tensor:
    """The norm of the ``counted`` parameters' gradients over every rank of ``group``, with
    every ``scaled`` gradient multiplied so that the norm is at most ``max_norm``; returns the
    norm before clipping. Collective over ``group``."""
    grads = [p.grad.detach() for p in counted if p.grad is not None]
    if norm_type == float("inf"):
        local = max((g.abs().max() for g in grads), default=torch.tensor(0.0))
        total = local.to(device, torch.float64).reshape(1)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        norm = total[0]
    else:
        local = sum(
            (g.double().norm(norm_type) ** norm_type for g in grads),
            torch.zeros((), dtype=torch.float64, device=device),
        )
        total = local.reshape(1).clone()
        dist.all_reduce(total, group=group)
        norm = total[0] ** (1.0 / norm_type)
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for p in scaled:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
