"""GPipe's fill-drain schedule (all forwards, then all backwards) and forward-only passes."""

from __future__ import annotations

import functools

from gpipe.schedules.ir import Kind, Schedule, check_sizes, with_communication


def clock_cycles(n_microbatches: int, n_stages: int) -> list[list[tuple[int, int]]]:
    """GPipe's forward clock cycles: at cycle k, stage j works on micro-batch k - j.

    Returns one list per cycle of ``(microbatch, stage)`` pairs that run at the same time.
    """
    if n_microbatches < 1 or n_stages < 1:
        raise ValueError(
            f"clock_cycles needs n_microbatches >= 1 and n_stages >= 1, "
            f"got {n_microbatches} and {n_stages}"
        )
    return [
        [(k - j, j) for j in range(max(0, k - n_microbatches + 1), min(k + 1, n_stages))]
        for k in range(n_microbatches + n_stages - 1)
    ]


@functools.lru_cache(maxsize=256)
def gpipe(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """GPipe fill-drain: every stage runs all forwards, then all backwards in reverse order."""
    check_sizes(n_stages, n_microbatches, n_ranks)
    forwards = [(Kind.FORWARD, i) for i in range(n_microbatches)]
    backwards = [(Kind.BACKWARD, i) for i in reversed(range(n_microbatches))]
    programs = tuple(
        tuple(with_communication(s, n_stages, forwards + backwards)) for s in range(n_stages)
    )
    return Schedule("gpipe", n_stages, n_microbatches, programs, tuple(range(n_stages)))


@functools.lru_cache(maxsize=256)
def forward_only(
    n_stages: int,
    n_microbatches: int,
    n_ranks: int | None = None,
    stage_to_rank: tuple[int, ...] | None = None,
) -> Schedule:
    """Inference: forwards only, in micro-batch order, nothing kept for a backward pass.

    With ``n_ranks`` < ``n_stages``, rank r holds stages r, r + K, ... as in ``interleaved``
    (or where ``stage_to_rank`` puts them) and runs them one after the other."""
    check_sizes(n_stages, n_microbatches)
    k = n_stages if n_ranks is None else n_ranks
    if not isinstance(k, int) or k < 1 or n_stages % k:
        raise ValueError(f"n_stages ({n_stages}) must be a multiple of n_ranks, got {k!r}")
    if stage_to_rank is None:
        stage_to_rank = tuple(s % k for s in range(n_stages))
    forwards = [(Kind.FORWARD, i) for i in range(n_microbatches)]
    programs = tuple(
        tuple(
            action
            for stage in range(n_stages)
            if stage_to_rank[stage] == rank
            for action in with_communication(stage, n_stages, forwards)
        )
        for rank in range(k)
    )
    return Schedule(
        "forward-only", n_stages, n_microbatches, programs, stage_to_rank, backward=False
    )
