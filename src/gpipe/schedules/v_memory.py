"""V-Half and V-Min: V schedules whose activation memory is capped (Qi et al., "Pipeline
Parallelism with Controllable Memory", 2024), on zero-bubble-v's V of 2K stages; and the same
order over sub-sequences (``capped_v(seq_chunks=S)``, zero-bubble-v's sequence-pipelined form).

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
from dataclasses import replace

from gpipe.errors import counted
from gpipe.schedules.ir import Kind, Schedule, ScheduleError, check_sizes
from gpipe.schedules.v_shape import Order, check_v, v_schedule

__all__ = ["capped_v", "v_half", "v_half_cap", "v_min", "v_min_cap", "v_min_fewest"]


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
    """One rank's counters per chunk and what it holds. The n-th forward of a chunk is of
    unit n (a micro-batch, or with sub-sequences sub-sequence n % S of micro-batch n // S);
    its n-th B and W are of unit ``backward_units[n]``: micro-batches in order, each one's
    sub-sequences last to first."""

    def __init__(self, rank: int, n_stages: int, backward_units: list[int]) -> None:
        self.stage = (rank, n_stages - 1 - rank)
        self.backward_units = backward_units
        self.forwards = [0, 0]
        self.backwards = [0, 0]
        self.weights = [0, 0]
        self.live = 0  # chunk-sized units held
        self.order: Order = []

    def run(
        self,
        kind: Kind,
        chunk: int,
        step: int,
        forward_end: list[list[int]],
        backward_end: list[list[int]],
    ) -> None:
        """Append ``kind`` of ``chunk``'s next unit, ending after ``step``."""
        stage = self.stage[chunk]
        if kind is Kind.FORWARD:
            unit = self.forwards[chunk]
            self.forwards[chunk] += 1
            self.live += 1
            forward_end[stage][unit] = step + 1
        elif kind is Kind.BACKWARD:
            unit = self.backward_units[self.backwards[chunk]]
            self.backwards[chunk] += 1
            backward_end[stage][unit] = step + 1
        else:
            unit = self.backward_units[self.weights[chunk]]
            self.weights[chunk] += 1
            self.live -= 1
        self.order.append((kind, stage, unit))


def capped_v(
    name: str,
    n_stages: int,
    n_microbatches: int,
    n_ranks: int | None,
    cap: int,
    seq_chunks: int = 1,
    durations: tuple[int, int, int] = (1, 1, 1),
) -> Schedule:
    """A V of ``n_stages`` stages whose ranks hold at most ``cap`` chunk-sized units at once,
    ordered as the module says; a unit is a micro-batch, or with ``seq_chunks`` S > 1 one of
    its S sub-sequences (numbered ``i * S + j``, forwards in order, each micro-batch's
    backwards last to first). The order is played with F, B and W taking ``durations``
    steps each."""
    check_sizes(n_stages, n_microbatches)
    k = check_v(name, n_stages, n_ranks)
    s = seq_chunks
    units = n_microbatches * s
    backward_units = [i * s + j for i in range(n_microbatches) for j in reversed(range(s))]
    longest = max(durations)
    never = 2 * 6 * units * k * longest + 4 * n_stages  # later than any step: not run yet
    forward_end = [[never] * units for _ in range(n_stages)]
    backward_end = [[never] * units for _ in range(n_stages)]
    ranks = [_Rank(r, n_stages, backward_units) for r in range(k)]
    steps = dict(zip((Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT), durations, strict=True))
    free = [0] * k  # the step from which each rank is idle
    left = 6 * units * k
    step = 0
    while left:
        for i, r in enumerate(ranks):  # what one starts at this step ends after it
            if free[i] > step:
                continue
            action = _next(r, step, units, s, cap, forward_end, backward_end)
            if action is not None:
                free[i] = step + steps[action[0]]
                r.run(*action, free[i] - 1, forward_end, backward_end)
                left -= 1
        if max(free) <= step and left:  # nothing runs and nothing is under way
            raise ScheduleError(f"{name}: no rank can move at step {step} (cap {cap})")
        step += 1
    schedule = v_schedule(name, n_stages, units, [r.order for r in ranks])
    return schedule if s == 1 else replace(schedule, seq_chunks=s)


def _next(
    r: _Rank,
    step: int,
    units: int,
    s: int,
    cap: int,
    forward_end: list[list[int]],
    backward_end: list[list[int]],
) -> tuple[Kind, int] | None:
    """What rank ``r`` runs at ``step``: (kind, chunk), or None to wait. Of each kind, the
    oldest micro-batch's, chunk 1's on a tie (plain loops: this runs for every rank and step
    of schedules of a million actions)."""
    last = len(forward_end) - 1
    best, chosen = units, -1
    for chunk in (1, 0):
        n, stage = r.backwards[chunk], r.stage[chunk]
        if n == units:
            continue
        unit = r.backward_units[n]
        ready = unit < r.forwards[chunk] and (
            stage == last or backward_end[stage + 1][unit] <= step
        )
        if ready and unit // s < best:
            best, chosen = unit // s, chunk
    if chosen >= 0:
        return Kind.BACKWARD, chosen
    for chunk in (1, 0):
        unit, stage = r.forwards[chunk], r.stage[chunk]
        ready = (
            unit < units and unit < best and (stage == 0 or forward_end[stage - 1][unit] <= step)
        )
        if ready and _fits(r, chunk, cap, s):
            best, chosen = unit, chunk
    if chosen >= 0:
        return Kind.FORWARD, chosen
    for chunk in (1, 0):
        n = r.weights[chunk]
        if n < r.backwards[chunk] and r.backward_units[n] // s < best:
            best, chosen = r.backward_units[n] // s, chunk
    return (Kind.WEIGHT, chosen) if chosen >= 0 else None


def _fits(r: _Rank, chunk: int, cap: int, s: int) -> bool:
    """Whether a forward of ``chunk`` stays under the cap; one of chunk 0 leaves room for the
    chunk-1 forwards that the oldest micro-batch on the way down and back still needs (all
    its units turn before its first backward)."""
    if chunk == 1 or r.forwards[0] == r.forwards[1]:
        return r.live < cap
    return r.live + 1 + s - r.forwards[1] % s <= cap


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
            f"v-min needs at least {fewest} micro-batches for {counted(k, 'rank')} (with "
            f"fewer, none reaches its cap of {v_min_cap(k)} half-stage micro-batches: use "
            f"zero-bubble-v), got {n_microbatches}"
        )
    return capped_v("v-min", n_stages, n_microbatches, n_ranks, v_min_cap(k))
