"""What a failed step leaves behind in its stages, forgotten the same way by both facades."""

from __future__ import annotations

from collections.abc import Iterable

from gpipe.runtime.batchnorm import discard_deferred_batch_norm
from gpipe.runtime.stage import Stage

__all__ = ["forget_failed_step"]


def forget_failed_step(stages: Iterable[Stage]) -> None:
    """Drop each stage's saved micro-batches and the BatchNorm statistics it deferred, so that
    the next step starts clean: a retried mini-batch is neither half-remembered nor counted
    twice in the running statistics."""
    for stage in stages:
        stage.clear()
        discard_deferred_batch_norm(stage.module)
