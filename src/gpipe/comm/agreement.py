"""Decisions every rank of a group must share (a cut of the model, a schedule): taken once,
on the group's first rank, and told to the others, who agree even where their own clocks or
inputs would not (``on_first_rank``); and work each rank does for itself where a failure on
one must stop them all (``on_every_rank``). A failure is raised on every rank, so none waits
for the others."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import torch.distributed as dist

__all__ = ["on_every_rank", "on_first_rank"]

T = TypeVar("T")


def on_first_rank(
    decide: Callable[[], T],
    group: dist.ProcessGroup | None,
    what: str,
    *,
    passed_on: tuple[type[Exception], ...] = (),
) -> T:
    """``decide()`` run on rank 0 of ``group`` and its result given to every rank; if it
    raised, every rank raises: an exception of one of the ``passed_on`` types (each built
    from its message alone) as itself, anything else as ValueError naming ``what`` and the
    error. Bounded by the group's timeout, as every collective is."""
    decision: list[object] = [None, None, None]
    if dist.get_rank(group) == 0:
        try:
            decision = [decide(), None, None]
        except Exception as exc:  # every rank must hear of it, or the others would wait
            kind = next((i for i, t in enumerate(passed_on) if isinstance(exc, t)), None)
            text = str(exc) if kind is not None else f"{type(exc).__name__}: {exc}"
            decision = [None, kind, text]
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(decision, src=source, group=group)
    passed, message = decision[1], decision[2]
    if isinstance(passed, int):
        raise passed_on[passed](message)
    if message is not None:
        raise ValueError(f"{what} on rank 0 failed: {message}")
    return cast(T, decision[0])  # what decide() returned on rank 0, unpickled


def on_every_rank(
    work: Callable[[], None], what: str, group: dist.ProcessGroup | None = None
) -> None:
    """Run ``work`` on every rank of ``group``, where it may fail on some (each reads its own
    stage's weights): a failure anywhere is raised on every rank, as ValueError naming
    ``what``, so that none waits for the others later. Bounded by the group's timeout."""
    try:
        work()
        failed = None
    except Exception as exc:  # every rank must hear of it, or the others would wait
        failed = f"{type(exc).__name__}: {exc}"
    found: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, failed, group=group)
    if failed is not None:
        raise ValueError(f"{what}: {failed}")
    others = [(rank, text) for rank, text in enumerate(found) if text is not None]
    if others:
        rank, text = others[0]
        raise ValueError(f"{what} failed on rank {rank}: {text}")
