"""Clipping gradients by their global norm when each rank of a pipeline holds only some."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.comm.process_group import bounded_wait
from gpipe.runtime.dtensors import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

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
    the other ranks' norms, then raises StageError naming ``stage``, this rank's. Split
    gradients (DTensors, over sharded replicas, tensor ranks or both) count each rank's
    shard, summed over the ranks that split them; a whole gradient counts once (it is the
    same on every tensor rank and, once reduced, on every replica)."""
    grads = [p.grad.detach() for p in counted if p.grad is not None]
    whole = [g for g in grads if not is_dtensor(g)]
    total = _local_norm(whole, norm_type, device)
    for (mesh, dims), shards in _by_split(grads).items():
        # the shards' part of the norm, summed over the ranks that hold the other shards
        part = _local_norm(shards, norm_type, device)
        for dim in dims:
            _reduce(part, norm_type, mesh.get_group(dim), timeout, stage)
        total = torch.maximum(total, part) if norm_type == float("inf") else total + part
    _reduce(total, norm_type, group, timeout, stage)
    norm = total[0] if norm_type == float("inf") else total[0] ** (1.0 / norm_type)
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for p in scaled:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def _by_split(grads: list[Tensor]) -> dict[tuple[DeviceMesh, tuple[int, ...]], list[Tensor]]:
    """This rank's shards of the DTensor gradients, grouped by their mesh and the mesh
    dimensions they are split along (over sharded replicas, tensor ranks or both); a
    gradient replicated along a dimension counts once there. In the order first met, the
    same on every rank that holds the same stages."""
    found: dict[tuple[DeviceMesh, tuple[int, ...]], list[Tensor]] = {}
    for grad in grads:
        if not is_dtensor(grad):
            continue
        if any(p.is_partial() for p in grad.placements):  # not reduced yet: reduce it
            from torch.distributed.tensor import Replicate  # loaded already: grad is one

            whole = [Replicate() if p.is_partial() else p for p in grad.placements]
            grad = grad.redistribute(placements=whole)
        dims = tuple(d for d, p in enumerate(grad.placements) if not p.is_replicate())
        found.setdefault((grad.device_mesh, dims), []).append(grad.to_local())
    return found


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
