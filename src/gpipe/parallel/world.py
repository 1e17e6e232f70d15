"""The world's processes as pipelines, replicas and tensor ranks: ``Pipeline``'s arguments for
the dimensions beside the pipeline, checked before any process group work, and the groups each
rank joins for them.

Without tensor ranks the replicas make their own groups (``Replicas.create``); with them, one
``DeviceMesh`` over the world gives every group, pipeline, data and tensor alike
(``gpipe.parallel.tensor.ParallelMesh``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gpipe.comm.process_group import init_process_group
from gpipe.parallel.replicas import Replicas, check_bucket_bytes
from gpipe.parallel.sharding import Sharding, check_shard
from gpipe.parallel.tensor import ParallelMesh, TensorPlan, check_tensor_parallel, resolve_plan

__all__ = ["Dimensions", "World", "check_dimensions", "join"]


@dataclass(frozen=True)
class Dimensions:
    """The dimensions beside the pipeline, checked: D replicas (``sharding`` over them, the
    gradient buckets' size) and T tensor ranks (``tensor_plan`` splits each stage over them)."""

    data_parallel: int
    tensor_parallel: int
    bucket_bytes: float | None
    sharding: Sharding | None
    tensor_plan: TensorPlan | None
    loss_parallel: bool


@dataclass(frozen=True)
class World:
    """What this rank joined: its pipeline's group (None: the whole world), its replicas and,
    with tensor ranks, the world's mesh."""

    group: dist.ProcessGroup | None
    replicas: Replicas | None
    mesh: ParallelMesh | None

    @property
    def several_pipelines(self) -> bool:
        """Whether other pipelines run beside this one (replicas, or other tensor ranks)."""
        return self.replicas is not None or self.mesh is not None


def _check_data_parallel(data_parallel: object, group: dist.ProcessGroup | None) -> int:
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be a positive integer, got {data_parallel!r}")
    if data_parallel != 1 and group is not None:
        raise ValueError(
            "pass group or data_parallel, not both: data_parallel lays its pipelines out "
            "over the whole world"
        )
    return data_parallel


def _check_tensor_parallel(
    tensor_parallel: object,
    tp_plan: object,
    loss_parallel: object,
    group: dist.ProcessGroup | None,
    module: nn.Sequential,
) -> tuple[int, TensorPlan | None]:
    """T, and the plan that splits ``module``'s stages over T ranks (None for one)."""
    size = check_tensor_parallel(tensor_parallel)
    if not isinstance(loss_parallel, bool):
        raise TypeError(f"loss_parallel must be True or False, got {loss_parallel!r}")
    if loss_parallel and size == 1:
        raise ValueError(
            "loss_parallel=True splits the logits over tensor ranks and needs "
            "tensor_parallel > 1, got tensor_parallel=1"
        )
    if size > 1 and group is not None:
        raise ValueError(
            "pass group or tensor_parallel, not both: tensor_parallel lays its ranks out "
            "over the whole world"
        )
    if size == 1 and tp_plan is None:
        return size, None
    plan = resolve_plan(tp_plan, module, size)  # type: ignore[arg-type]  # checked inside
    if loss_parallel:
        plan = plan.with_split_logits(list(module.named_children())[-1][0])
    return size, (plan if size > 1 else None)


def check_dimensions(
    module: nn.Sequential,
    group: dist.ProcessGroup | None,
    *,
    data_parallel: object,
    bucket_bytes: object,
    shard: object,
    tensor_parallel: object,
    tp_plan: object,
    loss_parallel: object,
) -> Dimensions:
    """``Pipeline``'s arguments for replicas and tensor ranks, checked against the whole model
    ``module`` before any process group work, so that every rank refuses alike."""
    replicas = _check_data_parallel(data_parallel, group)
    buckets = check_bucket_bytes(bucket_bytes)
    sharding = check_shard(shard, replicas, module)
    size, plan = _check_tensor_parallel(tensor_parallel, tp_plan, loss_parallel, group, module)
    return Dimensions(replicas, size, buckets, sharding, plan, bool(loss_parallel))


def join(
    device: torch.device, group: dist.ProcessGroup | None, dims: Dimensions, timeout: float
) -> World:
    """Join the process group (unless given ``group``) and, with replicas or tensor ranks,
    their groups: collective over the world."""
    if group is None:
        init_process_group(device, timeout)
    sharded = dims.sharding is not None
    if dims.tensor_parallel > 1:
        mesh = ParallelMesh.create(device, dims.data_parallel, dims.tensor_parallel)
        pipeline = mesh.group("pipeline")
        if dims.data_parallel == 1:
            return World(pipeline, None, mesh)
        replicas = Replicas.on_mesh(mesh.group("data"), pipeline, timeout, sharded)
        return World(pipeline, replicas, mesh)
    if dims.data_parallel == 1:
        return World(group, None, None)
    replicas = Replicas.create(dims.data_parallel, float(timeout), sharded)
    return World(replicas.pipeline_group, replicas, None)
