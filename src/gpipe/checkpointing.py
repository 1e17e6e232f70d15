"""Re-materialization: which micro-batches to recompute, replaying their random state, and
telling layers which pass they are in."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = [
    "CHECKPOINT_MODES",
    "RNGState",
    "check_checkpoint",
    "checkpointing",
    "is_checkpointing",
    "is_recomputing",
    "recomputing",
    "should_checkpoint",
]

CHECKPOINT_MODES = ("always", "except_last", "never")


def check_checkpoint(mode: object) -> str:
    """The mode as a string: anything whose ``str()`` names one (torchgpipe accepts that too)."""
    name = mode if isinstance(mode, str) else str(mode)
    if name not in CHECKPOINT_MODES:
        raise ValueError(
            f"checkpoint is not one of 'always', 'except_last', or 'never', got {mode!r}"
        )
    return name


def should_checkpoint(mode: str, microbatch: int, n_microbatches: int) -> bool:
    """Whether micro-batch ``microbatch`` keeps only its stage input and recomputes the rest.

    ``except_last`` spares the last micro-batch: under fill-drain its backward follows its
    forward at once, so recomputing it would buy no memory.
    """
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch < n_microbatches - 1
    return False


class _Phase(threading.local):
    checkpointing = False
    recomputing = False


_phase = _Phase()


def is_checkpointing() -> bool:
    """True inside a partition's first, graph-free pass over a micro-batch that will be
    recomputed in the backward."""
    return _phase.checkpointing


def is_recomputing() -> bool:
    """True inside the recomputation of a micro-batch's forward during the backward; a layer
    can skip side effects there (e.g. counting, logging, updating statistics twice)."""
    return _phase.recomputing


@contextlib.contextmanager
def checkpointing() -> Iterator[None]:
    """Mark the body, on this thread, as the first pass of a re-materialized micro-batch."""
    before = _phase.checkpointing
    _phase.checkpointing = True
    try:
        yield
    finally:
        _phase.checkpointing = before


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Mark the body, on this thread, as the recomputation of a micro-batch's forward."""
    before = _phase.recomputing
    _phase.recomputing = True
    try:
        yield
    finally:
        _phase.recomputing = before


class RNGState:
    """The random state a forward pass started from, so its recomputation draws the same masks."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cpu = torch.get_rng_state()
        self._accel = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body from the saved state; the caller's random state is untouched after."""
        devices = [self._device] if self._accel is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self._cpu)
            if self._accel is not None:
                torch.cuda.set_rng_state(self._accel, self._device)
            yield
