"""Clipping gradients by their global norm when each rank of a pipeline holds only some."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

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
    the other ranks' norms, then raises StageError naming ``stage``, this rank's. Sharded
    gradients (DTensors) count each replica's shard, summed over the replicas."""
    grads = [p.grad.detach() for p in counted if p.grad is not None]
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    total = _local_norm(whole, norm_type, device)
    if sharded:  # a shard's part of the norm, then the replicas' shards together
        mesh_group = next(g for g in grads if isinstance(g, DTensor)).device_mesh.get_group()
        shards = _local_norm(sharded, norm_type, device)
        _reduce(shards, norm_type, mesh_group, timeout, stage)
        total = torch.maximum(total, shards) if norm_type == float("inf") else total + shards
    _reduce(total, norm_type, group, timeout, stage)
    norm = total[0] if norm_type == float("inf") else total[0] ** (1.0 / norm_type)
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for p in scaled:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def _local_norm(grads: list[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """This rank's part: the largest magnitude, or the sum of the p-th powers, in float64."""
    if norm_type == float("inf"):
        local = max((g.abs().max() for g in grads if g.numel()), default=torch.tensor(0.0))
        return local.to(device, torch.float64).reshape(1)
    local = sum(
        (g.double().norm(norm_type) ** norm_type for g in grads),
        torch.zeros((), dtype=torch.float64, device=device),
    )
    return local.reshape(1).clone()


def _reduce(
    value: Tensor, norm_type: float, group: dist.ProcessGroup | None, timeout: float, stage: int
) -> None:
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    work = dist.all_reduce(value, op=op, group=group, async_op=True)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    bounded_wait(work, timeout, stage, f"waiting for the gradient norms of ranks {ranks}")
