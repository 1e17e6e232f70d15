"""Schedules as the CSV files ``torch.distributed.pipelining`` writes and reads.

One row per rank, one cell per action, each action written ``<stage><kind><micro-batch>``:
``F`` a forward, ``B`` a whole backward, ``I`` and ``W`` its input- and weight-gradient
halves, ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` the messages (in the files that list
them; gpipe places its own around the compute, and messages between two stages of one rank
are not written, as PyTorch leaves them out). ``UNSHARD``, ``RESHARD`` and ``REDUCE_GRAD``
belong to sharded replicas and are read and dropped; an ``OVERLAP_F_B`` cell, ``(a;b)``,
runs its actions in order. An empty cell is an idle slot.
"""

from __future__ import annotations

import csv
import re
from os import PathLike
from pathlib import Path

from gpipe.schedules.ir import Action, Kind, Schedule, ScheduleError, programs_of
from gpipe.schedules.validate import execution_order

__all__ = ["from_csv", "read_csv", "to_csv"]

_CELL = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_DROPPED = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
_MESSAGES = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
Step = tuple[int, str, int, int]  # (stage, kind as written, micro-batch, step in the row)


def _cells(text: str, rank: int, step: int, where: str) -> list[tuple[int, str, int | None]]:
    """The actions of one cell: (stage, kind, micro-batch or None)."""
    text = text.strip()
    if text in ("", "None"):
        return []
    if text.startswith("(") and text.endswith(")OVERLAP_F_B"):
        inner = text[1 : -len(")OVERLAP_F_B")]
        return [a for part in inner.split(";") for a in _cells(part, rank, step, where)]
    match = _CELL.fullmatch(text)
    if match is None:
        raise ScheduleError(
            f"{where}: rank {rank}, step {step}: {text!r} is not an action (expected "
            "<stage><F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B><micro-batch>, e.g. 2F0)"
        )
    stage, kind, mb = match.groups()
    return [(int(stage), kind, int(mb) if mb else None)]


def read_csv(path: str | PathLike[str]) -> list[list[Step]]:
    """Each rank's actions in a schedule file, as written, without the dropped kinds; blank
    lines at its end are no ranks, and a rank without actions is refused."""
    where = str(path)
    try:  # utf-8-sig: a spreadsheet's CSV begins with a byte-order mark, not part of a cell
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
    except OSError as exc:
        raise ValueError(f"cannot read the schedule file {where}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"cannot read the schedule file {where}: not UTF-8 text ({exc.reason})"
        ) from None
    ranks = [_row(row, rank, where) for rank, row in enumerate(rows)]
    while ranks and not ranks[-1]:  # blank lines at the end are no ranks
        ranks.pop()
    if not ranks:
        raise ScheduleError(f"{where}: the schedule file holds no actions")
    idle = next((rank for rank, row in enumerate(ranks) if not row), None)
    if idle is not None:
        raise ScheduleError(
            f"{where}: rank {idle} (row {idle + 1}) holds no actions: each row is one rank's "
            "program, and every rank runs a stage (a blank line between rows?)"
        )
    return ranks


def _row(row: list[str], rank: int, where: str) -> list[Step]:
    """One rank's actions, as written, without the dropped kinds."""
    steps: list[Step] = []
    for step, cell in enumerate(row):
        for stage, kind, mb in _cells(cell, rank, step, where):
            if kind in _DROPPED:
                continue
            if mb is None:
                raise ScheduleError(
                    f"{where}: rank {rank}, step {step}: {cell.strip()!r} names no micro-batch"
                )
            steps.append((stage, kind, mb, step))
    return steps


