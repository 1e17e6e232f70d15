"""Which stage sends which skip to which: the routes of a model's skips under a balance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpipe.skip.namespace import SkipKey
from gpipe.skip.skippable import Skip

__all__ = ["SkipLayout", "StagePorts"]


@dataclass(frozen=True)
class StagePorts:
    """The skips one stage receives and sends: ``imports[src]`` are the keys that arrive from
    stage ``src``, ``exports[dst]`` those it sends to stage ``dst``, each in one fixed order
    that every process agrees on (the order in which the model stashes them)."""

    imports: dict[int, tuple[SkipKey, ...]] = field(default_factory=dict)
    exports: dict[int, tuple[SkipKey, ...]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.imports or self.exports)


@dataclass(frozen=True)
class SkipLayout:
    """A model's skips placed on stages by ``balance`` (layers per stage)."""

    skips: Sequence[Skip]
    balance: Sequence[int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "skips", tuple(self.skips))
        object.__setattr__(self, "balance", tuple(self.balance))

    def stage_of(self, layer: int) -> int:
        start = 0
        for stage, size in enumerate(self.balance):
            if layer < start + size:
                return stage
            start += size
        raise IndexError(f"layer {layer} is beyond the {start} layers of balance {self.balance}")

    def crossing(self) -> list[tuple[Skip, int, int]]:
        """Skips whose stash and pop lie on different stages: (skip, source, destination)."""
        placed = [(s, self.stage_of(s.stash_layer), self.stage_of(s.pop_layer)) for s in self.skips]
        return [(s, src, dst) for s, src, dst in placed if src != dst]

    @property
    def routes(self) -> tuple[tuple[int, int], ...]:
        """(source, destination) stage pairs that exchange skips, sorted."""
        return tuple(sorted({(src, dst) for _, src, dst in self.crossing()}))

    def ports(self, stage: int) -> StagePorts:
        imports: dict[int, list[SkipKey]] = {}
        exports: dict[int, list[SkipKey]] = {}
        for skip, src, dst in self.crossing():
            if dst == stage:
                imports.setdefault(src, []).append(skip.key)
            if src == stage:
                exports.setdefault(dst, []).append(skip.key)
        return StagePorts(
            {s: tuple(keys) for s, keys in sorted(imports.items())},
            {s: tuple(keys) for s, keys in sorted(exports.items())},
        )
