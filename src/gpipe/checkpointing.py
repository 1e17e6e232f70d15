"""Re-materialization: which micro-batches to recompute, replaying their random state, and
telling layers which pass they are in."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "CHECKPOINT_MODES",
    "AutocastState",
    "RNGState",
    "check_autocast",
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


_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings a forward ran under (per device type: enabled, dtype), so that
    its recomputation, or a worker thread, runs under the same ones: autocast is per thread,
    and autograd's backward does not carry it."""

    settings: tuple[tuple[str, bool, torch.dtype], ...]

    @classmethod
    def capture(cls) -> AutocastState:
        return cls(
            tuple(
                (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                for device in _AUTOCAST_DEVICES
            )
        )

    @property
    def enabled(self) -> bool:
        return any(on for _, on, _ in self.settings)

    @contextlib.contextmanager
    def restore(self) -> Iterator[None]:
        """Run the body under these settings (those that are enabled; the others off)."""
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in self.settings:
                if enabled or torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            yield


def check_autocast(dtype: object, device: torch.device) -> torch.dtype | None:
    """``dtype`` if autocast on ``device`` supports it (None: no autocast); else a ValueError
    that says so, rather than autocast's warning and silent fallback to full precision."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"autocast must be a torch.dtype or None, got {dtype!r}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast(device.type, dtype=dtype):
            enabled = torch.is_autocast_enabled(device.type)
    if not enabled or any("not supported" in str(w.message) for w in caught):
        raise ValueError(
            f"autocast={dtype} is not supported on {device.type}: autocast on {device.type} "
            "takes torch.bfloat16 or torch.float16"
        )
    return dtype
