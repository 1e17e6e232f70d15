"""Zero-bubble ZB-H1: 1F1B with the backward split into input (B) and weight (W) gradients."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from gpipe.schedules.ir import Kind, Schedule, check_sizes, with_communication
from gpipe.schedules.one_f_one_b import one_f_one_b_order


def deferred_weights(order: Sequence[tuple[Kind, int]], stage: int) -> list[tuple[Kind, int]]:
    """``order`` (forwards and backwards of one stage) with each backward's W placed as ZB-H1
    places it: stage s runs the W of its n-th backward only after its (n + s)-th B, and the W
    left at the end fill the drain."""
    placed: list[tuple[Kind, int]] = []
    backwards = [i for kind, i in order if kind is Kind.BACKWARD]
    done = weights = 0  # B and W actions emitted so far
    for kind, i in order:
        placed.append((kind, i))
        if kind is Kind.BACKWARD:
            done += 1
            if done - 1 - weights >= stage:
                placed.append((Kind.WEIGHT, backwards[weights]))
                weights += 1
    placed += [(Kind.WEIGHT, i) for i in backwards[weights:]]
    return placed


@functools.lru_cache(maxsize=256)
def zero_bubble_h1(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """ZB-H1: 1F1B with each backward split into B (input gradients, on the critical path)
    and W (weight gradients, which nobody waits for).

    Stage s runs the W of micro-batch i only after the B of micro-batch i + s, so the
    backward wave travels at the speed of B alone and the deferred W fill the drain.
    Every stage then holds at most K micro-batches, the peak of 1F1B's first stage.
    """
    check_sizes(n_stages, n_microbatches, n_ranks)
    programs = tuple(
        tuple(
            with_communication(
                s, n_stages, deferred_weights(one_f_one_b_order(s, n_stages, n_microbatches), s)
            )
        )
        for s in range(n_stages)
    )
    return Schedule(
        "zero-bubble",
        n_stages,
        n_microbatches,
        programs,
        tuple(range(n_stages)),
        split_backward=True,
    )
