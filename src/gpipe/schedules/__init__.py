"""Schedules as data: per-rank ordered lists of actions, their generators and a validator.

A schedule says, for every rank, in which order it runs forward and backward passes of
micro-batches through its stages and when it sends or receives the tensors at stage
boundaries. The executor, the validator and (later) the simulator and the timelines all read
this one representation, so what is checked is exactly what runs.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "FORWARD_KINDS",
    "RECV_KINDS",
    "RECV_OF",
    "SEND_KINDS",
    "SEND_OF",
    "Action",
    "Kind",
    "add_recompute",
    "Schedule",
    "ScheduleError",
    "add_skips",
    "clock_cycles",
    "execution_order",
    "forward_only",
    "gpipe",
    "one_f_one_b",
    "zero_bubble_h1",
    "interleaved",
    "SCHEDULES",
    "get_schedule",
    "validate",
]


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing or duplicated action, a dependency cycle."""


class Kind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the whole backward, or only the input gradients when W is split off
    WEIGHT = "W"  # the weight gradients of a split backward
    RECOMPUTE = "R"  # a re-materialized micro-batch's forward again, ahead of its gradient
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    # skip connections: tensors sent straight to a later stage, their gradients back
    SEND_SKIP = "SEND_SKIP"
    RECV_SKIP = "RECV_SKIP"
    SEND_SKIP_B = "SEND_SKIP_B"
    RECV_SKIP_B = "RECV_SKIP_B"


