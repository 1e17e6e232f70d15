"""Schedules side by side: a rank's costs cut into its stages, and a table of simulated
makespans, bubbles and memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from gpipe.planning.closed_forms import closed_form_bubble, closed_form_peak
from gpipe.planning.costs import PER_STAGE_FIELDS, Costs
from gpipe.planning.replay import simulate
from gpipe.schedules import Schedule, build, traits
from gpipe.schedules.seq_chunked import seq_chunked

__all__ = ["compare", "scenario", "split_costs", "sub_sequence_costs"]


def scenario(
    name: str,
    n_ranks: int,
    n_microbatches: int,
    costs: Costs,
    virtual_stages: int = 2,
    seq_chunks: int = 1,
) -> tuple[Schedule, Costs]:
    """Schedule ``name`` on ``n_ranks`` ranks, with costs that describe one rank's share of
    the model. A schedule that places several stages on a rank cuts that share into
    ``virtual_stages`` stages, each costing its part; the others run one stage per rank.
    ``seq_chunks`` S > 1: each micro-batch runs as S sub-sequences (``Pipeline(seq_chunks=S)``),
    the schedule's units, each costing ``sub_sequence_costs``'s share."""
    per_rank = traits(name).stages_per_rank(virtual_stages)
    if seq_chunks != 1:
        schedule = seq_chunked(name, n_ranks * per_rank, n_microbatches, seq_chunks, n_ranks)
        return schedule, split_costs(
            schedule, sub_sequence_costs(costs, seq_chunks, n_microbatches)
        )
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
    split: dict[str, Any] = {}  # replace()'s keywords, named at run time
    for field in PER_STAGE_FIELDS:
        values = costs.per_stage(field, schedule.n_ranks)
        split[field] = [values[rank_of[s]] / per_rank for s in range(schedule.n_stages)]
    return dataclasses.replace(costs, **split)


def sub_sequence_costs(costs: Costs, seq_chunks: int, n_microbatches: int) -> Costs:
    """``costs`` of micro-batches cut into ``seq_chunks`` equal sub-sequences: each unit
    computes, holds and sends 1/S of its micro-batch (the attention of a later sub-sequence,
    over more keys, costs more than this counts: a cut of equal costs is what
    ``seq_split="balanced"`` gives)."""
    scales = costs.microbatch_scales(n_microbatches) or (1.0,) * n_microbatches
    held = costs.activation_bytes
    return dataclasses.replace(
        costs,
        microbatch_scale=[scale / seq_chunks for scale in scales for _ in range(seq_chunks)],
        message_bytes=costs.message_bytes / seq_chunks,
        activation_bytes=held / seq_chunks
        if isinstance(held, (int, float))
        else [b / seq_chunks for b in held],
    )


def compare(
    names: Iterable[str],
    n_stages: int,
    n_microbatches: int,
    costs: Costs,
    virtual_stages: int = 2,
    data_parallel: int = 1,
    shard: str | None = None,
    reshard_after_forward: bool = False,
    seq_chunks: int = 1,
) -> list[dict[str, Any]]:
    """One table row per named schedule: its makespan, bubble and peak memory under ``costs``
    (with ``data_parallel`` replicas, the gradient reduction's exposed time too, and
    sharded as ``simulate``'s ``shard`` and ``reshard_after_forward`` say, the time waited
    for all-gathers), beside its closed forms (``closed_forms``; None where there is none,
    or the ranks' costs differ): the bubble, and the busiest rank's peak in micro-batches.

    ``n_stages`` is the number of ranks; see ``scenario`` for schedules that place several
    stages on a rank, and for ``seq_chunks`` (the peaks then count micro-batches' worth of
    sub-sequences: 1.25 for five of four). A schedule whose generator rejects these sizes gets
    a row with only its name and a ``note`` saying why, so one unsuitable schedule does not
    hide the others.
    """
    rows: list[dict[str, Any]] = []
    for name in names:
        try:
            schedule, cost = scenario(
                name, n_stages, n_microbatches, costs, virtual_stages, seq_chunks
            )
        except ValueError as exc:
            rows.append({"schedule": name, "note": f"skipped: {exc}"})
            continue
        result = simulate(
            schedule,
            cost,
            data_parallel=data_parallel,
            shard=shard,
            reshard_after_forward=reshard_after_forward,
        )
        v = traits(name).stages_per_rank(virtual_stages)
        whole = seq_chunks == 1  # the closed forms are those of whole micro-batches
        peak = closed_form_peak(name, n_stages, n_microbatches, v) if whole else None
        bubble = _closed_bubble(name, n_stages, n_microbatches, costs, v) if whole else None
        live = [n / seq_chunks for n in result.peak_live] if not whole else result.peak_live
        rows.append(
            {
                "schedule": name,
                "makespan": result.makespan,
                "bubble": result.bubble,
                "closed_form_bubble": bubble,
                "closed_form_peak": None if peak is None else max(peak),
                "peak_live": max(live),
                "peak_live_per_stage": live,
                "peak_activation_bytes": max(result.peak_rank_activation_bytes),
                "allreduce_exposed": max(result.allreduce_exposed, default=0.0),
                "gather_exposed": max(result.gather_exposed, default=0.0),
            }
        )
    return rows


def _closed_bubble(name: str, k: int, m: int, costs: Costs, v: int) -> float | None:
    """The closed-form bubble under ``costs``, if every rank and micro-batch costs the same."""
    values = [costs.per_stage(field, k) for field in ("forward", "backward", "weight")]
    if any(len(set(v)) > 1 for v in values) or len(set(costs.microbatch_scale)) > 1:
        return None
    return closed_form_bubble(name, k, m, v, *(x[0] for x in values))
