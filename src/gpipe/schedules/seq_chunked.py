"""Sequence-pipelined schedules (Seq1F1B): each micro-batch cut along its sequence.

A micro-batch of S sub-sequences runs as S units, numbered ``i * S + j`` for sub-sequence j of
micro-batch i. Unit j attends to the keys and values of units 0..j-1 of its micro-batch, which
its stage kept, so on every stage the forwards of one micro-batch run in order j = 0..S-1 and
its backwards in the reverse order: unit j's backward hands the gradient of those keys and
values to unit j-1's. A stage holds units rather than whole micro-batches between forward and
backward, which is where the memory goes: 1F1B's first stage holds K micro-batches, its
sequence-pipelined form (K - 1 + S) / S of them.

On zero-bubble-v's V (rank r holds stages r and 2K - 1 - r) the units are ordered as V-Half
and V-Min order micro-batches (``gpipe.schedules.v_memory.capped_v``: B first, then a forward
the cap allows, then W), capped at 2K - 2 + 2S chunk-sized units a rank: zero-bubble-v's 2K
at S = 1, as much as 1F1B on sub-sequences holds on its first stage, and room for a whole
micro-batch on both of a rank's stages, which it holds at the turn of the V before its
first backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from gpipe.schedules.ir import Kind, Schedule, check_sizes, with_communication
from gpipe.schedules.v_memory import capped_v
from gpipe.schedules.v_shape import check_v, zero_bubble_v
from gpipe.schedules.zero_bubble import deferred_weights

__all__ = ["SEQ_CHUNKED", "seq_chunked"]

Order = list[tuple[Kind, int]]
# F, B and W in the steps zero-bubble-v's sequence-pipelined order is played with. Played
# with all three alike, its ranks wait wherever B costs more than W: on two processes, M = 8,
# S = 4, at B = 1.5 F and W = 0.5 F the simulator puts it at 28.1 against 24.8 for 1F1B on
# sub-sequences; played 2 : 4 : 1, at 24.4 (and 24.25 at F = B = W, 28.5 at B = 2 F)
PLAYED_DURATIONS = (2, 4, 1)
# (name, n_stages, n_microbatches, seq_chunks, n_ranks) -> the schedule over units
Builder = Callable[[str, int, int, int, int | None], Schedule]


def _backward_units(n_microbatches: int, seq_chunks: int) -> list[int]:
    """The units in the order their backwards run: micro-batches in order, each one's
    sub-sequences last to first."""
    return [i * seq_chunks + j for i in range(n_microbatches) for j in reversed(range(seq_chunks))]


def _fill_drain(stage: int, n_stages: int, n_microbatches: int, seq_chunks: int) -> Order:
    units = n_microbatches * seq_chunks
    return [(Kind.FORWARD, u) for u in range(units)] + [
        (Kind.BACKWARD, u) for u in reversed(range(units))
    ]


def _one_f_one_b(stage: int, n_stages: int, n_microbatches: int, seq_chunks: int) -> Order:
    """1F1B over units: S - 1 more warm-up forwards than 1F1B's, since the last stage needs a
    micro-batch's last sub-sequence before the first backward of it."""
    units = n_microbatches * seq_chunks
    backwards = _backward_units(n_microbatches, seq_chunks)
    warmup = min(n_stages - stage - 1 + seq_chunks - 1, units)
    order = [(Kind.FORWARD, u) for u in range(warmup)]
    for n in range(units - warmup):
        order += [(Kind.FORWARD, warmup + n), (Kind.BACKWARD, backwards[n])]
    order += [(Kind.BACKWARD, u) for u in backwards[units - warmup :]]
    return order


def _zero_bubble(stage: int, n_stages: int, n_microbatches: int, seq_chunks: int) -> Order:
    return deferred_weights(_one_f_one_b(stage, n_stages, n_microbatches, seq_chunks), stage)


def _per_stage(order_of: Callable[[int, int, int, int], Order], split: bool) -> Builder:
    """A schedule of one stage per rank whose stages run ``order_of``'s units."""

    def build(
        name: str, n_stages: int, n_microbatches: int, seq_chunks: int, n_ranks: int | None
    ) -> Schedule:
        check_sizes(n_stages, n_microbatches, n_ranks)
        programs = tuple(
            tuple(
                with_communication(s, n_stages, order_of(s, n_stages, n_microbatches, seq_chunks))
            )
            for s in range(n_stages)
        )
        return Schedule(
            name,
            n_stages,
            n_microbatches * seq_chunks,
            programs,
            tuple(range(n_stages)),
            split_backward=split,
            seq_chunks=seq_chunks,
        )

    return build


def _zero_bubble_v(
    name: str, n_stages: int, n_microbatches: int, seq_chunks: int, n_ranks: int | None
) -> Schedule:
    if seq_chunks == 1:
        return zero_bubble_v(n_stages, n_microbatches, n_ranks)
    k = check_v(name, n_stages, n_ranks)
    cap = 2 * k - 2 + 2 * seq_chunks
    return capped_v(
        name, n_stages, n_microbatches, n_ranks, cap, seq_chunks, durations=PLAYED_DURATIONS
    )


# the schedules that run sequence-pipelined, by the name of the schedule they extend
SEQ_CHUNKED: dict[str, Builder] = {
    "gpipe": _per_stage(_fill_drain, False),
    "1f1b": _per_stage(_one_f_one_b, False),
    "zero-bubble": _per_stage(_zero_bubble, True),
    "zero-bubble-v": _zero_bubble_v,
}


@functools.lru_cache(maxsize=256)
def seq_chunked(
    name: str, n_stages: int, n_microbatches: int, seq_chunks: int, n_ranks: int | None = None
) -> Schedule:
    """Schedule ``name`` (one of ``SEQ_CHUNKED``) over ``n_microbatches`` micro-batches of
    ``seq_chunks`` sub-sequences each; its actions name units ``i * seq_chunks + j``.
    ``n_stages`` counts stages: 2K for zero-bubble-v's V on K ranks."""
    if name not in SEQ_CHUNKED:
        raise ValueError(
            f"seq_chunks runs with the schedules {sorted(SEQ_CHUNKED)}, got schedule {name!r}"
        )
    if isinstance(seq_chunks, bool) or not isinstance(seq_chunks, int) or seq_chunks < 1:
        raise ValueError(f"seq_chunks must be a positive integer, got {seq_chunks!r}")
    check_sizes(n_stages, n_microbatches)
    return SEQ_CHUNKED[name](name, n_stages, n_microbatches, seq_chunks, n_ranks)