_COMPUTE = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT, Kind.RECOMPUTE)
SEND_KINDS = (Kind.SEND_F, Kind.SEND_B, Kind.SEND_SKIP, Kind.SEND_SKIP_B)
RECV_KINDS = (Kind.RECV_F, Kind.RECV_B, Kind.RECV_SKIP, Kind.RECV_SKIP_B)
RECV_OF = dict(zip(SEND_KINDS, RECV_KINDS, strict=True))  # the receive that matches a send
SEND_OF = dict(zip(RECV_KINDS, SEND_KINDS, strict=True))
_NEIGHBOUR = {Kind.SEND_F: 1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: 1}
FORWARD_KINDS = frozenset({Kind.FORWARD, Kind.SEND_F, Kind.RECV_F, Kind.SEND_SKIP, Kind.RECV_SKIP})


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage on one micro-batch; printed compactly, e.g. ``1F0`` or ``0RECV_B3``.

    A skip action also names the stage at the other end: ``0SEND_SKIP3@2`` is stage 0 sending
    micro-batch 3's skip tensors to stage 2.
    """

    stage: int
    kind: Kind
    microbatch: int
    peer: int | None = None  # the other stage of a skip action; neighbours are implied

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        return text if self.peer is None else f"{text}@{self.peer}"

    @property
    def is_compute(self) -> bool:
        return self.kind in _COMPUTE

    @property
    def other_stage(self) -> int | None:
        """The stage a communication action sends to or receives from; None for compute."""
        if self.peer is not None:
            return self.peer
        step = _NEIGHBOUR.get(self.kind)
        return None if step is None else self.stage + step


@dataclass(frozen=True)
class Schedule:
    """What every rank runs, in order.

    ``programs[r]`` is the ordered list of actions of rank ``r``; ``stage_to_rank[s]`` says
    which rank holds stage ``s``. ``backward`` is False for forward-only (inference) schedules.
    With ``split_backward`` every backward is two actions: ``B`` computes the gradients of the
    stage's inputs (what the previous stage waits for) and ``W`` those of its weights.
    ``skips`` lists the (source, destination) stage pairs that exchange skip tensors
    (``add_skips``); ``recomputed`` the micro-batches whose forward every stage runs again,
    as an ``R`` action, before their backward (``add_recompute``).
    """

    name: str
    n_stages: int
    n_microbatches: int
    programs: tuple[tuple[Action, ...], ...]
    stage_to_rank: tuple[int, ...]
    backward: bool = True
    split_backward: bool = False
    skips: tuple[tuple[int, int], ...] = ()
    recomputed: frozenset[int] = frozenset()

    @property
    def n_ranks(self) -> int:
        return len(self.programs)

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.n_stages} stages, {self.n_microbatches} micro-batches"]
        for rank, program in enumerate(self.programs):
            lines.append(f"  rank {rank}: " + " ".join(str(a) for a in program))
        return "\n".join(lines)

    def compute_only(self, rank: int) -> list[Action]:
        """The forward/backward actions of a rank without the communication, in order."""
        return [a for a in self.programs[rank] if a.is_compute]


def clock_cycles(n_microbatches: int, n_stages: int) -> list[list[tuple[int, int]]]:
    """GPipe's forward clock cycles: at cycle k, stage j works on micro-batch k - j.

    Returns one list per cycle of ``(microbatch, stage)`` pairs that run at the same time.
    """
    if n_microbatches < 1 or n_stages < 1:
        raise ValueError(
            f"clock_cycles needs n_microbatches >= 1 and n_stages >= 1, "
            f"got {n_microbatches} and {n_stages}"
        )
    return [
        [(k - j, j) for j in range(max(0, k - n_microbatches + 1), min(k + 1, n_stages))]
        for k in range(n_microbatches + n_stages - 1)
    ]


def _with_communication(
    stage: int, n_stages: int, compute: Sequence[tuple[Kind, int]]
) -> list[Action]:
    """Wrap each compute action of one stage with the receives before it and sends after it."""
    program: list[Action] = []
    first, last = stage == 0, stage == n_stages - 1
    for kind, mb in compute:
        if kind is Kind.FORWARD:
            if not first:
                program.append(Action(stage, Kind.RECV_F, mb))
            program.append(Action(stage, Kind.FORWARD, mb))
            if not last:
                program.append(Action(stage, Kind.SEND_F, mb))
        elif kind is Kind.BACKWARD:
            if not last:
                program.append(Action(stage, Kind.RECV_B, mb))
            program.append(Action(stage, Kind.BACKWARD, mb))
            if not first:
                program.append(Action(stage, Kind.SEND_B, mb))
        else:  # a weight gradient needs nothing from other stages
            program.append(Action(stage, kind, mb))
    return program


def _check_sizes(n_stages: int, n_microbatches: int) -> None:
    if not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages must be a positive integer, got {n_stages!r}")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")


@functools.lru_cache(maxsize=256)
def gpipe(n_stages: int, n_microbatches: int) -> Schedule:
    """GPipe fill-drain: every stage runs all forwards, then all backwards in reverse order."""
    _check_sizes(n_stages, n_microbatches)
    forwards = [(Kind.FORWARD, i) for i in range(n_microbatches)]
    backwards = [(Kind.BACKWARD, i) for i in reversed(range(n_microbatches))]
    programs = tuple(
        tuple(_with_communication(s, n_stages, forwards + backwards)) for s in range(n_stages)
    )
    return Schedule("gpipe", n_stages, n_microbatches, programs, tuple(range(n_stages)))


@functools.lru_cache(maxsize=256)
def forward_only(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """Inference: forwards only, in micro-batch order, nothing kept for a backward pass.

    With ``n_ranks`` < ``n_stages``, rank r holds stages r, r + K, ... as in ``interleaved``
    and runs them one after the other."""
    _check_sizes(n_stages, n_microbatches)
    k = n_stages if n_ranks is None else n_ranks
    if not isinstance(k, int) or k < 1 or n_stages % k:
        raise ValueError(f"n_stages ({n_stages}) must be a multiple of n_ranks, got {k!r}")
    forwards = [(Kind.FORWARD, i) for i in range(n_microbatches)]
    programs = tuple(
        tuple(
            action
            for stage in range(rank, n_stages, k)
            for action in _with_communication(stage, n_stages, forwards)
        )
        for rank in range(k)
    )
    return Schedule(
        "forward-only",
        n_stages,
        n_microbatches,
        programs,
        tuple(s % k for s in range(n_stages)),
        backward=False,
    )


def _one_f_one_b_order(stage: int, n_stages: int, n_microbatches: int) -> list[tuple[Kind, int]]:
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards:
    stage s never holds more than K - s micro-batches between forward and backward."""
    warmup = min(n_stages - stage - 1, n_microbatches)
    order = [(Kind.FORWARD, i) for i in range(warmup)]
    for i in range(n_microbatches - warmup):
        order += [(Kind.FORWARD, warmup + i), (Kind.BACKWARD, i)]
    order += [(Kind.BACKWARD, i) for i in range(n_microbatches - warmup, n_microbatches)]
    return order


