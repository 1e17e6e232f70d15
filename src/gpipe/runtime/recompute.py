"""Re-materialization: which micro-batches to recompute, replaying their random state, and
telling layers which pass they are in."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "CHECKPOINT_MODES",
    "AutocastState",
    "Layers",
    "RNGState",
    "check_autocast",
    "check_checkpoint",
    "checkpointing",
    "is_checkpointing",
    "is_recomputing",
    "recomputed_layers",
    "recomputing",
    "should_checkpoint",
]

CHECKPOINT_MODES = ("always", "except_last", "never")


@dataclass(frozen=True)
class Layers:
    """Re-materialization layer by layer: in every micro-batch, each stage recomputes in its
    backward only the layers picked — every ``every``-th layer of the model (layers 0,
    every, 2 x every, ...), or those ``select(name, layer)`` returns True for — and keeps
    the activations of the others, so memory and time can be traded finely. The random
    state and the autocast settings of the first pass are replayed
    (``torch.utils.checkpoint``)."""

    every: int | None = None
    select: Callable[[str, nn.Module], bool] | None = None

    def __post_init__(self) -> None:
        if (self.every is None) == (self.select is None):
            raise ValueError("Layers takes every=k or select=predicate, exactly one of them")
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise ValueError(f"Layers(every=...) must be a positive integer, got {self.every!r}")
        if self.select is not None and not callable(self.select):
            raise TypeError(f"Layers(select=...) must be callable, got {self.select!r}")

    def picks(self, index: int, name: str, layer: nn.Module) -> bool:
        """Whether layer ``index`` of the model (named ``name``) is recomputed."""
        if self.every is not None:
            return index % self.every == 0
        assert self.select is not None  # __post_init__ took exactly one of them
        return bool(self.select(name, layer))

    def __str__(self) -> str:
        return f"Layers(every={self.every})" if self.every else "Layers(select=...)"


def recomputed_layers(
    mode: str | Layers, layers: nn.Sequential, balance: Sequence[int]
) -> list[frozenset[int]]:
    """Per stage, the positions (within the stage) of the layers a ``Layers`` policy
    recomputes; none for a whole-stage mode. A policy that picks no layer, or a layer with
    skip connections (its stashes and pops cannot be replayed inside a backward), is refused."""
    if not isinstance(mode, Layers):
        return [frozenset()] * len(balance)
    from gpipe.skip.skippable import Skippable

    picked: list[frozenset[int]] = []
    start = 0
    named = list(layers.named_children())
    for size in balance:
        positions = set()
        for index in range(start, start + size):
            name, layer = named[index]
            if mode.picks(index, name, layer):
                if any(isinstance(m, Skippable) for m in layer.modules()):
                    raise ValueError(
                        f"checkpoint={mode} picks layer {name!r}, which stashes or pops skip "
                        "tensors: it cannot be recomputed on its own; leave it out"
                    )
                positions.add(index - start)
        picked.append(frozenset(positions))
        start += size
    if not any(picked):
        raise ValueError(
            f"checkpoint={mode} picks no layer of the model: it would recompute nothing"
        )
    return picked


def check_checkpoint(mode: object) -> str | Layers:
    """The mode as a string: anything whose ``str()`` names one (torchgpipe accepts that
    too), or a ``Layers`` policy."""
    if isinstance(mode, Layers):
        return mode
    name = mode if isinstance(mode, str) else str(mode)
    if name not in CHECKPOINT_MODES:
        raise ValueError(
            f"checkpoint is not one of 'always', 'except_last', or 'never', got {mode!r}"
        )
    return name


def should_checkpoint(mode: str | Layers, microbatch: int, n_microbatches: int) -> bool:
    """Whether micro-batch ``microbatch`` keeps only its stage input and recomputes the rest.

    ``except_last`` spares the last micro-batch: under fill-drain its backward follows its
    forward at once, so recomputing it would buy no memory. A ``Layers`` policy recomputes
    layers, not whole micro-batches: False.
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
