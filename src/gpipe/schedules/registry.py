"""The registry of schedules by name, each with the traits its users read instead of its name.

The facades, the simulator, the planner, the page and the CLI ask a schedule's ``Traits``
(how its stages sit on ranks, whether its backward is split) rather than testing names, so a
new schedule is one generator module plus one ``register`` call here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from gpipe.schedules.fill_drain import gpipe
from gpipe.schedules.interleaved import interleaved
from gpipe.schedules.ir import Schedule
from gpipe.schedules.one_f_one_b import one_f_one_b
from gpipe.schedules.zero_bubble import zero_bubble_h1


class Generator(Protocol):
    """Builds a schedule of ``n_stages`` stages on ``n_ranks`` ranks (default: one each)."""

    def __call__(
        self, n_stages: int, n_microbatches: int, n_ranks: int | None = None, /
    ) -> Schedule: ...


class Placement(enum.Enum):
    """How a schedule's stages sit on ranks."""

    ONE_PER_RANK = "one stage per rank"
    LOOPED = "rank r holds stages r, r + K, r + 2K, ..."


@dataclass(frozen=True)
class Traits:
    """What users of a schedule need to know about it, declared once."""

    placement: Placement
    split_backward: bool = False  # B (input gradients) and W (weight gradients) apart
    microbatches_per_round: bool = False  # micro-batches go in rounds of K: M % K == 0

    @property
    def several_stages_per_rank(self) -> bool:
        return self.placement is not Placement.ONE_PER_RANK

    def stages_per_rank(self, virtual_stages: int) -> int:
        """How many stages each rank holds when the user asks for ``virtual_stages``."""
        return virtual_stages if self.several_stages_per_rank else 1


SCHEDULES: dict[str, Generator] = {}  # name -> generator, in registration order
_TRAITS: dict[str, Traits] = {}


def register(name: str, generator: Generator, traits: Traits) -> None:
    """Make ``generator`` available as ``schedule=name`` everywhere."""
    SCHEDULES[name] = generator
    _TRAITS[name] = traits


def get_schedule(name: str) -> Generator:
    """The generator registered under ``name``; a clear error lists the known names."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}") from None


def traits(name: str) -> Traits:
    """The declared traits of the schedule registered under ``name`` (one stage per rank for
    a generator put in ``SCHEDULES`` without them)."""
    get_schedule(name)
    return _TRAITS.get(name, Traits(Placement.ONE_PER_RANK))


def build(name: str, n_ranks: int, n_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Schedule ``name`` on ``n_ranks`` ranks, each holding as many stages as its placement
    gives for ``virtual_stages`` (one, unless it places several per rank)."""
    n_stages = n_ranks * traits(name).stages_per_rank(virtual_stages)
    generator = get_schedule(name)
    if n_stages == n_ranks:
        return generator(n_stages, n_microbatches)
    return generator(n_stages, n_microbatches, n_ranks)


register("gpipe", gpipe, Traits(Placement.ONE_PER_RANK))
register("1f1b", one_f_one_b, Traits(Placement.ONE_PER_RANK))
register("zero-bubble", zero_bubble_h1, Traits(Placement.ONE_PER_RANK, split_backward=True))
register("interleaved", interleaved, Traits(Placement.LOOPED, microbatches_per_round=True))