@functools.lru_cache(maxsize=256)
def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): GPipe's bubble with at most K - s live micro-batches on stage s
    instead of M."""
    _check_sizes(n_stages, n_microbatches)
    programs = tuple(
        tuple(_with_communication(s, n_stages, _one_f_one_b_order(s, n_stages, n_microbatches)))
        for s in range(n_stages)
    )
    return Schedule("1f1b", n_stages, n_microbatches, programs, tuple(range(n_stages)))


@functools.lru_cache(maxsize=256)
def zero_bubble_h1(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with each backward split into B (input gradients, on the critical path)
    and W (weight gradients, which nobody waits for).

    Stage s runs the W of micro-batch i only after the B of micro-batch i + s, so the
    backward wave travels at the speed of B alone and the deferred W fill the drain.
    Every stage then holds at most K micro-batches, the peak of 1F1B's first stage.
    """
    _check_sizes(n_stages, n_microbatches)
    programs = []
    for s in range(n_stages):
        order: list[tuple[Kind, int]] = []
        weights = 0  # W actions emitted so far, in micro-batch order
        for kind, i in _one_f_one_b_order(s, n_stages, n_microbatches):
            order.append((kind, i))
            if kind is Kind.BACKWARD and i - weights >= s:
                order.append((Kind.WEIGHT, weights))
                weights += 1
        order += [(Kind.WEIGHT, i) for i in range(weights, n_microbatches)]
        programs.append(tuple(_with_communication(s, n_stages, order)))
    return Schedule(
        "zero-bubble",
        n_stages,
        n_microbatches,
        tuple(programs),
        tuple(range(n_stages)),
        split_backward=True,
    )


