"""Where stashed tensors wait for their pop: a tracker per thread, swapped in by the pipeline."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from torch import Tensor

from gpipe.skip.namespace import SkipKey

__all__ = ["SkipTracker", "StageTracker", "current_tracker", "observe", "use_tracker"]


class SkipTracker(Protocol):
    def save(self, key: SkipKey, tensor: Tensor | None) -> None:
        """Keep what ``stash`` gave under ``key``."""

    def load(self, key: SkipKey) -> Tensor | None:
        """Hand over what was stashed under ``key``; raises RuntimeError if nothing was."""


def _name(key: SkipKey) -> str:
    namespace, name = key
    return repr(name) if namespace.id.int == 0 else f"{name!r} in {namespace!r}"


# Callbacks that see every tensor stashed or popped, on any thread (``observe``).
_observers: list[Callable[[Tensor], None]] = []


def _notify(tensor: Tensor | None) -> None:
    if tensor is not None:
        for callback in _observers:
            callback(tensor)


@contextlib.contextmanager
def observe(callback: Callable[[Tensor], None]) -> Iterator[None]:
    """Call ``callback`` with every tensor stashed or popped, on any thread, inside the body
    (memory meters use it: a skip tensor is held, though no layer takes or returns it)."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


class _Standalone:
    """Outside a pipeline (a plain ``nn.Sequential``): a pop takes what the stash left."""

    def __init__(self) -> None:
        self._tensors: dict[SkipKey, Tensor | None] = {}

    def save(self, key: SkipKey, tensor: Tensor | None) -> None:
        _notify(tensor)
        self._tensors[key] = tensor

    def load(self, key: SkipKey) -> Tensor | None:
        try:
            tensor = self._tensors.pop(key)
        except KeyError:
            raise RuntimeError(f"skip {_name(key)} was popped before it was stashed") from None
        _notify(tensor)
        return tensor


class StageTracker:
    """One micro-batch's forward through one stage: pops are served by stashes of the same
    stage or by what other stages sent (``imported``); stashes of names popped on another
    stage stay in ``stashed`` for the stage to send on."""

    def __init__(self, imported: Mapping[SkipKey, Tensor | None]) -> None:
        self._imported = imported
        self.stashed: dict[SkipKey, Tensor | None] = {}

    def save(self, key: SkipKey, tensor: Tensor | None) -> None:
        _notify(tensor)
        self.stashed[key] = tensor

    def load(self, key: SkipKey) -> Tensor | None:
        if key in self.stashed:
            tensor = self.stashed.pop(key)
        else:
            try:
                tensor = self._imported[key]
            except KeyError:
                raise RuntimeError(
                    f"skip {_name(key)} was popped but no earlier layer of the pipeline stashed it"
                ) from None
        _notify(tensor)
        return tensor


class _Current(threading.local):
    def __init__(self) -> None:
        self.tracker: SkipTracker = _Standalone()


_current = _Current()


def current_tracker() -> SkipTracker:
    """The tracker of this thread: the pipeline's inside a stage, a standalone one elsewhere."""
    return _current.tracker


@contextlib.contextmanager
def use_tracker(tracker: SkipTracker) -> Iterator[SkipTracker]:
    """Route this thread's stashes and pops through ``tracker`` inside the body."""
    before = _current.tracker
    _current.tracker = tracker
    try:
        yield tracker
    finally:
        _current.tracker = before
