"""V-Half and V-Min: V schedules whose activation memory is capped (Qi et al., "Pipeline
Parallelism with Controllable Memory", 2024), on zero-bubble-v's V of 2K stages.

A rank of a V holds, for each micro-batch between its forward and its last weight gradient,
one of its two chunks' activations, half a stage of 1F1B's. 1F1B's first rank holds K
micro-batches, 2K such halves; ZB-V holds as many. The lifetime of a micro-batch's chunk 0
spans the whole round trip through the V, so that a rank that never waits must hold, on
average, (4K + 4) / 6 halves in flight (two forwards, two input and two weight gradients per
micro-batch, each a step of the round trip). V-Min caps every rank at that, rounded up
(at least two: both chunks of one micro-batch), about a third of 1F1B's; V-Half at K + 1,
about half. Where the cap bites, the rank waits rather than hold more.

The order is a list schedule played in unit time (every F, B and W one step): at each step
an idle rank runs, of what is ready, a B (the input gradients others wait for), else a
forward the cap allows (chunk 1 first, which is nearer its backward), else a W (weight
gradients, which nobody waits for and which free memory); the oldest micro-batch first. A
forward of chunk 0 takes the last place under the cap only once every micro-batch on the
rank has run its chunk-1 forward, so that a rank never fills up with micro-batches that
cannot turn back.
"""

from __future__ import annotations

import functools

from gpipe.schedules.ir import Kind, Schedule, ScheduleError, check_sizes
from gpipe.schedules.v_shape import Order, check_v, v_schedule

__all__ = ["v_half", "v_half_cap", "v_min", "v_min_cap", "v_min_fewest"]


def v_half_cap(n_ranks: int) -> int:
    """The chunk-sized micro-batches V-Half holds at most per rank: K + 1, about half of
    1F1B's 2K."""
    return n_ranks + 1


def v_min_cap(n_ranks: int) -> int:
    """The chunk-sized micro-batches V-Min holds at most per rank: (4K + 4) / 6 rounded up,
    and at least both chunks of one micro-batch; about a third of 1F1B's 2K."""
    return max(2, (2 * n_ranks + 4) // 3)


def v_min_fewest(n_ranks: int) -> int:
    """The fewest micro-batches V-Min takes: with fewer, 2M chunks are within its cap, no
    rank reaches it and the schedule would hold what zero-bubble-v holds."""
    return v_min_cap(n_ranks) // 2 + 1


class _Rank:
    """One rank's counters per chunk and what it holds: the n-th forward (B, W) of a chunk
    is of micro-batch n."""

    def __init__(self, rank: int, n_stages: int) -> None:
        self.stage = (rank, n_stages - 1 - rank)
        self.forwards = [0, 0]
        self.backwards = [0, 0]
        self.weights = [0, 0]
        self.live = 0  # chunk-sized micro-batches held
        self.order: Order = []


def capped_v(
    name: str, n_stages: int, n_microbatches: int, n_ranks: int | None, cap: int
) -> Schedule:
    """A V of ``n_stages`` stages whose ranks hold at most ``cap`` chunk-sized micro-batches
    at once, ordered as the module says."""
    check_sizes(n_stages, n_microbatches)
    k = check_v(name, n_stages, n_ranks)
    m = n_microbatches
    never = 2 * 6 * m * k + 4 * n_stages  # later than any step: not run yet
    forward_end = [[never] * m for _ in range(n_stages)]
    backward_end = [[never] * m for _ in range(n_stages)]
    ranks = [_Rank(r, n_stages) for r in range(k)]
    left = 6 * m * k
    step = 0
    while left:
        ran = 0
        for r in ranks:
            action = _next(r, step, m, cap, forward_end, backward_end)
            if action is None:
                continue
            kind, chunk = action
            stage = r.stage[chunk]
            if kind is Kind.FORWARD:
                mb = r.forwards[chunk]
                r.forwards[chunk] += 1
                r.live += 1
                forward_end[stage][mb] = step + 1
            elif kind is Kind.BACKWARD:
                mb = r.backwards[chunk]
                r.backwards[chunk] += 1
                backward_end[stage][mb] = step + 1
            else:
                mb = r.weights[chunk]
                r.weights[chunk] += 1
                r.live -= 1
            r.order.append((kind, stage, mb))
            ran += 1
        if not ran and step > 0:  # nothing runs and nothing is under way: it cannot go on
            raise ScheduleError(f"{name}: no rank can move at step {step} (cap {cap})")
        left -= ran
        step += 1
    return v_schedule(name, n_stages, n_microbatches, [r.order for r in ranks])


def _next(
    r: _Rank,
    step: int,
    m: int,
    cap: int,
    forward_end: list[list[int]],
    backward_end: list[list[int]],
) -> tuple[Kind, int] | None:
    """What rank ``r`` runs at ``step``: (kind, chunk), or None to wait. Of each kind, the
    oldest micro-batch's, chunk 1's on a tie (plain loops: this runs for every rank and step
    of schedules of a million actions)."""
    last = len(forward_end) - 1
    best, chosen = m, -1
    for chunk in (1, 0):
        mb, stage = r.backwards[chunk], r.stage[chunk]
        ready = mb < r.forwards[chunk] and (stage == last or backward_end[stage + 1][mb] <= step)
        if ready and mb < best:
            best, chosen = mb, chunk
    if chosen >= 0:
        return Kind.BACKWARD, chosen
    for chunk in (1, 0):
        mb, stage = r.forwards[chunk], r.stage[chunk]
        ready = mb < best and (stage == 0 or forward_end[stage - 1][mb] <= step)
        if ready and _fits(r, chunk, cap):
            best, chosen = mb, chunk
    if chosen >= 0:
        return Kind.FORWARD, chosen
    for chunk in (1, 0):
        mb = r.weights[chunk]
        if mb < r.backwards[chunk] and mb < best:
            best, chosen = mb, chunk
    return (Kind.WEIGHT, chosen) if chosen >= 0 else None


def _fits(r: _Rank, chunk: int, cap: int) -> bool:
    """Whether a forward of ``chunk`` stays under the cap; one of chunk 0 leaves a place for
    the chunk-1 forward of a micro-batch that has not turned yet."""
    if chunk == 1 or r.forwards[0] == r.forwards[1]:
        return r.live < cap
    return r.live + 1 < cap


@functools.lru_cache(maxsize=256)
def v_half(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """V-Half on a V of 2K stages: at most K + 1 chunk-sized micro-batches per rank, about
    half of 1F1B's peak activations, at about 1F1B's bubble or less."""
    k = check_v("v-half", n_stages, n_ranks)
    return capped_v("v-half", n_stages, n_microbatches, n_ranks, v_half_cap(k))


@functools.lru_cache(maxsize=256)
def v_min(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """V-Min on a V of 2K stages: at most max(2, (4K + 4) / 6 rounded up) chunk-sized
    micro-batches per rank, about a third of 1F1B's peak activations; it needs
    ``v_min_fewest(K)`` micro-batches."""
    k = check_v("v-min", n_stages, n_ranks)
    check_sizes(n_stages, n_microbatches)
    fewest = v_min_fewest(k)
    if n_microbatches < fewest:
        raise ValueError(
            f"v-min needs at least {fewest} micro-batches for {k} ranks (with fewer, none "
            f"reaches its cap of {v_min_cap(k)} half-stage micro-batches: use zero-bubble-v), "
            f"got {n_microbatches}"
        )
    return capped_v("v-min", n_stages, n_microbatches, n_ranks, v_min_cap(k))
