"""Interleaved 1F1B and interleaved zero bubble: several stages per rank, placed in a loop
(rank r holds stages r, r + K, r + 2K, ...)."""

from __future__ import annotations

import functools

from gpipe.schedules.ir import Kind, Schedule, check_sizes, programs_of, rank_count


def interleaved(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """Interleaved 1F1B: each of ``n_ranks`` ranks holds ``v = n_stages / n_ranks`` stages
    that are not neighbours (rank r holds stages r, r + K, r + 2K, ...), and the bubble
    shrinks by v. Micro-batches go in groups of K, so M must be a multiple of K."""
    k = n_stages if n_ranks is None else n_ranks
    return _interleaved(n_stages, n_microbatches, k, split=False)


def interleaved_zero_bubble(
    n_stages: int, n_microbatches: int, n_ranks: int | None = None
) -> Schedule:
    """Interleaved zero bubble: interleaved 1F1B with each backward split into B (input
    gradients) and W (weight gradients), rank r putting its W off by r backwards so that
    the backward wave travels at the speed of B and the W fill the drain."""
    k = n_stages if n_ranks is None else n_ranks
    return _interleaved(n_stages, n_microbatches, k, split=True)


@functools.lru_cache(maxsize=256)
def _interleaved(n_stages: int, n_microbatches: int, k: int, split: bool) -> Schedule:
    name = "interleaved-zero-bubble" if split else "interleaved"
    check_sizes(n_stages, n_microbatches)
    rank_count(n_stages, k, name)
    if n_microbatches % k:
        raise ValueError(
            f"{name} needs a number of micro-batches that is a multiple of the number "
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

    orders = []
    for rank in range(k):
        warmup = min((k - rank - 1) * 2 + (v - 1) * k, total)
        order = [(Kind.FORWARD, *forward_of(rank, j)) for j in range(warmup)]
        for i in range(total):
            if warmup + i < total:
                order.append((Kind.FORWARD, *forward_of(rank, warmup + i)))
            order.append((Kind.BACKWARD, *backward_of(rank, i)))
            if split and i >= rank:  # rank r's W lag its B by r
                order.append((Kind.WEIGHT, *backward_of(rank, i - rank)))
        if split:
            first = max(total - rank, 0)
            order += [(Kind.WEIGHT, *backward_of(rank, j)) for j in range(first, total)]
        orders.append(order)
    return Schedule(
        name,
        n_stages,
        n_microbatches,
        programs_of(orders, n_stages),
        tuple(s % k for s in range(n_stages)),
        split_backward=split,
    )
