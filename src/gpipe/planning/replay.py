"""The simulator's event loop: each rank runs its program in order, each message arrives
after its link's delay, and the ranks' clocks, busy times and held activations follow."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpipe.planning.costs import Costs
from gpipe.planning.shards import check_shard, ring_seconds
from gpipe.runtime.recompute import check_checkpoint, should_checkpoint
from gpipe.schedules import SEND_KINDS, Action, Kind, Schedule, ScheduleError, add_recompute

__all__ = ["SimResult", "simulate"]

# The kinds of action by plain names: looking a member up on its enum is slow, and the loops
# below look at every action of a schedule.
_F, _B, _W, _R = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT, Kind.RECOMPUTE
_SEND_F, _SEND_B, _SEND_SKIP = Kind.SEND_F, Kind.SEND_B, Kind.SEND_SKIP
_RECV_F, _RECV_B, _RECV_SKIP = Kind.RECV_F, Kind.RECV_B, Kind.RECV_SKIP


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
    gather_exposed: tuple[float, ...] = ()  # per rank: time its program waits for all-gathers

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


def simulate(
    schedule: Schedule,
    costs: Costs,
    checkpoint: str = "never",
    *,
    data_parallel: int = 1,
    overlap: bool = True,
    bucket_bytes: float | None = None,
    shard: str | None = None,
    reshard_after_forward: bool = False,
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

    ``shard`` (``Pipeline``'s) replaces the all-reduce by ring collectives of half its
    traffic each (``gpipe.planning.shards.ring_seconds``, on ``allreduce_bandwidth``):
    ``"full"`` gathers each stage's parameters (``grad_bytes`` of them) at its first compute
    action, the rank waiting for it (``gather_exposed``), and reduce-scatters the gradients
    in the buckets above; with ``reshard_after_forward`` every compute action gathers them
    again. ``"optimizer"`` and ``"gradients"`` reduce-scatter the same way, then gather the
    updated parameters after the rank's last reduction.
    """
    check_checkpoint(checkpoint)
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be a positive integer, got {data_parallel!r}")
    check_shard(shard, data_parallel, reshard_after_forward)
    n_mb = schedule.n_microbatches
    if checkpoint != "never" and not schedule.recomputed:
        picked = frozenset(i for i in range(n_mb) if should_checkpoint(checkpoint, i, n_mb))
        schedule = add_recompute(schedule, picked)
    replay = _Replay(schedule, costs)
    if shard == "full":
        replay.gather(_gathers(schedule, costs, data_parallel), reshard_after_forward)
    held = _Activations(schedule, costs)
    replay.run()
    held.walk()
    exposed = [0.0] * schedule.n_ranks
    if data_parallel > 1 and schedule.backward:
        exposed = _allreduce(schedule, replay, costs, (data_parallel, shard), overlap, bucket_bytes)
    return _result(replay, held, checkpoint, exposed)


def _gathers(schedule: Schedule, costs: Costs, data_parallel: int) -> list[float]:
    """Seconds of the all-gather of each stage's parameters (``grad_bytes`` of them)."""
    bandwidth = costs.allreduce_bandwidth or costs.bandwidth
    return [
        ring_seconds(nbytes, data_parallel, bandwidth, costs.latency)
        for nbytes in costs.per_stage("grad_bytes", schedule.n_stages)
    ]


