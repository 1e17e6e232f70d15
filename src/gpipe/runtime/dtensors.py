"""Tensors split over ranks (PyTorch's DTensors), recognized without importing their module.

Importing ``torch.distributed.tensor`` takes about 0.7 s, a quarter of ``import gpipe``, in
every process a run starts, and most runs never make a DTensor. None can exist unless that
module was imported, so these checks look the class up among the imported modules instead;
the code that makes DTensors (tensor and expert parallelism, sharded replicas) imports it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["dtensor_like", "is_dtensor", "local_part"]


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor (a tensor split or replicated over ranks)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


def local_part(t: Tensor) -> Tensor:
    """This rank's part of ``t``: its shard if it is a DTensor, else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def dtensor_like(like: Tensor, local: Tensor) -> Tensor:
    """``local`` as this rank's part of a tensor laid out over the ranks as ``like`` is (its
    mesh, placements, shape and stride); ``local`` itself where ``like`` is not a DTensor."""
    if not is_dtensor(like):
        return local
    return type(like).from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )
