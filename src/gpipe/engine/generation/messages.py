"""What travels while generating: a task down the pipeline, the picked tokens back up.

Both are flat tuples of tensors, so the transport sends them without describing a
structure: a task is its plan as one int64 tensor, then the decoding rows' input (token ids
on the way out of the first stage, hidden states after), then each prefill piece's; the
tokens back are the lane, the sequences and their tokens.

Each message carries the number of the ``generate`` call it belongs to: a call that failed
on one rank can leave messages in the channels (a task no stage took, tokens the first
stage never read), and the next call drops them rather than taking them for its own.

A stage that fails sends an abort round the ring in place of its next message (down the
pipeline, and from the last stage back to the first), so that every other stage raises at
once, naming it, rather than after the timeout: a rank that goes on to its next ``step``
finds its peers there, not still waiting for the failed call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from gpipe.engine.generation.scheduler import Piece, Task

__all__ = [
    "ABORT",
    "STOP",
    "Abort",
    "Relay",
    "abort_of",
    "abort_tensors",
    "plan_of",
    "relay_of",
    "relay_tensors",
    "task_tensor",
]

STOP = -1  # the lane of the message that ends the generation
ABORT = -2  # the lane of the message that says a stage failed
_PIECE = 3  # words per piece: sequence, start, last


def task_tensor(task: Task, run: int) -> Tensor:
    """``task``'s plan in ``generate`` call number ``run``, as int64 words, without its token
    ids (a piece's length is that of its tensor)."""
    words = [run, task.lane, len(task.leaves), len(task.joins), len(task.rows)]
    words += [len(task.pieces)]
    words += [*task.leaves, *task.joins, *task.rows]
    for piece in task.pieces:
        words += [piece.sequence, piece.start, int(piece.last)]
    return torch.tensor(words, dtype=torch.long)


def plan_of(words: Tensor) -> tuple[int, Task]:
    """The call number and the task of ``task_tensor``, its pieces without their ids."""
    run, *w = [int(v) for v in words.tolist()]
    if w[0] == STOP:
        return run, Task(STOP)
    lane, n_leaves, n_joins, n_rows, n_pieces = w[:5]
    at = 5
    leaves = tuple(w[at : at + n_leaves])
    at += n_leaves
    joins = tuple(w[at : at + n_joins])
    at += n_joins
    rows = tuple(w[at : at + n_rows])
    at += n_rows
    pieces = []
    for _ in range(n_pieces):
        sequence, start, last = w[at : at + _PIECE]
        pieces.append(Piece(sequence, start, (), bool(last)))
        at += _PIECE
    return run, Task(lane, leaves, joins, rows, (), tuple(pieces))


class Relay(NamedTuple):
    """The tokens picked for a lane's sequences in ``generate`` call number ``run``."""

    run: int
    lane: int
    sequences: list[int]
    tokens: list[int]


def relay_tensors(relay: Relay, device: Any) -> tuple[Tensor, ...]:
    def ints(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return ints([relay.run, relay.lane]), ints(relay.sequences), ints(relay.tokens)


def relay_of(message: Any) -> Relay:
    head, sequences, tokens = message
    run, lane = (int(v) for v in head.tolist())
    return Relay(run, lane, [int(s) for s in sequences.tolist()], [int(t) for t in tokens.tolist()])


class Abort(NamedTuple):
    """Stage ``stage`` failed in ``generate`` call number ``run`` with ``error`` (one line)."""

    run: int
    stage: int
    error: str


def abort_tensors(abort: Abort, device: Any) -> tuple[Tensor, Tensor]:
    """``abort`` as a message of either channel: its words, then its error as UTF-8 bytes."""
    words = torch.tensor([abort.run, ABORT, abort.stage], dtype=torch.long, device=device)
    said = abort.error.encode()
    text = torch.tensor(list(said), dtype=torch.uint8, device=device)
    return words, text


def abort_of(message: Any) -> Abort | None:
    """The abort ``message`` is (a task's or a relay's place), or None if it is no abort."""
    head = message[0]
    if head.numel() != 3 or int(head[1]) != ABORT:
        return None
    run, _, stage = (int(v) for v in head.tolist())
    said = bytes(message[1].cpu().tolist()).decode(errors="replace")
    return Abort(run, stage, said)
