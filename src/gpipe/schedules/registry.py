"""The registry of schedules by name, each with the traits its users read instead of its name.

The facades, the simulator, the planner, the page and the CLI ask a schedule's ``Traits``
(how its stages sit on ranks, whether its backward is split) rather than testing names, so a
new schedule is one generator module plus one ``register`` call here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gpipe.schedules.fill_drain import gpipe
from gpipe.schedules.interleaved import interleaved, interleaved_zero_bubble
from gpipe.schedules.ir import Schedule
from gpipe.schedules.looped_bfs import looped_bfs
from gpipe.schedules.one_f_one_b import one_f_one_b
from gpipe.schedules.v_memory import v_half, v_min, v_min_fewest
from gpipe.schedules.v_shape import dualpipe_v, zero_bubble_v
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
    V = "rank r holds stages r and 2K - 1 - r"

    def rank_of(self, stage: int, n_stages: int, n_ranks: int) -> int:
        """The rank that holds ``stage`` of ``n_stages`` on ``n_ranks`` ranks."""
        if self is Placement.V:
            return stage if stage < n_ranks else n_stages - 1 - stage
        return stage % n_ranks

    def stages_of(self, rank: int, n_stages: int, n_ranks: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, in order."""
        if self is Placement.V:
            return (rank, n_stages - 1 - rank)
        return tuple(range(rank, n_stages, n_ranks))

    def check(self, n_stages: int, n_ranks: int, name: str) -> None:
        """Refuse a V of ``n_stages`` stages that is not two per rank (the callers check
        first that the stages sit evenly, and one per rank where the placement says so)."""
        if self is Placement.V and n_stages != 2 * n_ranks:
            raise ValueError(
                f"schedule {name!r} places two stages per process in a V: the balance must "
                f"have 2K = {2 * n_ranks} entries for {n_ranks} processes, got {n_stages}"
            )


@dataclass(frozen=True)
class Traits:
    """What users of a schedule need to know about it, declared once."""

    placement: Placement
    split_backward: bool = False  # B (input gradients) and W (weight gradients) apart
    microbatches_per_round: bool = False  # micro-batches go in rounds of K: M % K == 0
    microbatch_per_stage: bool = False  # at least one micro-batch per stage: M >= K x v
    fewest: Callable[[int], int] | None = None  # the fewest micro-batches for K ranks
    # a rank runs the forward of one of its stages beside the backward of another (DualPipeV's
    # pairs), which overlap on a GPU when each stage has a stream of its own
    pairs_stages: bool = False

    @property
    def several_stages_per_rank(self) -> bool:
        return self.placement is not Placement.ONE_PER_RANK

    def stages_per_rank(self, virtual_stages: int) -> int:
        """How many stages each rank holds when the user asks for ``virtual_stages`` (a V
        holds two, whatever is asked)."""
        if self.placement is Placement.V:
            return 2
        return virtual_stages if self.several_stages_per_rank else 1

    def fewest_microbatches(self, n_ranks: int, virtual_stages: int = 1) -> int:
        """The fewest micro-batches the schedule runs on ``n_ranks`` ranks."""
        if self.fewest is not None:
            return self.fewest(n_ranks)
        if self.microbatch_per_stage:
            return n_ranks * self.stages_per_rank(virtual_stages)
        return n_ranks if self.microbatches_per_round else 1

    def runs(self, n_ranks: int, n_microbatches: int, virtual_stages: int = 1) -> bool:
        """Whether the schedule runs ``n_microbatches`` micro-batches on ``n_ranks`` ranks."""
        if self.microbatches_per_round and n_microbatches % n_ranks:
            return False
        return n_microbatches >= self.fewest_microbatches(n_ranks, virtual_stages)


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
register(
    "interleaved-zero-bubble",
    interleaved_zero_bubble,
    Traits(Placement.LOOPED, split_backward=True, microbatches_per_round=True),
)
register("looped-bfs", looped_bfs, Traits(Placement.LOOPED))
register("zero-bubble-v", zero_bubble_v, Traits(Placement.V, split_backward=True))
register(
    "dualpipe-v",
    dualpipe_v,
    Traits(Placement.V, split_backward=True, microbatch_per_stage=True, pairs_stages=True),
)
register("v-half", v_half, Traits(Placement.V, split_backward=True))
register("v-min", v_min, Traits(Placement.V, split_backward=True, fewest=v_min_fewest))
