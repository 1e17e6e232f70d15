"""Each schedule's bubble and peak activation memory in closed form.

The formulas assume K ranks of equal cost, free messages and no recomputation; where they
hold, ``simulate`` gives exactly the same figures (the tests check it), so they are a quick
read of what a schedule costs and a check on the simulator. Costs are one rank's share: a
schedule that places several stages on a rank cuts it evenly among them.
"""

from __future__ import annotations

from collections.abc import Callable

from gpipe.schedules import get_schedule, traits
from gpipe.schedules.v_memory import v_half_cap, v_min_cap

__all__ = ["analytic_bubble", "closed_form_bubble", "closed_form_peak"]


def analytic_bubble(n_stages: int, n_microbatches: int) -> float:
    """GPipe's (and 1F1B's) bubble with equal stages and free messages: (K-1) / (M+K-1)."""
    for name, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


def _share(idle: float, m: int, f: float, b: float, w: float) -> float | None:
    """The bubble of a rank idle for ``idle`` beside its M (F + B + W) of work."""
    total = m * (f + b + w) + idle
    return idle / total if total > 0 else None


def _fill_drain(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """GPipe and 1F1B: K - 1 idle slots of F + B on each rank, before and after M."""
    return (k - 1) / (m + k - 1)


def _interleaved(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """Stages v times smaller fill and drain v times faster, when M goes in rounds of K."""
    return (k - 1) / (v * m + k - 1) if m % k == 0 else None


def _zero_bubble_h1(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """ZB-H1: the deferred W fill the drain, when there are enough of them (M >= K) and
    none is longer than an F or a B."""
    if m < k or w > min(f, b):
        return None
    return _share((k - 1) * (f + b - w), m, f, b, w)


def _looped_bfs(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """Interleaved's bubble, when every rank has work for the whole fill (M >= K)."""
    return (k - 1) / (v * m + k - 1) if m >= k else None


def _interleaved_zero_bubble(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """Interleaved's fill and drain, v times shorter, with the deferred W in the drain:
    (K-1)(F+B-W)/v idle on each rank, when no W is longer than an F or a B."""
    if m % k or w > min(f, b):
        return None
    return _share((k - 1) * (f + b - w) / v, m, f, b, w)


def _zero_bubble_v(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """ZB-V: each rank idles (K-1) max(B/2, B-W), a half-stage B per rank of the V (or
    what of it the deferred W cannot fill), once the steady state is reached (M >= 2K-1)
    and no F or W is longer than a B."""
    if m < 2 * k - 1 or f > b or w > b:
        return None
    return _share((k - 1) * max(b / 2, b - w), m, f, b, w)


def _dualpipe_v(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """DualPipeV, its pairs run one after the other: each rank idles (K-1) max(F, F+B-W)/2
    when B <= F <= B + W (every M it runs, M >= 2K)."""
    if m < 2 * k or not b <= f <= b + w:
        return None
    return _share((k - 1) * max(f, f + b - w) / 2, m, f, b, w)


def _v_half(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """V-Half: no idle time on one rank; on two, with F = B = W, each rank idles
    (2 + ceil(M/2)) F/2 (a chunk's F is half the rank's): the turn's round trip at either
    end, and half a chunk's F per micro-batch where its cap of three halves makes a rank
    wait. None beyond, where the cap shapes the timeline in ways only the simulator
    follows."""
    if k == 1:
        return 0.0
    if k > 2 or not f == b == w:
        return None
    return _share((2 + (m + 1) // 2) * f / 2, m, f, b, w)


def _v_min(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """V-Min: no idle time on one rank; on two, with F = B = W, each rank idles
    (2M + 1) F/2: capped at one micro-batch's two halves, each rank waits two chunk steps
    per micro-batch for the other. None beyond, as V-Half's."""
    if k == 1:
        return 0.0
    if k > 2 or not f == b == w:
        return None
    return _share((2 * m + 1) * f / 2, m, f, b, w)


# Each schedule's bubble as a function of (K, M, v, F, B, W); a schedule without an entry
# has no closed form.
_BUBBLES: dict[str, Callable[[int, int, int, float, float, float], float | None]] = {
    "gpipe": _fill_drain,
    "1f1b": _fill_drain,
    "interleaved": _interleaved,
    "zero-bubble": _zero_bubble_h1,
    "looped-bfs": _looped_bfs,
    "interleaved-zero-bubble": _interleaved_zero_bubble,
    "zero-bubble-v": _zero_bubble_v,
    "dualpipe-v": _dualpipe_v,
    "v-half": _v_half,
    "v-min": _v_min,
}

# Each schedule's peak activations on rank r as a function of (K, M, v, r), in micro-batches
# of the rank's share of the model: what the rank holds at most between a forward and the
# last backward action of the same micro-batch.
_PEAKS: dict[str, Callable[[int, int, int, int], float]] = {
    "gpipe": lambda k, m, v, r: m,
    "looped-bfs": lambda k, m, v, r: m,
    "1f1b": lambda k, m, v, r: min(m, k - r),
    "zero-bubble": lambda k, m, v, r: min(m, k),
    "interleaved": lambda k, m, v, r: min(m, k + (k - 1 - 2 * r) / v),
    "interleaved-zero-bubble": lambda k, m, v, r: min(m, k + (k - 1 - r) / v),
    "zero-bubble-v": lambda k, m, v, r: min(m, (m + r + 1) / 2, k),
    "dualpipe-v": lambda k, m, v, r: k + 1 / 2,
    "v-half": lambda k, m, v, r: min(v_half_cap(k), 2 * m) / 2,
    "v-min": lambda k, m, v, r: min(v_min_cap(k), 2 * m) / 2,
}


def closed_form_bubble(
    name: str,
    n_ranks: int,
    n_microbatches: int,
    virtual_stages: int = 1,
    forward: float = 1.0,
    backward: float = 1.0,
    weight: float = 0.0,
) -> float | None:
    """Schedule ``name``'s bubble in closed form, or None where it has none.

    For K ranks of equal cost (``forward``, ``backward`` and ``weight`` per rank, as in
    ``Costs``), free messages and no recomputation: gpipe and 1f1b (K-1)/(M+K-1);
    interleaved with v stages per rank (K-1)/(vM+K-1), M a multiple of K; looped-bfs
    interleaved's, when M >= K. The split-backward schedules leave each rank idle for a
    time I beside its M (F+B+W) of work, so their bubble is I / (M(F+B+W) + I):
    zero-bubble (ZB-H1) I = (K-1)(F+B-W) when M >= K and W <= F, B;
    interleaved-zero-bubble I = (K-1)(F+B-W)/v, M a multiple of K and W <= F, B;
    zero-bubble-v I = (K-1) max(B/2, B-W) when M >= 2K-1 and F, W <= B;
    dualpipe-v I = (K-1) max(F, F+B-W)/2 when B <= F <= B+W; v-half and v-min none on one
    rank, and on two with F = B = W, I = (2 + ceil(M/2)) F/2 and (2M + 1) F/2. None outside
    those bounds.
    """
    get_schedule(name)
    analytic_bubble(n_ranks, n_microbatches)  # checks the sizes
    _check_virtual_stages(virtual_stages)
    form = _BUBBLES.get(name)
    if form is None or not traits(name).runs(n_ranks, n_microbatches, virtual_stages):
        return None
    return form(n_ranks, n_microbatches, virtual_stages, forward, backward, weight)


def closed_form_peak(
    name: str, n_ranks: int, n_microbatches: int, virtual_stages: int = 1
) -> tuple[float, ...] | None:
    """The most micro-batches' activations each rank holds at once under schedule ``name``,
    in units of one micro-batch through the rank's share of the model (so a rank that
    holds two half-size stages with 3 micro-batches live in each holds 3).

    With no recomputation and equal activations per stage, ``simulate``'s
    ``peak_rank_activation_bytes`` is this times a rank's bytes per micro-batch. Rank r of K,
    M micro-batches, v stages per rank: gpipe and looped-bfs M; 1f1b min(M, K-r);
    zero-bubble min(M, K); interleaved min(M, K + (K-1-2r)/v); interleaved-zero-bubble
    min(M, K + (K-1-r)/v); zero-bubble-v min(M, (M+r+1)/2, K), so its busiest rank holds
    1F1B's; dualpipe-v K + 1/2; v-half min(K + 1, 2M)/2 and v-min min(max(2, ceil((2K+2)/3)),
    2M)/2, their caps. None for a schedule without a formula, or sizes it does not run.
    """
    get_schedule(name)
    analytic_bubble(n_ranks, n_microbatches)  # checks the sizes
    _check_virtual_stages(virtual_stages)
    form = _PEAKS.get(name)
    if form is None or not traits(name).runs(n_ranks, n_microbatches, virtual_stages):
        return None
    return tuple(float(form(n_ranks, n_microbatches, virtual_stages, r)) for r in range(n_ranks))


def _check_virtual_stages(value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"virtual_stages must be a positive integer, got {value!r}")
