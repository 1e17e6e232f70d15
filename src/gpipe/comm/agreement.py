"""Decisions every rank of a group must share (a cut of the model, a schedule): taken once,
on the group's first rank, and told to the others, who agree even where their own clocks or
inputs would not. A failure there is raised on every rank, so none waits for the others."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

__all__ = ["on_first_rank"]

T = TypeVar("T")


def on_first_rank(decide: Callable[[], T], group: dist.ProcessGroup | None, what: str) -> T:
    """``decide()`` run on rank 0 of ``group`` and its result given to every rank; if it
    raised, every rank raises ValueError naming ``what`` and the error."""
    decision: list[object] = [None, None]
    if dist.get_rank(group) == 0:
        try:
            decision = [decide(), None]
        except Exception as exc:  # every rank must hear of it, or the others would wait
            decision = [None, f"{type(exc).__name__}: {exc}"]
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(decision, src=source, group=group)
    if decision[1] is not None:
        raise ValueError(f"{what} on rank 0 failed: {decision[1]}")
    return decision[0]  # type: ignore[return-value]
