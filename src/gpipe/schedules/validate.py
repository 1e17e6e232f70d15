"""The validator: every action there once, in an order that cannot deadlock.

Its errors name where a program goes wrong: the rank, the step (the action's position in that
rank's program, from 0) and the action.
"""

from __future__ import annotations

from collections import deque

from gpipe.schedules.ir import RECV_KINDS, RECV_OF, SEND_OF, Action, Kind, Schedule, ScheduleError


def _requirements(action: Action, schedule: Schedule) -> list[Action]:
    """The actions that must have run before ``action`` can run."""
    s, i = action.stage, action.microbatch
    kind = action.kind
    if kind in RECV_KINDS:
        other = action.other_stage
        assert other is not None
        peer = None if action.peer is None else s
        return [Action(other, SEND_OF[kind], i, peer)]
    if kind is Kind.FORWARD:
        need = [Action(s, Kind.RECV_F, i)] if s > 0 else []
        need += [Action(s, Kind.RECV_SKIP, i, src) for src, dst in schedule.skips if dst == s]
        return need
    if kind is Kind.RECOMPUTE:
        return [Action(s, Kind.FORWARD, i)]
    if kind is Kind.BACKWARD:
        need = [Action(s, Kind.FORWARD, i)]
        if i in schedule.recomputed:
            need.append(Action(s, Kind.RECOMPUTE, i))
        if s < schedule.n_stages - 1:
            need.append(Action(s, Kind.RECV_B, i))
        need += [Action(s, Kind.RECV_SKIP_B, i, dst) for src, dst in schedule.skips if src == s]
        return need
    if kind in (Kind.SEND_F, Kind.SEND_SKIP):
        return [Action(s, Kind.FORWARD, i)]
    return [Action(s, Kind.BACKWARD, i)]  # SEND_B, SEND_SKIP_B and WEIGHT


def _expected_actions(schedule: Schedule) -> set[Action]:
    expected: set[Action] = set()
    for s in range(schedule.n_stages):
        kinds = [Kind.FORWARD]
        if s > 0:
            kinds.append(Kind.RECV_F)
        if s < schedule.n_stages - 1:
            kinds.append(Kind.SEND_F)
        if schedule.backward:
            kinds.append(Kind.BACKWARD)
            if s > 0:
                kinds.append(Kind.SEND_B)
            if s < schedule.n_stages - 1:
                kinds.append(Kind.RECV_B)
            if schedule.split_backward:
                kinds.append(Kind.WEIGHT)
        expected.update(Action(s, k, i) for k in kinds for i in range(schedule.n_microbatches))
        if schedule.backward:
            expected.update(Action(s, Kind.RECOMPUTE, i) for i in schedule.recomputed)
    for src, dst in schedule.skips:
        ends = [(src, Kind.SEND_SKIP, dst), (dst, Kind.RECV_SKIP, src)]
        if schedule.backward:
            ends += [(dst, Kind.SEND_SKIP_B, src), (src, Kind.RECV_SKIP_B, dst)]
        expected.update(
            Action(stage, kind, i, peer)
            for stage, kind, peer in ends
            for i in range(schedule.n_microbatches)
        )
    return expected


def _check_fifo(schedule: Schedule) -> None:
    """Point-to-point transports deliver in order: sends and receives must agree on it."""
    sent: dict[tuple[int, int, Kind], list[int]] = {}
    received: dict[tuple[int, int, Kind], list[tuple[int, int, Action]]] = {}
    for rank, program in enumerate(schedule.programs):
        for step, a in enumerate(program):
            other = a.other_stage
            if a.kind in RECV_OF:
                assert other is not None
                sent.setdefault((a.stage, other, RECV_OF[a.kind]), []).append(a.microbatch)
            elif a.kind in RECV_KINDS:
                assert other is not None
                received.setdefault((other, a.stage, a.kind), []).append((rank, step, a))
    for key, receives in received.items():
        order = [a.microbatch for _, _, a in receives]
        sent_order = sent.get(key, [])
        if sent_order != order:
            src, dst, kind = key
            first = next(
                (i for i, mb in enumerate(order) if i >= len(sent_order) or sent_order[i] != mb),
                len(order) - 1,
            )
            rank, step, action = receives[first]
            raise ScheduleError(
                f"rank {rank}, step {step}: {action}: stage {dst} receives {kind.value} from "
                f"stage {src} in micro-batch order {order}, but they are sent in order "
                f"{sent.get(key)}"
            )


def execution_order(schedule: Schedule) -> list[Action]:
    """A global order in which all ranks' programs can run; raises ScheduleError if none.

    Every rank runs its program in order; sends never block; a receive, a forward or a
    backward waits for what it needs. If no rank can move and some have actions left, the
    schedule deadlocks.
    """
    rank_of = schedule.stage_to_rank
    if len(rank_of) != schedule.n_stages:
        raise ScheduleError(
            f"stage_to_rank has {len(rank_of)} entries for {schedule.n_stages} stages"
        )
    seen: dict[Action, tuple[int, int]] = {}  # each action's rank and step
    for rank, program in enumerate(schedule.programs):
        for step, a in enumerate(program):
            where = f"rank {rank}, step {step}: action {a}"
            if (
                not (0 <= a.stage < schedule.n_stages)
                or not (0 <= a.microbatch < schedule.n_microbatches)
                or not (a.other_stage is None or 0 <= a.other_stage < schedule.n_stages)
            ):
                raise ScheduleError(f"{where} is out of range")
            if rank_of[a.stage] != rank:
                raise ScheduleError(
                    f"{where} belongs to stage {a.stage}, held by rank {rank_of[a.stage]}"
                )
            if a in seen:
                first_rank, first_step = seen[a]
                raise ScheduleError(
                    f"{where} appears twice (first at rank {first_rank}, step {first_step})"
                )
            seen[a] = (rank, step)
    expected = _expected_actions(schedule)
    missing = sorted(expected - seen.keys(), key=lambda a: (a.stage, a.microbatch, a.kind.value))
    if missing:
        raise ScheduleError(f"schedule lacks actions: {' '.join(map(str, missing[:8]))}")
    extra = sorted(seen.keys() - expected, key=lambda a: seen[a])
    if extra:
        listed = ", ".join(f"rank {seen[a][0]}, step {seen[a][1]}: {a}" for a in extra[:8])
        raise ScheduleError(f"schedule has unexpected actions: {listed}")
    _check_fifo(schedule)

    queues = [deque(p) for p in schedule.programs]
    done: set[Action] = set()
    order: list[Action] = []
    while any(queues):
        progressed = False
        for queue in queues:
            while queue and all(need in done for need in _requirements(queue[0], schedule)):
                action = queue.popleft()
                done.add(action)
                order.append(action)
                progressed = True
        if not progressed:
            blocked = ", ".join(
                f"rank {r}, step {len(schedule.programs[r]) - len(q)} waits at {q[0]} (needs "
                + " ".join(str(n) for n in _requirements(q[0], schedule) if n not in done)
                + ")"
                for r, q in enumerate(queues)
                if q
            )
            waits = {
                r: (q[0], [n for n in _requirements(q[0], schedule) if n not in done])
                for r, q in enumerate(queues)
                if q
            }
            raise ScheduleError(f"schedule deadlocks: {blocked}", waits)
    return order


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` is complete, ordered consistently and free of deadlock; return
    it. A ScheduleError names the rank, the step and the action where it is not."""
    execution_order(schedule)
    return schedule
