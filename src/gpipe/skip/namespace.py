"""Namespaces that tell apart the skip names of repeated blocks."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

__all__ = ["DEFAULT_NAMESPACE", "Namespace", "SkipKey"]


@dataclass(frozen=True)
class Namespace:
    """A scope for skip names: two blocks built from one skippable class stash and pop the
    same names, and ``block.isolate(Namespace())`` keeps each block's pairs apart.

    Namespaces compare by identity of origin: a copy equals its original, two new ones differ.
    """

    id: uuid.UUID = field(default_factory=uuid.uuid4)

    def __repr__(self) -> str:
        return f"<Namespace {self.id.hex[:8]}>"


# The namespace of names no one isolated; fixed, so it is the same in every process.
DEFAULT_NAMESPACE = Namespace(uuid.UUID(int=0))

SkipKey = tuple[Namespace, str]
