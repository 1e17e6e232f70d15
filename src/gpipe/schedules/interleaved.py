"""Interleaved 1F1B: several stages per rank, placed in a loop (r, r + K, r + 2K, ...)."""

from __future__ import annotations

import functools

from gpipe.schedules.ir import Action, Kind, Schedule, check_sizes, with_communication


def interleaved(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """Interleaved 1F1B: each of ``n_ranks`` ranks holds ``v = n_stages / n_ranks`` stages
    that are not neighbours (rank r holds stages r, r + K, r + 2K, ...), and the bubble
    shrinks by v. Micro-batches go in groups of K, so M must be a multiple of K."""
    k = n_stages if n_ranks is None else n_ranks
    return _interleaved(n_stages, n_microbatches, k)


@functools.lru_cache(maxsize=256)
def _interleaved(n_stages: int, n_microbatches: int, k: int) -> Schedule:
    check_sizes(n_stages, n_microbatches)
    if not isinstance(k, int) or k < 1 or n_stages % k:
        raise ValueError(
            f"interleaved needs a number of stages that is a multiple of the number of "
            f"ranks, got {n_stages} stages for {k} ranks"
        )
    if n_microbatches % k:
        raise ValueError(
            f"interleaved needs a number of micro-batches that is a multiple of the number "
            f"of ranks ({k}), got {n_microbatches}"
        )
    v, m = n_stages // k, n_microbatches
    total = m * v  # forward (and backward) actions per rank

    def forward_of(rank: int, j: int) -> tuple[int, int]:
        """The j-th forward of ``rank``: (stage, micro-batch), K micro-batches per chunk."""
        chunk = (j // k) % v
        return chunk * k + rank, (j // (k * v)) * k + j % k

    def backward_of(rank: int, j: int) -> tuple[int, int]:
        chunk = v - 1 - (j // k) % v
        return chunk * k + rank, (j // (k * v)) * k + j % k

    programs = []
    for rank in range(k):
        warmup = min((k - rank - 1) * 2 + (v - 1) * k, total)
        order: list[tuple[Kind, int, int]] = []
        order += [(Kind.FORWARD, *forward_of(rank, j)) for j in range(warmup)]
        for i in range(total - warmup):
            order.append((Kind.FORWARD, *forward_of(rank, warmup + i)))
            order.append((Kind.BACKWARD, *backward_of(rank, i)))
        order += [(Kind.BACKWARD, *backward_of(rank, j)) for j in range(total - warmup, total)]
        program: list[Action] = []
        for kind, stage, mb in order:
            program += with_communication(stage, n_stages, [(kind, mb)])
        programs.append(tuple(program))
    return Schedule(
        "interleaved",
        n_stages,
        n_microbatches,
        tuple(programs),
        tuple(s % k for s in range(n_stages)),
    )
