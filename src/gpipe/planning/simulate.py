"""Cost and memory simulation of any schedule: predicted timelines, bubbles and peak memory."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from numbers import Real
from pathlib import Path
from typing import Any

from gpipe.runtime.recompute import check_checkpoint, should_checkpoint
from gpipe.runtime.timeline import Event
from gpipe.schedules import Action, Kind, Schedule, ScheduleError, add_recompute, get_schedule

__all__ = [
    "Costs",
    "SimResult",
    "analytic_bubble",
    "closed_form_bubble",
    "compare",
    "measured_costs",
    "predict",
    "scenario",
    "simulate",
]

PerStage = float | Sequence[float]
Route = tuple[int, int]

_PER_STAGE = ("forward", "backward", "weight", "activation_bytes", "grad_bytes", "recompute")
_SCALAR = ("latency", "message_bytes")


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_amount(name: str, value: Any) -> float:
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"Costs.{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_per_stage(name: str, value: Any) -> float | tuple[float, ...]:
    if _is_number(value):
        return _check_amount(name, value)
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise ValueError(
            f"Costs.{name} must be a number or a non-empty list of one number per stage, "
            f"got {value!r}"
        )
    return tuple(_check_amount(f"{name}[{s}]", v) for s, v in enumerate(value))


def _check_skip_bytes(value: Any) -> tuple[tuple[Route, float], ...]:
    """``{(src, dst): bytes}`` (or its pairs) as sorted pairs; ``"src->dst"`` keys (as JSON
    writes them) are read too."""
    if isinstance(value, tuple):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise ValueError(
            f"Costs.skip_bytes must map (source, destination) stages to bytes, got {value!r}"
        )
    routes: dict[Route, float] = {}
    for key, nbytes in value.items():
        route = key
        if isinstance(key, str):
            parts = key.split("->")
            route = tuple(int(p) for p in parts) if all(p.strip().isdigit() for p in parts) else key
        if not (
            isinstance(route, tuple)
            and len(route) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) for s in route)
            and 0 <= route[0] < route[1]
        ):
            raise ValueError(
                f"Costs.skip_bytes keys are (source, destination) stages with source < "
                f"destination, or 'source->destination', got {key!r}"
            )
        routes[route] = _check_amount(f"skip_bytes[{key!r}]", nbytes)  # type: ignore[index]
    return tuple(sorted(routes.items()))


@dataclass(frozen=True)
class Costs:
    """What a schedule's actions cost, so that schedules can be compared before anything runs.

    ``forward``, ``backward``, ``weight`` (seconds) and ``activation_bytes`` are one number
    for every stage or a list of one per stage. ``backward`` is the input-gradient part of a
    backward and ``weight`` its weight-gradient part: a split-backward schedule runs them as
    its B and W actions; any other schedule's B does both and takes ``backward + weight``.

    A message between stages on different ranks arrives ``latency + message_bytes /
    bandwidth`` seconds after it is sent, whatever else is in flight (links never congest);
    between stages on one rank it arrives at once. A stage keeps ``activation_bytes`` per
    micro-batch from the start of its forward to the end of its last backward action; a
    re-materialized micro-batch (``simulate``'s ``checkpoint``) keeps only its input,
    taken to be a message's size, ``message_bytes``, until its backward recomputes the rest.

    ``skip_bytes`` maps a skip route ``(source, destination)`` to the bytes of one
    micro-batch's skip tensors on it (``gpipe.skip``; kept as sorted pairs, so that costs
    stay hashable): between ranks, that message and its gradient take ``latency +
    skip_bytes / bandwidth`` and the destination holds its copy, besides its activations,
    from its forward to its backward (re-materialized or not); within a rank the skip is
    shared, free and instant.

    ``recompute`` is the forward time each backward runs again when only some layers are
    recomputed (``gpipe.runtime.recompute.Layers``); it is added to every B.

    With replicas (``simulate``'s ``data_parallel``), each stage's ``grad_bytes`` of
    gradients are summed over them by a ring all-reduce: ``2 (D - 1) / D x grad_bytes /
    allreduce_bandwidth`` (the link's bandwidth if None) plus ``2 (D - 1)`` latencies.
    """

    forward: PerStage
    backward: PerStage
    weight: PerStage = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    message_bytes: float = 0.0
    activation_bytes: PerStage = 0.0
    skip_bytes: Mapping[Route, float] | tuple[tuple[Route, float], ...] = ()
    grad_bytes: PerStage = 0.0
    allreduce_bandwidth: float | None = None
    recompute: PerStage = 0.0

    def __post_init__(self) -> None:
        for name in _PER_STAGE:
            object.__setattr__(self, name, _check_per_stage(name, getattr(self, name)))
        for name in _SCALAR:
            object.__setattr__(self, name, _check_amount(name, getattr(self, name)))
        object.__setattr__(self, "skip_bytes", _check_skip_bytes(self.skip_bytes))
        ring = self.allreduce_bandwidth
        if ring is not None and (not _is_number(ring) or math.isnan(ring) or ring <= 0):
            raise ValueError(
                f"Costs.allreduce_bandwidth must be a positive number of bytes per second or "
                f"None (the link's bandwidth), got {ring!r}"
            )
        bandwidth = self.bandwidth
        if not _is_number(bandwidth) or math.isnan(bandwidth) or bandwidth <= 0:
            raise ValueError(
                f"Costs.bandwidth must be a positive number of bytes per second, got {bandwidth!r}"
            )
        object.__setattr__(self, "bandwidth", float(bandwidth))

    @classmethod
    def from_file(cls, path: str | Path) -> Costs:
        """Read costs from a JSON object such as ``{"forward": [1, 2], "backward": 2}``."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of costs, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{path}: unknown cost fields {unknown}; expected some of {known}")
        missing = [name for name in ("forward", "backward") if name not in data]
        if missing:
            raise ValueError(f"{path}: missing cost fields {missing}")
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values (per-stage values as lists, skip routes as
        ``"src->dst"`` keys); ``from_file`` reads it."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "skip_bytes":
                value = {f"{src}->{dst}": v for (src, dst), v in value}
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def per_stage(self, name: str, n_stages: int) -> tuple[float, ...]:
        """The field ``name`` as one value per stage, checking a list has ``n_stages`` values."""
        value = getattr(self, name)
        if isinstance(value, tuple):
            if len(value) != n_stages:
                raise ValueError(
                    f"Costs.{name} has {len(value)} values, but the schedule has {n_stages} stages"
                )
            return value
        return (value,) * n_stages


@dataclass(frozen=True)
class SimResult:
    """The predicted run of one schedule under given costs.

    ``busy`` and ``idle`` are per rank; ``bubble`` is the idle share of all ranks' time.
    ``peak_live`` counts, per stage, the most micro-batches whose activations are held at
    once; ``peak_activation_bytes`` is that in bytes per stage and
    ``peak_rank_activation_bytes`` the peak of the sum over each rank's stages.
    ``compute_times[r]`` holds start and end, in turn, of rank ``r``'s compute actions in
    program order; ``events`` pairs them with their actions. ``checkpoint`` is the
    re-materialization mode simulated: a recomputed micro-batch's B span starts with the
    recomputation of its forward.
    """

    schedule: Schedule = field(repr=False)
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble: float
    peak_live: tuple[int, ...]
    peak_activation_bytes: tuple[float, ...]
    peak_rank_activation_bytes: tuple[float, ...]
    compute_times: tuple[tuple[float, ...], ...] = field(repr=False)
    checkpoint: str = "never"
    allreduce_exposed: tuple[float, ...] = ()  # per rank: all-reduce time past its program

    @functools.cached_property
    def events(self) -> list[tuple[int, Action, float, float]]:
        """``(rank, action, start, end)`` of every compute action, rank by rank, in order.

        Built on first use: a large simulation spends most of its time making these tuples.
        """
        events: list[tuple[int, Action, float, float]] = []
        for rank, times in enumerate(self.compute_times):
            actions = self.schedule.compute_only(rank)
            events.extend(zip(itertools.repeat(rank), actions, times[::2], times[1::2]))
        return events


def _delays(schedule: Schedule, costs: Costs) -> tuple[list[float], list[float]]:
    """Seconds a message takes from stage s to s + 1 (forward) and to s - 1 (backward)."""
    rank_of = schedule.stage_to_rank
    k = schedule.n_stages
    wire = costs.latency + costs.message_bytes / costs.bandwidth
    forward = [0.0 if s + 1 < k and rank_of[s + 1] == rank_of[s] else wire for s in range(k)]
    backward = [0.0 if s > 0 and rank_of[s - 1] == rank_of[s] else wire for s in range(k)]
    return forward, backward


def simulate(
    schedule: Schedule,
    costs: Costs,
    checkpoint: str = "never",
    *,
    data_parallel: int = 1,
    overlap: bool = True,
    bucket_bytes: float | None = None,
) -> SimResult:
    """Predict when every action of ``schedule`` runs, on ranks that each run their program.

    Each rank runs its actions strictly in order: a compute action takes its stage's cost, a
    send takes no time and its message arrives after the delay given by ``costs``, a receive
    waits until its message has arrived. The schedule is read as given (``validate`` checks
    its shape); ranks that end up waiting on each other raise ScheduleError. Time and memory
    are linear in the number of actions.

    ``checkpoint`` is a re-materialization mode (``gpipe.runtime.recompute``): the micro-batches
    it picks keep only ``message_bytes`` (their input) after their forward, and each stage
    recomputes their forward as an R action right before it receives their gradient
    (``add_recompute``, as the runtime does), which costs the stage's forward time and holds
    ``activation_bytes`` again from then on. ``"never"`` (the default) recomputes nothing,
    unless ``schedule`` already has R actions; neither does a forward-only schedule, which
    keeps nothing.

    ``data_parallel`` replicas of the pipeline sum each stage's gradients (``Costs``) in
    buckets as the runtime cuts them (``gpipe.parallel.replicas.bucket_size`` of ``bucket_bytes``):
    with ``overlap``, bucket i of n is complete i/n of the way through the stage's last
    backward action and starts then, so only the last bucket is sure to run after it;
    without, they all start when that action ends. A rank's all-reduces run one after the
    other, and its step ends when the last does.
    """
    check_checkpoint(checkpoint)
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be a positive integer, got {data_parallel!r}")
    n_mb = schedule.n_microbatches
    if checkpoint != "never" and not schedule.recomputed:
        picked = frozenset(i for i in range(n_mb) if should_checkpoint(checkpoint, i, n_mb))
        schedule = add_recompute(schedule, picked)
    n_stages, n_ranks = schedule.n_stages, schedule.n_ranks
    if len(schedule.stage_to_rank) != n_stages:
        raise ScheduleError(
            f"stage_to_rank has {len(schedule.stage_to_rank)} entries for {n_stages} stages"
        )
    f_cost = costs.per_stage("forward", n_stages)
    w_cost = costs.per_stage("weight", n_stages)
    b_cost = costs.per_stage("backward", n_stages)
    if not schedule.split_backward:
        b_cost = tuple(b + w for b, w in zip(b_cost, w_cost, strict=True))
    r_cost = costs.per_stage("recompute", n_stages)
    b_cost = tuple(b + r for b, r in zip(b_cost, r_cost, strict=True))
    rank_of = schedule.stage_to_rank
    skip_bytes = dict(costs.skip_bytes)
    skip_in = [0.0] * n_stages  # what a stage holds of skips copied from another rank
    for (src, dst), nbytes in skip_bytes.items():
        if dst >= n_stages:
            raise ValueError(
                f"Costs.skip_bytes has route {src}->{dst}, but the schedule has {n_stages} stages"
            )
        if rank_of[src] != rank_of[dst]:
            skip_in[dst] += nbytes
    act_bytes = tuple(
        a + b for a, b in zip(costs.per_stage("activation_bytes", n_stages), skip_in, strict=True)
    )
    f_delay, b_delay = _delays(schedule, costs)
    # what a re-materialized micro-batch keeps: its input and the skips it received
    light = [costs.message_bytes + skip_in[s] for s in range(n_stages)]
    recompute = [schedule.backward and i in schedule.recomputed for i in range(n_mb)]

    def skip_delay(a: int, b: int) -> float:
        """A skip between stages a and b, or its gradient: the route's bytes either way."""
        if rank_of[a] == rank_of[b]:
            return 0.0
        return costs.latency + skip_bytes.get((min(a, b), max(a, b)), 0.0) / costs.bandwidth

    F, B, W, R = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT, Kind.RECOMPUTE
    SEND_F, RECV_F, SEND_B, RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
    SEND_SKIP, SEND_SKIP_B = Kind.SEND_SKIP, Kind.SEND_SKIP_B
    release = W if schedule.split_backward else B  # the last action that needs activations
    keeps = schedule.backward  # forward-only schedules drop activations at once

    # The message to stage s about micro-batch i is slot s * n_mb + i of its kind's list.
    f_arrival: list[float | None] = [None] * (n_stages * n_mb)
    b_arrival: list[float | None] = [None] * (n_stages * n_mb)
    f_waiting: dict[int, int] = {}  # slot -> the rank blocked on it
    b_waiting: dict[int, int] = {}
    # skip messages: (forward?, destination, source, micro-batch) -> arrival / blocked rank
    s_arrival: dict[tuple[bool, int, int, int], float] = {}
    s_waiting: dict[tuple[bool, int, int, int], int] = {}
    programs = [iter(program) for program in schedule.programs]
    blocked_at: list[Action | None] = [None] * n_ranks  # the receive a rank waits at
    clock, busy = [0.0] * n_ranks, [0.0] * n_ranks
    live, peak = [0] * n_stages, [0] * n_stages
    kept = [0] * n_stages  # of the live micro-batches, those holding only their input
    stage_peak = [0.0] * n_stages
    rank_bytes, rank_peak = [0.0] * n_ranks, [0.0] * n_ranks
    times: list[list[float]] = [[] for _ in range(n_ranks)]
    ready = list(range(n_ranks - 1, -1, -1))
    while ready:
        r = ready.pop()
        t, work = clock[r], busy[r]
        held, held_peak = rank_bytes[r], rank_peak[r]
        record = times[r].append
        pending = blocked_at[r]
        for a in programs[r] if pending is None else itertools.chain((pending,), programs[r]):
            kind = a.kind
            if kind is F:
                s = a.stage
                start = t
                cost = f_cost[s]
                t += cost
                work += cost
                record(start)
                record(t)
                if keeps:
                    n = live[s] = live[s] + 1
                    if n > peak[s]:
                        peak[s] = n
                    if recompute[a.microbatch]:
                        kept[s] += 1
                        held += light[s]
                    else:
                        held += act_bytes[s]
                    if held > held_peak:
                        held_peak = held
                    now = (n - kept[s]) * act_bytes[s] + kept[s] * light[s]
                    if now > stage_peak[s]:
                        stage_peak[s] = now
                else:
                    peak[s] = 1
                    stage_peak[s] = act_bytes[s]
                    held_peak = max(held_peak, held + act_bytes[s])
            elif kind is SEND_F:
                slot = (a.stage + 1) * n_mb + a.microbatch
                f_arrival[slot] = t + f_delay[a.stage]
                if slot in f_waiting:
                    ready.append(f_waiting.pop(slot))
            elif kind is RECV_F:
                slot = a.stage * n_mb + a.microbatch
                at = f_arrival[slot]
                if at is None:
                    f_waiting[slot] = r
                    break
                if at > t:
                    t = at
            elif kind is SEND_B:
                slot = (a.stage - 1) * n_mb + a.microbatch
                b_arrival[slot] = t + b_delay[a.stage]
                if slot in b_waiting:
                    ready.append(b_waiting.pop(slot))
            elif kind is R:  # the forward again, graph and all
                s = a.stage
                start = t
                cost = f_cost[s]
                kept[s] -= 1
                held += act_bytes[s] - light[s]
                if held > held_peak:
                    held_peak = held
                now = (live[s] - kept[s]) * act_bytes[s] + kept[s] * light[s]
                if now > stage_peak[s]:
                    stage_peak[s] = now
                t += cost
                work += cost
                record(start)
                record(t)
            elif kind is B or kind is W:
                s = a.stage
                start = t
                cost = b_cost[s] if kind is B else w_cost[s]
                t += cost
                work += cost
                record(start)
                record(t)
                if kind is release:
                    live[s] -= 1
                    held -= act_bytes[s]
            elif kind is RECV_B:
                slot = a.stage * n_mb + a.microbatch
                at = b_arrival[slot]
                if at is None:
                    b_waiting[slot] = r
                    break
                if at > t:
                    t = at
            elif kind is SEND_SKIP or kind is SEND_SKIP_B:
                key = (kind is SEND_SKIP, a.peer, a.stage, a.microbatch)
                s_arrival[key] = t + skip_delay(a.stage, a.peer)  # type: ignore[arg-type]
                if key in s_waiting:
                    ready.append(s_waiting.pop(key))
            else:  # RECV_SKIP, RECV_SKIP_B
                key = (kind is Kind.RECV_SKIP, a.stage, a.peer, a.microbatch)
                at = s_arrival.get(key)  # type: ignore[arg-type]
                if at is None:
                    s_waiting[key] = r  # type: ignore[index]
                    break
                if at > t:
                    t = at
        else:
            a = None
        blocked_at[r] = a
        clock[r], busy[r] = t, work
        rank_bytes[r], rank_peak[r] = held, held_peak
    if any(blocked_at):
        blocked = ", ".join(f"rank {r} waits at {a}" for r, a in enumerate(blocked_at) if a)
        raise ScheduleError(f"{schedule.name} deadlocks: {blocked}")
    exposed = [0.0] * n_ranks
    if data_parallel > 1 and schedule.backward:
        exposed = _allreduce(schedule, times, clock, costs, data_parallel, overlap, bucket_bytes)
    return _result(schedule, times, clock, busy, peak, stage_peak, rank_peak, checkpoint, exposed)


def _allreduce(
    schedule: Schedule,
    times: list[list[float]],
    clock: list[float],
    costs: Costs,
    data_parallel: int,
    overlap: bool,
    bucket_bytes: float | None,
) -> list[float]:
    """Move each rank's clock past its stages' gradient all-reduces; returns what each rank
    waits for them after its program."""
    from gpipe.parallel.replicas import (
        bucket_size,  # here: the rest of the simulator needs no torch
    )

    d = data_parallel
    grad = costs.per_stage("grad_bytes", schedule.n_stages)
    bandwidth = costs.allreduce_bandwidth or costs.bandwidth
    exposed = []
    for rank, spans in enumerate(times):
        last: dict[int, tuple[float, float]] = {}
        for k, a in enumerate(schedule.compute_only(rank)):
            if a.kind is Kind.BACKWARD or a.kind is Kind.WEIGHT:
                last[a.stage] = (spans[2 * k], spans[2 * k + 1])
        link = 0.0  # when this rank's link is free for the next all-reduce
        for stage in sorted(last, key=lambda s: last[s][0]):
            start, end = last[stage]
            n = max(1, math.ceil(grad[stage] / bucket_size(grad[stage], bucket_bytes)))
            seconds = 2 * (d - 1) / d * grad[stage] / n / bandwidth + 2 * (d - 1) * costs.latency
            for i in range(1, n + 1):
                ready = start + i / n * (end - start) if overlap else end
                link = max(link, ready) + seconds
            link = max(link, end)
        finish = max(clock[rank], link)
        exposed.append(finish - clock[rank])
        clock[rank] = finish
    return exposed


def _result(
    schedule: Schedule,
    times: list[list[float]],
    clock: list[float],
    busy: list[float],
    peak: list[int],
    stage_peak: list[float],
    rank_peak: list[float],
    checkpoint: str,
    exposed: list[float],
) -> SimResult:
    makespan = max(clock, default=0.0)
    idle = tuple(makespan - b for b in busy)
    bubble = sum(idle) / (len(clock) * makespan) if makespan > 0 else 0.0
    return SimResult(
        schedule=schedule,
        makespan=makespan,
        busy=tuple(busy),
        idle=idle,
        bubble=bubble,
        peak_live=tuple(peak),
        peak_activation_bytes=tuple(stage_peak),
        peak_rank_activation_bytes=tuple(rank_peak),
        compute_times=tuple(map(tuple, times)),
        checkpoint=checkpoint,
        allreduce_exposed=tuple(exposed),
    )


def analytic_bubble(n_stages: int, n_microbatches: int) -> float:
    """GPipe's (and 1F1B's) bubble with equal stages and free messages: (K-1) / (M+K-1)."""
    for name, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


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
    M >= K and W <= F, B (None otherwise). ``simulate`` gives these exactly.
    """
    get_schedule(name)
    analytic_bubble(n_ranks, n_microbatches)  # checks the sizes
    k, m, v = n_ranks, n_microbatches, virtual_stages
    if name in ("gpipe", "1f1b"):
        return (k - 1) / (m + k - 1)
    if name == "interleaved":
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"virtual_stages must be a positive integer, got {v!r}")
        return (k - 1) / (v * m + k - 1) if m % k == 0 else None
    if name == "zero-bubble" and m >= k and weight <= min(forward, backward):
        drain = (k - 1) * (forward + backward - weight)
        total = m * (forward + backward + weight) + drain
        return drain / total if total > 0 else None
    return None


def scenario(
    name: str, n_ranks: int, n_microbatches: int, costs: Costs, virtual_stages: int = 2
) -> tuple[Schedule, Costs]:
    """Schedule ``name`` on ``n_ranks`` ranks, with costs that describe one rank's share of
    the model. Interleaved schedules cut that share into ``virtual_stages`` stages, each
    costing its part; the others run one stage per rank."""
    if name != "interleaved" or virtual_stages == 1:
        return get_schedule(name)(n_ranks, n_microbatches), costs
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
    n_stages = n_ranks * virtual_stages
    split = {
        field: [v / virtual_stages for v in costs.per_stage(field, n_ranks)] * virtual_stages
        for field in _PER_STAGE
    }
    schedule = get_schedule(name)(n_stages, n_microbatches, n_ranks)  # type: ignore[call-arg]
    return schedule, dataclasses.replace(costs, **split)


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

    ``n_stages`` is the number of ranks; see ``scenario`` for interleaved schedules. A
    schedule whose generator rejects these sizes gets a row with only its name and a
    ``note`` saying why, so one unsuitable schedule does not hide the others.
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


def measured_costs(schedule: Schedule, events: Sequence[Event]) -> Costs:
    """Each stage's mean measured time of F, B and W (0 where none ran); messages free."""
    total: dict[tuple[int, str], float] = {}
    count: dict[tuple[int, str], int] = {}
    for e in events:
        if e.is_compute:
            key = (e.stage, e.kind)
            total[key] = total.get(key, 0.0) + max(e.end - e.start, 0.0)
            count[key] = count.get(key, 0) + 1

    def mean(kind: str) -> list[float]:
        return [
            total.get((s, kind), 0.0) / count.get((s, kind), 1) for s in range(schedule.n_stages)
        ]

    return Costs(forward=mean("F"), backward=mean("B"), weight=mean("W"))


def predict(schedule: Schedule, events: Sequence[Event]) -> list[Event]:
    """The timeline ``schedule`` would have if each action took what it took on average.

    Costs come from the compute actions in ``events`` (a measured step); messages are taken
    as instant, so where the measured timeline lags the prediction, transfers or overheads
    are the cause. Returns the predicted compute events in order of start.
    """
    result = simulate(schedule, measured_costs(schedule, events))
    predicted = [
        Event(rank, a.stage, a.kind.value, a.microbatch, start, end)
        for rank, a, start, end in result.events
    ]
    return sorted(predicted, key=lambda e: (e.start, e.rank, e.stage))
