"""Schedules side by side: bubbles in closed form, a rank's costs cut into its stages, and a
table of simulated makespans, bubbles and memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from gpipe.planning.costs import PER_STAGE_FIELDS, Costs
from gpipe.planning.replay import simulate
from gpipe.schedules import Schedule, build, get_schedule, traits

__all__ = ["analytic_bubble", "closed_form_bubble", "compare", "scenario", "split_costs"]


def analytic_bubble(n_stages: int, n_microbatches: int) -> float:
    """GPipe's (and 1F1B's) bubble with equal stages and free messages: (K-1) / (M+K-1)."""
    for name, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


def _fill_drain(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """GPipe and 1F1B: K - 1 idle slots of F + B on each rank, before and after M."""
    return (k - 1) / (m + k - 1)


def _interleaved(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """Stages v times smaller fill and drain v times faster, when M goes in rounds of K."""
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_stages must be a positive integer, got {v!r}")
    return (k - 1) / (v * m + k - 1) if m % k == 0 else None


def _zero_bubble_h1(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """ZB-H1: the deferred W fill the drain, when there are enough of them (M >= K) and
    none is longer than an F or a B."""
    if m < k or w > min(f, b):
        return None
    drain = (k - 1) * (f + b - w)
    total = m * (f + b + w) + drain
    return drain / total if total > 0 else None


def _looped_bfs(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """Interleaved's bubble, when every rank has work for the whole fill (M >= K)."""
    return (k - 1) / (v * m + k - 1) if m >= k else None


def _interleaved_zero_bubble(k: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """Interleaved's fill and drain, v times shorter, with the deferred W in the drain:
    (K-1)(F+B-W)/v idle on each rank, when no W is longer than an F or a B."""
    if m % k or w > min(f, b):
        return None
    idle = (k - 1) * (f + b - w) / v
    total = m * (f + b + w) + idle
    return idle / total if total > 0 else None


# Each schedule's bubble as a function of (K, M, v, F, B, W); a schedule without an entry
# has no closed form.
_CLOSED_FORMS: dict[str, Callable[[int, int, int, float, float, float], float | None]] = {
    "gpipe": _fill_drain,
    "1f1b": _fill_drain,
    "interleaved": _interleaved,
    "zero-bubble": _zero_bubble_h1,
    "looped-bfs": _looped_bfs,
    "interleaved-zero-bubble": _interleaved_zero_bubble,
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
    interleaved with v stages per rank (K-1)/(vM+K-1), M a multiple of K; zero-bubble
    (ZB-H1), whose deferred W fill the drain, (K-1)(F+B-W) / (M(F+B+W) + (K-1)(F+B-W)) when
    M >= K and W <= F, B (None otherwise); looped-bfs interleaved's, when M >= K;
    interleaved-zero-bubble (K-1)(F+B-W)/v / (M(F+B+W) + (K-1)(F+B-W)/v), M a multiple of K
    and W <= F, B. ``simulate`` gives these exactly. The V schedules have none yet.
    """
    get_schedule(name)
    analytic_bubble(n_ranks, n_microbatches)  # checks the sizes
    form = _CLOSED_FORMS.get(name)
    if form is None:
        return None
    return form(n_ranks, n_microbatches, virtual_stages, forward, backward, weight)


def scenario(
    name: str, n_ranks: int, n_microbatches: int, costs: Costs, virtual_stages: int = 2
) -> tuple[Schedule, Costs]:
    """Schedule ``name`` on ``n_ranks`` ranks, with costs that describe one rank's share of
    the model. A schedule that places several stages on a rank cuts that share into
    ``virtual_stages`` stages, each costing its part; the others run one stage per rank."""
    per_rank = traits(name).stages_per_rank(virtual_stages)
    if per_rank == 1:
        return build(name, n_ranks, n_microbatches), costs
    if not isinstance(per_rank, int) or per_rank < 1:
        raise ValueError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
    schedule = build(name, n_ranks, n_microbatches, per_rank)
    return schedule, split_costs(schedule, costs)


def split_costs(schedule: Schedule, costs: Costs) -> Costs:
    """``costs`` of each rank cut evenly into the stages it holds in ``schedule``."""
    per_rank = schedule.n_stages // schedule.n_ranks
    if per_rank == 1 and schedule.stage_to_rank == tuple(range(schedule.n_ranks)):
        return costs
    rank_of = schedule.stage_to_rank
    split = {}
    for field in PER_STAGE_FIELDS:
        values = costs.per_stage(field, schedule.n_ranks)
        split[field] = [values[rank_of[s]] / per_rank for s in range(schedule.n_stages)]
    return dataclasses.replace(costs, **split)


def compare(
    names: Iterable[str],
    n_stages: int,
    n_microbatches: int,
    costs: Costs,
    virtual_stages: int = 2,
    data_parallel: int = 1,
) -> list[dict[str, Any]]:
    """One table row per named schedule: its makespan, bubble and peak memory under ``costs``
    (with ``data_parallel`` replicas, the gradient all-reduce's exposed time too).

    ``n_stages`` is the number of ranks; see ``scenario`` for schedules that place several
    stages on a rank. A schedule whose generator rejects these sizes gets a row with only its
    name and a ``note`` saying why, so one unsuitable schedule does not hide the others.
    """
    rows: list[dict[str, Any]] = []
    for name in names:
        try:
            schedule, cost = scenario(name, n_stages, n_microbatches, costs, virtual_stages)
        except ValueError as exc:
            rows.append({"schedule": name, "note": f"skipped: {exc}"})
            continue
        result = simulate(schedule, cost, data_parallel=data_parallel)
        rows.append(
            {
                "schedule": name,
                "makespan": result.makespan,
                "bubble": result.bubble,
                "peak_live": max(result.peak_live),
                "peak_live_per_stage": result.peak_live,
                "peak_activation_bytes": max(result.peak_rank_activation_bytes),
                "allreduce_exposed": max(result.allreduce_exposed, default=0.0),
            }
        )
    return rows
