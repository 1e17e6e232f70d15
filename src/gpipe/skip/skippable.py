"""Skip connections between any two layers: ``@skippable``, ``stash``, ``pop`` and the check
that every stashed name is popped exactly once.

A skippable layer's ``forward`` is a generator: ``yield stash("name", tensor)`` hands a tensor
to a later layer, ``x = yield pop("name")`` takes it, and ``return`` gives the layer's
output. In a plain ``nn.Sequential`` the tensor waits on this thread until it is popped; in a
pipeline it goes straight from the stage that stashes it to the stage that pops it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

from torch import Tensor, nn

from gpipe.skip.namespace import DEFAULT_NAMESPACE, Namespace, SkipKey
from gpipe.skip.tracker import current_tracker

__all__ = ["Skippable", "pop", "skippable", "stash", "verify_skippables"]


@dataclass(frozen=True)
class _Stash:
    name: str
    tensor: Tensor | None


@dataclass(frozen=True)
class _Pop:
    name: str


def stash(name: str, tensor: Tensor | None) -> _Stash:
    """``yield stash(name, tensor)`` inside a skippable forward: keep ``tensor`` for the layer
    that pops ``name``."""
    if tensor is not None and not isinstance(tensor, Tensor):
        raise TypeError(f"stash({name!r}, ...) takes a Tensor or None, got {type(tensor).__name__}")
    return _Stash(name, tensor)


def pop(name: str) -> _Pop:
    """``x = yield pop(name)`` inside a skippable forward: take what was stashed as ``name``."""
    return _Pop(name)


class Skippable(nn.Module):
    """Base of the classes ``@skippable`` makes; ``isinstance(layer, Skippable)`` finds them."""

    stashable_names: frozenset[str] = frozenset()
    poppable_names: frozenset[str] = frozenset()

    def isolate(self, namespace: Namespace, *, only: Iterable[str] | None = None) -> Skippable:
        """Put this layer's skip names (or ``only`` these) in ``namespace``; returns self."""
        declared = self.stashable_names | self.poppable_names
        names = declared if only is None else set(only)
        unknown = sorted(set(names) - declared)
        if unknown:
            raise ValueError(
                f"cannot isolate {unknown}: {type(self).__name__} declares {sorted(declared)}"
            )
        spaces = dict(self.__dict__.get("_skip_namespaces", {}))
        spaces.update((name, namespace) for name in names)
        self.__dict__["_skip_namespaces"] = spaces
        return self

    def namespaced(self, name: str) -> SkipKey:
        """The key under which ``name`` travels: its namespace and the name."""
        return self.__dict__.get("_skip_namespaces", {}).get(name, DEFAULT_NAMESPACE), name

    def stashed_keys(self) -> list[SkipKey]:
        return [self.namespaced(n) for n in sorted(self.stashable_names)]

    def popped_keys(self) -> list[SkipKey]:
        return [self.namespaced(n) for n in sorted(self.poppable_names)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        result = super().forward(*args, **kwargs)
        done: set[str] = set()
        if inspect.isgenerator(result):
            result = self._drive(result, done)
        owner = type(self).__name__
        unstashed = sorted(self.stashable_names - done)
        if unstashed:
            raise RuntimeError(
                f"{owner} declared {unstashed[0]!r} as stashable but did not stash it"
            )
        unpopped = sorted(self.poppable_names - done)
        if unpopped:
            raise RuntimeError(f"{owner} declared {unpopped[0]!r} as poppable but did not pop it")
        return result

    def _drive(self, generator: Any, done: set[str]) -> Any:
        """Run a generator forward to its return value, serving its stashes and pops."""
        tracker = current_tracker()
        owner = type(self).__name__
        reply = None
        try:
            while True:
                request = generator.send(reply)
                reply = None
                if isinstance(request, _Stash):
                    if request.name not in self.stashable_names:
                        raise RuntimeError(
                            f"{owner} stashed {request.name!r} without declaring it: "
                            f"@skippable(stash=[{request.name!r}])"
                        )
                    tracker.save(self.namespaced(request.name), request.tensor)
                elif isinstance(request, _Pop):
                    if request.name not in self.poppable_names:
                        raise RuntimeError(
                            f"{owner} popped {request.name!r} without declaring it: "
                            f"@skippable(pop=[{request.name!r}])"
                        )
                    reply = tracker.load(self.namespaced(request.name))
                else:
                    raise TypeError(
                        f"{owner}.forward yielded {type(request).__name__}; a skippable "
                        "forward yields only stash(name, tensor) or pop(name)"
                    )
                done.add(request.name)
        except StopIteration as stop:
            return stop.value
        finally:
            generator.close()

    def __repr__(self) -> str:
        return f"@skippable({super().__repr__()})"


def skippable(
    stash: Iterable[str] = (), pop: Iterable[str] = ()
) -> Callable[[type[nn.Module]], type[Skippable]]:
    """Class decorator: the module stashes the names in ``stash`` and pops those in ``pop``.

    The decorated class is a subclass of the original with the same name, so its state dict
    keys, hooks and ``isinstance`` checks are those of the undecorated module.
    """
    stashable, poppable = frozenset(_names(stash, "stash")), frozenset(_names(pop, "pop"))

    def decorate(cls: type[nn.Module]) -> type[Skippable]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates an nn.Module class, got {cls!r}")
        namespace = {
            "stashable_names": stashable,
            "poppable_names": poppable,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        return cast(type[Skippable], type(cls.__name__, (Skippable, cls), namespace))

    return decorate


def _names(names: Iterable[str], what: str) -> list[str]:
    if isinstance(names, str):
        raise TypeError(f"{what} takes a list of names, got the string {names!r}")
    items = list(names)
    bad = [n for n in items if not isinstance(n, str)]
    if bad:
        raise TypeError(f"{what} names must be strings, got {bad!r}")
    return items


# --------------------------------------------------------------------------------------------
# Checking a model's skips


@dataclass(frozen=True)
class Skip:
    """One skip connection: stashed inside top-level layer ``stash_layer``, popped inside
    ``pop_layer``."""

    key: SkipKey
    stash_layer: int
    pop_layer: int

    @property
    def name(self) -> str:
        return self.key[1]


def _skippables(module: nn.Sequential) -> list[tuple[int, str, Skippable]]:
    """Every skippable layer, nested ones included: (top-level index, dotted name, layer)."""
    found = []
    for index, (name, child) in enumerate(module.named_children()):
        for sub_name, sub in child.named_modules(prefix=name):
            if isinstance(sub, Skippable):
                found.append((index, sub_name, sub))
    return found


def find_skips(module: nn.Sequential) -> list[Skip]:
    """The model's skips in the order they are stashed; a TypeError lists every problem
    (stashed but never popped, popped but never stashed, a name stashed or popped twice)."""
    problems: list[str] = []
    stashed: dict[SkipKey, tuple[int, str]] = {}
    popped: dict[SkipKey, int] = {}
    order: list[SkipKey] = []
    for index, name, layer in _skippables(module):
        for key in layer.stashed_keys():
            if key in layer.popped_keys():
                problems.append(f"'{name}' declared {key[1]!r} both as stashable and as poppable")
                continue
            if key in stashed:
                problems.append(f"'{name}' redeclared {key[1]!r} as stashable {_hint(key)}")
                continue
            stashed[key] = (index, name)
            order.append(key)
        for key in layer.popped_keys():
            if key in layer.stashed_keys():
                continue
            if key in popped:
                problems.append(f"'{name}' redeclared {key[1]!r} as poppable {_hint(key)}")
            elif key not in stashed:
                problems.append(f"'{name}' declared {key[1]!r} as poppable but it was not stashed")
            else:
                popped[key] = index
    for key in order:
        if key not in popped:
            problems.append(f"no module declared {key[1]!r} as poppable but stashed")
    if problems:
        raise TypeError("invalid skip connections:\n" + "\n".join(f"  {p}" for p in problems))
    return [Skip(key, stashed[key][0], popped[key]) for key in order]


def _hint(key: SkipKey) -> str:
    return "(isolate repeated blocks with a Namespace)" if key[0] == DEFAULT_NAMESPACE else ""


def verify_skippables(module: nn.Sequential) -> None:
    """Check that every name stashed in ``module`` is popped exactly once by a later layer;
    raises TypeError listing every problem."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"verify_skippables takes an nn.Sequential, got {type(module).__name__}")
    find_skips(module)