def _check_names(
    ranks: list[list[Step]], where: str, n_stages: int, n_microbatches: int
) -> dict[int, int]:
    """Every action's stage and micro-batch exist and each stage is on one rank; returns
    the rank of every stage."""
    holders: dict[int, int] = {}
    for rank, row in enumerate(ranks):
        for stage, kind, mb, step in row:
            at = f"{where}: rank {rank}, step {step}: {stage}{kind}{mb}"
            if stage >= n_stages:
                raise ScheduleError(
                    f"{at} names stage {stage}, but there are {n_stages} (0 to {n_stages - 1})"
                )
            if mb >= n_microbatches:
                raise ScheduleError(
                    f"{at} names micro-batch {mb}, but there are {n_microbatches} "
                    f"(0 to {n_microbatches - 1})"
                )
            holder = holders.setdefault(stage, rank)
            if holder != rank:
                raise ScheduleError(f"{at}: stage {stage} is run by rank {holder} too")
    if len(holders) < n_stages:  # without a list of every stage: the count may be absurd
        idle = next(s for s in range(n_stages) if s not in holders)
        raise ScheduleError(f"{where}: no rank runs stage {idle}")
    return holders


Placed = dict[tuple[Kind, int, int], tuple[int, int, str]]  # action -> (rank, step, cell)


def _orders(
    ranks: list[list[Step]], where: str, split: bool
) -> tuple[list[list[tuple[Kind, int, int]]], Placed]:
    """Each rank's compute order in gpipe's kinds, and the rank, step and cell as written of
    each action.

    ``B`` is a whole backward, except where a ``W`` of the same stage and micro-batch follows
    it in the row: PyTorch's older files wrote the input half so (``2B0,2W0``), and read that
    way it is ``I``."""
    orders: list[list[tuple[Kind, int, int]]] = []
    steps: Placed = {}
    held: dict[tuple[Kind, int, int], str] = {}  # what the cell of each action holds
    for rank, row in enumerate(ranks):
        last_w = {(stage, mb): i for i, (stage, kind, mb, _) in enumerate(row) if kind == "W"}
        order = []
        for i, (stage, written, mb, step) in enumerate(row):
            input_half = written == "B" and last_w.get((stage, mb), -1) > i
            cell = _meaning(stage, written, mb, split, input_half)
            if written == "B":
                kinds = [Kind.BACKWARD, Kind.WEIGHT] if split and not input_half else _KINDS["I"]
            else:
                kinds = _KINDS.get(written, [])  # messages: gpipe places its own
            for kind in kinds:
                key = (kind, stage, mb)
                if key in steps:
                    part = "backward" if kind is Kind.BACKWARD and not split else _PART[kind]
                    raise ScheduleError(
                        f"{where}: rank {rank}, step {step} holds {cell}, which runs the "
                        f"{part} of stage {stage}, micro-batch {mb} again: step "
                        f"{steps[key][1]} holds {held[key]}"
                    )
                steps[key] = (rank, step, f"{stage}{written}{mb}")
                held[key] = cell
                order.append(key)
        orders.append(order)
    return orders, steps


_KINDS = {"F": [Kind.FORWARD], "I": [Kind.BACKWARD], "W": [Kind.WEIGHT]}
_PART = {Kind.FORWARD: "forward", Kind.BACKWARD: "input gradients", Kind.WEIGHT: "weight gradients"}


def _meaning(stage: int, written: str, mb: int, split: bool, input_half: bool) -> str:
    """A cell as written, and what gpipe reads it as."""
    text = f"{stage}{written}{mb}"
    if written == "F":
        return f"{text} (a forward)"
    if written == "I":
        return f"{text} (input gradients)"
    if written == "W":
        return f"{text} (weight gradients)"
    if input_half:
        return f"{text} (input gradients, as {stage}W{mb} follows)"
    return f"{text} (a whole backward{': input and weight gradients' if split else ''})"


