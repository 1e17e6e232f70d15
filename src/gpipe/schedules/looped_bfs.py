"""Looped breadth-first: every micro-batch through one of a rank's stages before the next."""

from __future__ import annotations

import functools

from gpipe.schedules.ir import Kind, Schedule, check_sizes, programs_of, rank_count


@functools.lru_cache(maxsize=256)
def looped_bfs(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """Looped BFS: rank r holds stages r, r + K, r + 2K, ... and runs all M forwards of one
    before those of the next, then all backwards from its last stage back to its first.

    The bubble is interleaved's, (K-1)/(vM+K-1), but every micro-batch of every stage is held
    until its backward, so activations grow with M: what it buys is that each stage's
    weights are needed once per step, in one stretch, which suits sharded replicas that
    gather a stage's weights before its forwards and free them after its backwards.
    """
    check_sizes(n_stages, n_microbatches)
    k = rank_count(n_stages, n_ranks, "looped-bfs")
    forwards = range(n_microbatches)
    orders = []
    for rank in range(k):
        mine = range(rank, n_stages, k)
        order = [(Kind.FORWARD, s, i) for s in mine for i in forwards]
        order += [(Kind.BACKWARD, s, i) for s in reversed(mine) for i in forwards]
        orders.append(order)
    stage_to_rank = tuple(s % k for s in range(n_stages))
    return Schedule(
        "looped-bfs", n_stages, n_microbatches, programs_of(orders, n_stages), stage_to_rank
    )
