"""1F1B (PipeDream-Flush): one forward, one backward, at most K - s micro-batches live."""

from __future__ import annotations

import functools

from gpipe.schedules.ir import Kind, Schedule, check_sizes, with_communication


def one_f_one_b_order(stage: int, n_stages: int, n_microbatches: int) -> list[tuple[Kind, int]]:
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards:
    stage s never holds more than K - s micro-batches between forward and backward."""
    warmup = min(n_stages - stage - 1, n_microbatches)
    order = [(Kind.FORWARD, i) for i in range(warmup)]
    for i in range(n_microbatches - warmup):
        order += [(Kind.FORWARD, warmup + i), (Kind.BACKWARD, i)]
    order += [(Kind.BACKWARD, i) for i in range(n_microbatches - warmup, n_microbatches)]
    return order


@functools.lru_cache(maxsize=256)
def one_f_one_b(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """1F1B (PipeDream-Flush): GPipe's bubble with at most K - s live micro-batches on stage s
    instead of M."""
    check_sizes(n_stages, n_microbatches, n_ranks)
    programs = tuple(
        tuple(with_communication(s, n_stages, one_f_one_b_order(s, n_stages, n_microbatches)))
        for s in range(n_stages)
    )
    return Schedule("1f1b", n_stages, n_microbatches, programs, tuple(range(n_stages)))