def from_csv(
    path: str | PathLike[str],
    n_microbatches: int | None = None,
    n_ranks: int | None = None,
    n_stages: int | None = None,
) -> Schedule:
    """The schedule a PyTorch schedule file describes, checked by gpipe's validator.

    Its sizes are read off the file (rows, the highest stage and micro-batch named); given
    here, an action beyond them, a missing action or an order that deadlocks is an error
    that names the rank, the step (the cell, counted from 0) and the action.
    """
    where = str(path)
    ranks = read_csv(path)
    k = len(ranks) if n_ranks is None else n_ranks
    if len(ranks) > k:
        raise ScheduleError(
            f"{where}: the file has a row for rank {len(ranks) - 1}, but the pipeline has "
            f"{k} processes (ranks 0 to {k - 1})"
        )
    if len(ranks) < k:  # a rank without a row would hold no stage
        raise ScheduleError(
            f"{where}: the file has rows for {len(ranks)} ranks, but the pipeline has {k} "
            f"processes: rank {len(ranks)} has no row"
        )
    stages = n_stages or 1 + max(s for row in ranks for s, *_ in row)
    m = n_microbatches or 1 + max(mb for row in ranks for _, _, mb, _ in row)
    holders = _check_names(ranks, where, stages, m)
    split = any(kind in ("I", "W") for row in ranks for _, kind, _, _ in row)
    orders, steps = _orders(ranks, where, split)
    for stage in range(stages):
        needed = [Kind.FORWARD, Kind.BACKWARD] + ([Kind.WEIGHT] if split else [])
        for mb in range(m):
            for kind in needed:
                if (kind, stage, mb) not in steps:
                    raise ScheduleError(
                        f"{where}: rank {holders[stage]} lacks {Action(stage, kind, mb)}"
                        + (" (I or B)" if kind is Kind.BACKWARD else "")
                    )
    schedule = Schedule(
        f"csv:{Path(path).name}",
        stages,
        m,
        programs_of([[(kind, s, mb) for kind, s, mb in order] for order in orders], stages),
        tuple(holders[s] for s in range(stages)),
        split_backward=split,
    )
    try:
        execution_order(schedule)
    except ScheduleError as exc:
        raise ScheduleError(f"{where}: {_with_steps(exc, steps)}") from None
    return schedule


def _with_steps(exc: ScheduleError, steps: Placed) -> str:
    """A deadlock's message in the file's terms: each blocked rank's step and cell, and the
    cells it waits for with their ranks and steps (not the messages gpipe placed between)."""
    if not exc.blocked:
        return str(exc)
    parts = []
    for rank, (waiting, needs) in sorted(exc.blocked.items()):
        _, step, cell = steps[_compute_of(waiting)]
        waited = []
        for need in needs:
            other_rank, other_step, other_cell = steps[_compute_of(need)]
            waited.append(f"{other_cell} (rank {other_rank}, step {other_step})")
        parts.append(f"rank {rank}, step {step}: {cell} waits for " + " and ".join(waited))
    return "the schedule deadlocks: " + "; ".join(parts)


_COMPUTE_OF = {
    Kind.RECV_F: Kind.FORWARD,
    Kind.SEND_F: Kind.FORWARD,
    Kind.RECV_B: Kind.BACKWARD,
    Kind.SEND_B: Kind.BACKWARD,
}


def _compute_of(action: Action) -> tuple[Kind, int, int]:
    """The compute action of a file that a message gpipe placed goes with: a send with the
    action that makes what it sends, a receive with the one that uses it."""
    return (_COMPUTE_OF.get(action.kind, action.kind), action.stage, action.microbatch)


def to_csv(schedule: Schedule, path: str | PathLike[str], messages: bool = False) -> None:
    """Write ``schedule`` as PyTorch writes its schedules: compute actions only, or with
    ``messages`` its sends and receives between ranks too (PyTorch's "compute_comms")."""
    if schedule.skips or schedule.recomputed:
        raise ValueError(
            "PyTorch's schedule files have no skip or recomputation actions: write the "
            "schedule before add_skips and add_recompute"
        )
    if schedule.seq_chunks > 1:  # read back, its sub-sequences would be micro-batches
        raise ValueError(
            f"PyTorch's schedule files have no sub-sequences: this schedule cuts each "
            f"micro-batch into seq_chunks={schedule.seq_chunks}; write one without seq_chunks"
        )
    rows = []
    rank_of = schedule.stage_to_rank
    for program in schedule.programs:
        row = []
        for a in program:
            if a.kind.value in _MESSAGES:
                other = a.other_stage
                if not messages or other is None or rank_of[other] == rank_of[a.stage]:
                    continue
                row.append(str(a))
            elif a.kind is Kind.BACKWARD:
                row.append(f"{a.stage}{'I' if schedule.split_backward else 'B'}{a.microbatch}")
            else:
                row.append(str(a))
        rows.append(row)
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
