"""Zero-bubble ZB-H1: 1F1B with the backward split into input (B) and weight (W) gradients."""

from __future__ import annotations

import functools

from gpipe.schedules.ir import Kind, Schedule, check_sizes, with_communication
from gpipe.schedules.one_f_one_b import one_f_one_b_order


@functools.lru_cache(maxsize=256)
def zero_bubble_h1(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """ZB-H1: 1F1B with each backward split into B (input gradients, on the critical path)
    and W (weight gradients, which nobody waits for).

    Stage s runs the W of micro-batch i only after the B of micro-batch i + s, so the
    backward wave travels at the speed of B alone and the deferred W fill the drain.
    Every stage then holds at most K micro-batches, the peak of 1F1B's first stage.
    """
    check_sizes(n_stages, n_microbatches, n_ranks)
    programs = []
    for s in range(n_stages):
        order: list[tuple[Kind, int]] = []
        weights = 0  # W actions emitted so far, in micro-batch order
        for kind, i in one_f_one_b_order(s, n_stages, n_microbatches):
            order.append((kind, i))
            if kind is Kind.BACKWARD and i - weights >= s:
                order.append((Kind.WEIGHT, weights))
                weights += 1
        order += [(Kind.WEIGHT, i) for i in range(weights, n_microbatches)]
        programs.append(tuple(with_communication(s, n_stages, order)))
    return Schedule(
        "zero-bubble",
        n_stages,
        n_microbatches,
        tuple(programs),
        tuple(range(n_stages)),
        split_backward=True,
    )