def _action_costs(
    schedule: Schedule, costs: Costs
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Seconds of each stage's F (and R), B and W: a B that is not split off does the weight
    gradients too, and every B recomputes what ``costs.recompute`` says."""
    n_stages = schedule.n_stages
    forward = costs.per_stage("forward", n_stages)
    weight = costs.per_stage("weight", n_stages)
    backward = costs.per_stage("backward", n_stages)
    if not schedule.split_backward:
        backward = tuple(b + w for b, w in zip(backward, weight, strict=True))
    recompute = costs.per_stage("recompute", n_stages)
    backward = tuple(b + r for b, r in zip(backward, recompute, strict=True))
    return forward, backward, weight


def _skip_in(schedule: Schedule, costs: Costs) -> list[float]:
    """What each stage holds per micro-batch of the skips copied to it from another rank."""
    n_stages, rank_of = schedule.n_stages, schedule.stage_to_rank
    skip_in = [0.0] * n_stages
    routes: dict[tuple[int, int], float] = dict(costs.skip_bytes)
    for (src, dst), nbytes in routes.items():
        if dst >= n_stages:
            raise ValueError(
                f"Costs.skip_bytes has route {src}->{dst}, but the schedule has {n_stages} stages"
            )
        if rank_of[src] != rank_of[dst]:
            skip_in[dst] += nbytes
    return skip_in


class _Activations:
    """The activations each rank holds as its compute actions run: the peaks, per stage, of
    the micro-batches live (``peak_live``) and of their bytes (``stage_peak``), and per rank
    of the bytes of all its stages (``rank_peak``).

    A micro-batch holds its stage's ``activation_bytes`` (and the skips copied to it) from
    its forward to its last backward action; a re-materialized one only its input until its
    recomputation; a forward-only schedule holds one micro-batch's at a time. What a rank
    holds depends only on the order of its own program, not on when its actions run.
    """

    def __init__(self, schedule: Schedule, costs: Costs) -> None:
        n_stages, n_mb = schedule.n_stages, schedule.n_microbatches
        skip_in = _skip_in(schedule, costs)
        activations = costs.per_stage("activation_bytes", n_stages)
        self._full = tuple(a + b for a, b in zip(activations, skip_in, strict=True))
        # what a re-materialized micro-batch keeps: its input and the skips it received
        self._light = [costs.message_bytes + skip_in[s] for s in range(n_stages)]
        self._recomputed = [schedule.backward and i in schedule.recomputed for i in range(n_mb)]
        self._schedule = schedule
        self.peak_live = [0] * n_stages
        self.stage_peak = [0.0] * n_stages
        self.rank_peak = [0.0] * schedule.n_ranks

    def walk(self) -> None:
        """Follow every rank's program."""
        live = [0] * self._schedule.n_stages
        kept = [0] * self._schedule.n_stages  # of the live micro-batches, those recomputed
        for rank, program in enumerate(self._schedule.programs):
            self.rank_peak[rank] = self._walk_rank(program, live, kept)

    def _walk_rank(self, program: Sequence[Action], live: list[int], kept: list[int]) -> float:
        """Follow one rank's program; returns the most bytes it holds at once. The loop sees
        every action of the schedule, so it keeps what it reads in locals."""
        full, light, recomputed = self._full, self._light, self._recomputed
        peak_live, stage_peak = self.peak_live, self.stage_peak
        keeps = self._schedule.backward  # forward-only schedules drop activations at once
        release = _W if self._schedule.split_backward else _B  # the last to need them
        forward, again = _F, _R
        held = most = 0.0
        for a in program:
            kind = a.kind
            if kind is forward:
                s = a.stage
                if not keeps:
                    peak_live[s] = 1
                    stage_peak[s] = full[s]
                    most = max(most, held + full[s])
                    continue
                n = live[s] = live[s] + 1
                if n > peak_live[s]:
                    peak_live[s] = n
                if recomputed[a.microbatch]:
                    kept[s] += 1
                    held += light[s]
                else:
                    held += full[s]
            elif kind is again:  # the whole graph again
                s = a.stage
                kept[s] -= 1
                held += full[s] - light[s]
            elif kind is release:
                live[a.stage] -= 1
                held -= full[a.stage]
                continue
            else:
                continue
            if held > most:
                most = held
            now = (live[s] - kept[s]) * full[s] + kept[s] * light[s]
            if now > stage_peak[s]:
                stage_peak[s] = now
        return most


def _delays(schedule: Schedule, costs: Costs) -> tuple[list[float], list[float]]:
    """Seconds a message takes from stage s to s + 1 (forward) and to s - 1 (backward):
    none within a rank; between ranks, the latency and ``message_bytes`` over the bandwidth.
    Links never congest."""
    rank_of = schedule.stage_to_rank
    k = schedule.n_stages
    wire = costs.latency + costs.message_bytes / costs.bandwidth
    forward = [0.0 if s + 1 < k and rank_of[s + 1] == rank_of[s] else wire for s in range(k)]
    backward = [0.0 if s > 0 and rank_of[s - 1] == rank_of[s] else wire for s in range(k)]
    return forward, backward


class _Skips:
    """The skip tensors and their gradients in flight, sent straight between two stages
    (``gpipe.skip``): when each arrives, and which rank waits for one not yet sent. Between
    ranks one takes the latency and the route's ``skip_bytes`` over the bandwidth."""

    def __init__(self, schedule: Schedule, costs: Costs) -> None:
        self._rank_of, self._costs = schedule.stage_to_rank, costs
        self._bytes = dict(costs.skip_bytes)
        # (forward?, destination, source, micro-batch) -> arrival, or the rank waiting
        self._arrival: dict[tuple[bool, int, int, int], float] = {}
        self._waiting: dict[tuple[bool, int, int, int], int] = {}

    def send(self, a: Action, t: float) -> int | None:
        """Post ``a``'s message at ``t``; returns the rank that was waiting for it, if any."""
        assert a.peer is not None  # a skip action names the stage at its other end
        key = (a.kind is _SEND_SKIP, a.peer, a.stage, a.microbatch)
        self._arrival[key] = t + self._delay(a.stage, a.peer)
        return self._waiting.pop(key, None)

    def arrival(self, a: Action, rank: int) -> float | None:
        """When the message receive ``a`` waits for arrives; None, with ``rank`` noted as
        waiting for it, if it is not sent yet."""
        assert a.peer is not None  # a skip action names the stage at its other end
        key = (a.kind is _RECV_SKIP, a.stage, a.peer, a.microbatch)
        at = self._arrival.get(key)
        if at is None:
            self._waiting[key] = rank
        return at

    def _delay(self, a: int, b: int) -> float:
        """A skip between stages a and b, or its gradient: the route's bytes either way."""
        if self._rank_of[a] == self._rank_of[b]:
            return 0.0
        nbytes = self._bytes.get((min(a, b), max(a, b)), 0.0)
        return self._costs.latency + nbytes / self._costs.bandwidth


class _Replay:
    """The timing of one simulation: every rank's clock, busy time and compute spans, the
    messages in flight, and where each rank stopped. ``run`` advances each rank as far as it
    can, and wakes the ranks that a message frees."""

    def __init__(self, schedule: Schedule, costs: Costs) -> None:
        n_stages, n_ranks, n_mb = schedule.n_stages, schedule.n_ranks, schedule.n_microbatches
        if len(schedule.stage_to_rank) != n_stages:
            raise ScheduleError(
                f"stage_to_rank has {len(schedule.stage_to_rank)} entries for {n_stages} stages"
            )
        self.schedule = schedule
        self._f_cost, self._b_cost, self._w_cost = _action_costs(schedule, costs)
        self._scale = costs.microbatch_scales(n_mb)
        self._f_delay, self._b_delay = _delays(schedule, costs)
        # The activations (f) or gradients (b) sent to stage s about micro-batch i arrive in
        # slot s * n_mb + i of their list; a rank waiting for one is noted by its slot.
        self._f_arrival: list[float | None] = [None] * (n_stages * n_mb)
        self._b_arrival: list[float | None] = [None] * (n_stages * n_mb)
        self._f_waiting: dict[int, int] = {}
        self._b_waiting: dict[int, int] = {}
        self._skips = _Skips(schedule, costs)
        self._ready: list[int] = []
        self._programs = [iter(program) for program in schedule.programs]
        self._blocked_at: list[Action | None] = [None] * n_ranks  # the receive a rank waits at
        self.clock = [0.0] * n_ranks
        self.busy = [0.0] * n_ranks
        self.times: list[list[float]] = [[] for _ in range(n_ranks)]
        self.waited = [0.0] * n_ranks  # on all-gathers of sharded parameters
        self._gather: list[float] | None = None
        self._whole = [False] * n_stages  # a stage's parameters gathered
        self._reshard = False

    def gather(self, seconds: list[float], reshard: bool) -> None:
        """Shard the parameters: each stage's compute action waits ``seconds[stage]`` for
        them unless they are whole; gathered, they stay so for the step, or (``reshard``)
        only for that action."""
        self._gather, self._reshard = seconds, reshard

    def run(self) -> None:
        """Run every program to its end; ranks left waiting on each other raise."""
        ready = self._ready = list(range(self.schedule.n_ranks - 1, -1, -1))
        while ready:
            self._resume(ready.pop())
        if any(self._blocked_at):
            blocked = ", ".join(
                f"rank {r} waits at {a}" for r, a in enumerate(self._blocked_at) if a
            )
            raise ScheduleError(f"{self.schedule.name} deadlocks: {blocked}")

    def _resume(self, rank: int) -> None:
        """Run ``rank`` on from where it stopped, until it waits for a message or ends. The
        loop runs once per action of the schedule, so it keeps what it reads in locals."""
        t, work, record = self.clock[rank], self.busy[rank], self.times[rank].append
        f_cost, b_cost, w_cost = self._f_cost, self._b_cost, self._w_cost
        f_delay, f_arrival, f_waiting = self._f_delay, self._f_arrival, self._f_waiting
        b_delay, b_arrival, b_waiting = self._b_delay, self._b_arrival, self._b_waiting
        n_mb, ready, skips = self.schedule.n_microbatches, self._ready, self._skips
        scale, gather, whole = self._scale, self._gather, self._whole
        pending, program = self._blocked_at[rank], self._programs[rank]
        for a in program if pending is None else itertools.chain((pending,), program):
            kind = a.kind
            if kind is _F or kind is _B or kind is _W or kind is _R:
                if gather is not None and not whole[a.stage]:
                    t += gather[a.stage]
                    self.waited[rank] += gather[a.stage]
                    whole[a.stage] = not self._reshard
                cost = (w_cost if kind is _W else b_cost if kind is _B else f_cost)[a.stage]
                if scale is not None:
                    cost *= scale[a.microbatch]
                record(t)
                t += cost
                work += cost
                record(t)
            elif kind is _SEND_F:  # sending takes no time
                slot = (a.stage + 1) * n_mb + a.microbatch
                f_arrival[slot] = t + f_delay[a.stage]
                if slot in f_waiting:
                    ready.append(f_waiting.pop(slot))
            elif kind is _RECV_F:
                slot = a.stage * n_mb + a.microbatch
                at = f_arrival[slot]
                if at is None:
                    f_waiting[slot] = rank
                    break
                if at > t:
                    t = at
            elif kind is _SEND_B:
                slot = (a.stage - 1) * n_mb + a.microbatch
                b_arrival[slot] = t + b_delay[a.stage]
                if slot in b_waiting:
                    ready.append(b_waiting.pop(slot))
            elif kind is _RECV_B:
                slot = a.stage * n_mb + a.microbatch
                at = b_arrival[slot]
                if at is None:
                    b_waiting[slot] = rank
                    break
                if at > t:
                    t = at
            elif kind in SEND_KINDS:  # a skip, or its gradient
                woken = skips.send(a, t)
                if woken is not None:
                    ready.append(woken)
            else:
                at = skips.arrival(a, rank)
                if at is None:
                    break
                if at > t:
                    t = at
        else:
            a = None
        self._blocked_at[rank] = a
        self.clock[rank], self.busy[rank] = t, work


def _allreduce(
    schedule: Schedule,
    replay: _Replay,
    costs: Costs,
    replicas: tuple[int, str | None],
    overlap: bool,
    bucket_bytes: float | None,
) -> list[float]:
    """Move each rank's clock past its stages' gradient all-reduces (``replicas``: D and
    the sharding; sharded, reduce-scatters, and then all-gathers of the updated parameters
    unless ``"full"``); returns what each rank waits for them after its program."""
    from gpipe.parallel.replicas import (
        bucket_size,  # here: the rest of the simulator needs no torch
    )

    d, shard = replicas
    times, clock = replay.times, replay.clock
    grad = costs.per_stage("grad_bytes", schedule.n_stages)
    bandwidth = costs.allreduce_bandwidth or costs.bandwidth
    passes = 2 if shard is None else 1
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
            seconds = ring_seconds(grad[stage] / n, d, bandwidth, costs.latency, passes)
            for i in range(1, n + 1):
                ready = start + i / n * (end - start) if overlap else end
                link = max(link, ready) + seconds
            link = max(link, end)
        if shard in ("optimizer", "gradients"):  # the updated parameters, after the step
            link += sum(ring_seconds(grad[s], d, bandwidth, costs.latency) for s in last)
        finish = max(clock[rank], link)
        exposed.append(finish - clock[rank])
        clock[rank] = finish
    return exposed


def _result(
    replay: _Replay, held: _Activations, checkpoint: str, exposed: list[float]
) -> SimResult:
    clock, busy = replay.clock, replay.busy
    makespan = max(clock, default=0.0)
    idle = tuple(makespan - b for b in busy)
    bubble = sum(idle) / (len(clock) * makespan) if makespan > 0 else 0.0
    return SimResult(
        schedule=replay.schedule,
        makespan=makespan,
        busy=tuple(busy),
        idle=idle,
        bubble=bubble,
        peak_live=tuple(held.peak_live),
        peak_activation_bytes=tuple(held.stage_peak),
        peak_rank_activation_bytes=tuple(held.rank_peak),
        compute_times=tuple(map(tuple, replay.times)),
        checkpoint=checkpoint,
        allreduce_exposed=tuple(exposed),
        gather_exposed=tuple(replay.waited),
    )
