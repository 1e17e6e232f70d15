"""The schedule IR: actions, the kinds of action, and a schedule (per-rank programs).

A schedule says, for every rank, in which order it runs forward and backward passes of
micro-batches through its stages and when it sends or receives the tensors at stage
boundaries. The executor, the validator, the simulator and the timelines all read this one
representation, so what is checked is exactly what runs.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing or duplicated action, a dependency cycle.

    ``blocked``, for a deadlock: each stuck rank's next action and what it waits for."""

    def __init__(
        self, message: str, blocked: dict[int, tuple[Action, list[Action]]] | None = None
    ) -> None:
        super().__init__(message)
        self.blocked = blocked or {}


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


class Action(NamedTuple):
    """One step of one stage on one micro-batch; printed compactly, e.g. ``1F0`` or ``0RECV_B3``.

    A skip action also names the stage at the other end: ``0SEND_SKIP3@2`` is stage 0 sending
    micro-batch 3's skip tensors to stage 2. A named tuple: schedules hold millions of them,
    made, hashed and compared in the executor's and the simulator's loops.
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
    as an ``R`` action, before their backward (``add_recompute``). With ``seq_chunks`` S > 1
    each micro-batch runs as S units along its sequence (``seq_chunked``): ``n_microbatches``
    counts the units, and an action's micro-batch ``i * S + j`` is sub-sequence j of i.
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
    seq_chunks: int = 1

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


def with_communication(
    stage: int, n_stages: int, compute: Sequence[tuple[Kind, int]]
) -> list[Action]:
    """Wrap each compute action of one stage with the receives before it and sends after it."""
    return _with_messages([(kind, stage, mb) for kind, mb in compute], n_stages)


def programs_of(
    orders: Sequence[Sequence[tuple[Kind, int, int]]], n_stages: int
) -> tuple[tuple[Action, ...], ...]:
    """Each rank's program from its order of (kind, stage, micro-batch) compute actions, with
    the receives and sends around each."""
    return tuple(tuple(_with_messages(order, n_stages)) for order in orders)


def _with_messages(order: Sequence[tuple[Kind, int, int]], n_stages: int) -> list[Action]:
    """``order``'s compute actions, each with the receive before it and the send after it
    that its stage's neighbours exchange (one loop: schedules run to millions of actions)."""
    program: list[Action] = []
    add = program.append
    last = n_stages - 1
    forward, backward = Kind.FORWARD, Kind.BACKWARD
    for kind, stage, mb in order:
        if kind is forward:
            if stage:
                add(Action(stage, Kind.RECV_F, mb))
            add(Action(stage, kind, mb))
            if stage != last:
                add(Action(stage, Kind.SEND_F, mb))
        elif kind is backward:
            if stage != last:
                add(Action(stage, Kind.RECV_B, mb))
            add(Action(stage, kind, mb))
            if stage:
                add(Action(stage, Kind.SEND_B, mb))
        else:  # a weight gradient needs nothing from other stages
            add(Action(stage, kind, mb))
    return program


def rank_count(n_stages: int, n_ranks: int | None, name: str) -> int:
    """The number of ranks of a schedule that holds the same number of stages on each."""
    k = n_stages if n_ranks is None else n_ranks
    if not isinstance(k, int) or k < 1 or n_stages % k:
        raise ValueError(
            f"{name} needs a number of stages that is a multiple of the number of ranks, "
            f"got {n_stages} stages for {k!r} ranks"
        )
    return k


def check_sizes(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> None:
    """Positive sizes; ``n_ranks``, where given to a one-stage-per-rank generator, equal to
    ``n_stages``."""
    if not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages must be a positive integer, got {n_stages!r}")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")
    if n_ranks is not None and n_ranks != n_stages:
        raise ValueError(
            f"this schedule holds one stage per rank: n_ranks must equal n_stages "
            f"({n_stages}), got {n_ranks}"
        )
