"""Re-materialization: which micro-batches to recompute, and replaying their random state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["CHECKPOINT_MODES", "RNGState", "check_checkpoint", "should_checkpoint"]

CHECKPOINT_MODES = ("always", "except_last", "never")


def check_checkpoint(mode: object) -> str:
    if mode not in CHECKPOINT_MODES:
        raise ValueError(
            f"checkpoint must be one of 'always', 'except_last' or 'never', got {mode!r}"
        )
    return mode  # type: ignore[return-value]


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