def interleaved(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """Interleaved 1F1B: each of ``n_ranks`` ranks holds ``v = n_stages / n_ranks`` stages
    that are not neighbours (rank r holds stages r, r + K, r + 2K, ...), and the bubble
    shrinks by v. Micro-batches go in groups of K, so M must be a multiple of K."""
    k = n_stages if n_ranks is None else n_ranks
    return _interleaved(n_stages, n_microbatches, k)


@functools.lru_cache(maxsize=256)
def _interleaved(n_stages: int, n_microbatches: int, k: int) -> Schedule:
    _check_sizes(n_stages, n_microbatches)
    if not isinstance(k, int) or k < 1 or n_stages % k:
        raise ValueError(
            f"interleaved needs a number of stages that is a multiple of the number of "
            f"ranks, got {n_stages} stages for {k} ranks"
        )
    if n_microbatches % k:
        raise ValueError(
            f"interleaved needs a number of micro-batches that is a multiple of the number "
            f"of ranks ({k}), got {n_microbatches}"
        )
    v, m = n_stages // k, n_microbatches
    total = m * v  # forward (and backward) actions per rank

    def forward_of(rank: int, j: int) -> tuple[int, int]:
        """The j-th forward of ``rank``: (stage, micro-batch), K micro-batches per chunk."""
        chunk = (j // k) % v
        return chunk * k + rank, (j // (k * v)) * k + j % k

    def backward_of(rank: int, j: int) -> tuple[int, int]:
        chunk = v - 1 - (j // k) % v
        return chunk * k + rank, (j // (k * v)) * k + j % k

    programs = []
    for rank in range(k):
        warmup = min((k - rank - 1) * 2 + (v - 1) * k, total)
        order: list[tuple[Kind, int, int]] = []
        order += [(Kind.FORWARD, *forward_of(rank, j)) for j in range(warmup)]
        for i in range(total - warmup):
            order.append((Kind.FORWARD, *forward_of(rank, warmup + i)))
            order.append((Kind.BACKWARD, *backward_of(rank, i)))
        order += [(Kind.BACKWARD, *backward_of(rank, j)) for j in range(total - warmup, total)]
        program: list[Action] = []
        for kind, stage, mb in order:
            program += _with_communication(stage, n_stages, [(kind, mb)])
        programs.append(tuple(program))
    return Schedule(
        "interleaved",
        n_stages,
        n_microbatches,
        tuple(programs),
        tuple(s % k for s in range(n_stages)),
    )


@functools.lru_cache(maxsize=256)
def add_skips(schedule: Schedule, routes: tuple[tuple[int, int], ...]) -> Schedule:
    """``schedule`` with skip connections: for every (source, destination) stage pair in
    ``routes``, the source sends its skip tensors right after each forward and receives their
    gradients right before each backward; the destination receives them right before its
    forward and sends the gradients right after its backward.

    A skip travels straight between the two stages, never through the ones in between.
    """
    routes = tuple(sorted(set(routes)))
    if not routes:
        return schedule
    for src, dst in routes:
        if not 0 <= src < dst < schedule.n_stages:
            raise ScheduleError(
                f"a skip route goes from an earlier to a later stage of {schedule.n_stages}, "
                f"got {src} -> {dst}"
            )
    sources: dict[int, list[int]] = {}
    dests: dict[int, list[int]] = {}
    for src, dst in routes:
        dests.setdefault(src, []).append(dst)
        sources.setdefault(dst, []).append(src)
    programs = []
    for program in schedule.programs:
        out: list[Action] = []
        after: list[Action] = []  # skip sends that follow the compute action's own send
        for a in program:
            s, i = a.stage, a.microbatch
            if after and not (a.kind in (Kind.SEND_F, Kind.SEND_B) and a.stage == after[0].stage):
                out += after
                after = []
            if a.kind is Kind.FORWARD:
                out += [Action(s, Kind.RECV_SKIP, i, src) for src in sources.get(s, [])]
                after = [Action(s, Kind.SEND_SKIP, i, dst) for dst in dests.get(s, [])]
            elif a.kind is Kind.BACKWARD:
                out += [Action(s, Kind.RECV_SKIP_B, i, dst) for dst in dests.get(s, [])]
                after = [Action(s, Kind.SEND_SKIP_B, i, src) for src in sources.get(s, [])]
            out.append(a)
        out += after
        programs.append(tuple(out))
    return dataclasses.replace(schedule, programs=tuple(programs), skips=routes)


@functools.lru_cache(maxsize=256)
def add_recompute(schedule: Schedule, recomputed: frozenset[int]) -> Schedule:
    """``schedule`` with re-materialization ahead of the gradient: for every micro-batch in
    ``recomputed``, each stage runs its forward again (``R``) right before it receives the
    micro-batch's gradients, rather than inside the backward, so that the recomputation,
    which needs no gradient, runs while the gradient is on its way."""
    recomputed = frozenset(recomputed)
    if not recomputed or not schedule.backward:
        return schedule
    if not all(0 <= i < schedule.n_microbatches for i in recomputed):
        raise ScheduleError(
            f"recomputed micro-batches must be in [0, {schedule.n_microbatches}), "
            f"got {sorted(recomputed)}"
        )
    programs = []
    for program in schedule.programs:
        out: list[Action] = []
        for a in program:
            if a.kind is Kind.BACKWARD and a.microbatch in recomputed:
                # before the receives of this very backward, which come right before it
                at = len(out)
                while (
                    at
                    and out[at - 1].kind in (Kind.RECV_B, Kind.RECV_SKIP_B)
                    and (
                        out[at - 1].stage,
                        out[at - 1].microbatch,
                    )
                    == (a.stage, a.microbatch)
                ):
                    at -= 1
                out.insert(at, Action(a.stage, Kind.RECOMPUTE, a.microbatch))
            out.append(a)
        programs.append(tuple(out))
    return dataclasses.replace(
        schedule, programs=tuple(programs), recomputed=schedule.recomputed | recomputed
    )


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zero-bubble": zero_bubble_h1,
    "interleaved": interleaved,
}


def get_schedule(name: str) -> Callable[[int, int], Schedule]:
    """The generator registered under ``name``; a clear error lists the known names."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}") from None


# --------------------------------------------------------------------------------------------
# Validation


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
    expected = set()
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
        kinds = [(src, Kind.SEND_SKIP, dst), (dst, Kind.RECV_SKIP, src)]
        if schedule.backward:
            kinds += [(dst, Kind.SEND_SKIP_B, src), (src, Kind.RECV_SKIP_B, dst)]
        expected.update(
            Action(stage, kind, i, peer)
            for stage, kind, peer in kinds
            for i in range(schedule.n_microbatches)
        )
    return expected


def _check_fifo(schedule: Schedule) -> None:
    """Point-to-point transports deliver in order: sends and receives must agree on it."""
    sent: dict[tuple[int, int, Kind], list[int]] = {}
    received: dict[tuple[int, int, Kind], list[int]] = {}
    for program in schedule.programs:
        for a in program:
            other = a.other_stage
            if a.kind in RECV_OF:
                assert other is not None
                sent.setdefault((a.stage, other, RECV_OF[a.kind]), []).append(a.microbatch)
            elif a.kind in RECV_KINDS:
                assert other is not None
                received.setdefault((other, a.stage, a.kind), []).append(a.microbatch)
    for key, order in received.items():
        if sent.get(key) != order:
            src, dst, kind = key
            raise ScheduleError(
                f"stage {dst} receives {kind.value} from stage {src} in micro-batch order "
                f"{order}, but they are sent in order {sent.get(key)}"
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
    seen: set[Action] = set()
    for rank, program in enumerate(schedule.programs):
        for a in program:
            if (
                not (0 <= a.stage < schedule.n_stages)
                or not (0 <= a.microbatch < schedule.n_microbatches)
                or not (a.other_stage is None or 0 <= a.other_stage < schedule.n_stages)
            ):
                raise ScheduleError(f"rank {rank}: action {a} is out of range")
            if rank_of[a.stage] != rank:
                raise ScheduleError(
                    f"rank {rank}: action {a} belongs to stage {a.stage}, held by rank "
                    f"{rank_of[a.stage]}"
                )
            if a in seen:
                raise ScheduleError(f"rank {rank}: action {a} appears twice")
            seen.add(a)
    expected = _expected_actions(schedule)
    missing = sorted(expected - seen, key=lambda a: (a.stage, a.microbatch, a.kind.value))
    if missing:
        raise ScheduleError(f"schedule lacks actions: {' '.join(map(str, missing[:8]))}")
    extra = sorted(seen - expected, key=lambda a: (a.stage, a.microbatch, a.kind.value))
    if extra:
        raise ScheduleError(f"schedule has unexpected actions: {' '.join(map(str, extra[:8]))}")
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
                f"rank {r} waits at {q[0]} (needs "
                + " ".join(str(n) for n in _requirements(q[0], schedule) if n not in done)
                + ")"
                for r, q in enumerate(queues)
                if q
            )
            raise ScheduleError(f"schedule deadlocks: {blocked}")
    return order


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` is complete, ordered consistently and free of deadlock."""
    execution_order(schedule)
    return schedule
