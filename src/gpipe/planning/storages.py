"""Tensors as the profiler and the meter count them: by storage, each storage once."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from gpipe.comm.payload import tensors_of

__all__ = ["storage_key", "tensors_in"]


def storage_key(t: Tensor) -> int:
    """What identifies ``t``'s storage, shared by all its views, while the storage lives."""
    return t.untyped_storage()._cdata


def tensors_in(value: Any) -> list[Tensor]:
    """The tensors of a payload (none for None)."""
    if value is None:
        return []
    return list(tensors_of(value))
