"""What the first stage sends round the pipeline next: the plan of every group in flight.

Each group (a *lane*) circulates on its own: the first stage sends it, the last stage sends
back the tokens it picked, and the first stage then sends the lane's next task. A task is one
decoding step of the lane's rows, plus pieces of prompts being prefilled (each prompt alone,
its own cache, in chunks of at most ``prefill_chunk`` tokens a task, so that a long prompt
does not stall the rows decoding beside it). A prompt whose prefill is done joins its lane's
rows with its first token; a sequence that ends (``eos_token_id``, or ``max_new_tokens``)
leaves them, and its place goes to a waiting prompt (continuous batching).

Pure bookkeeping, no tensors: the stages apply each task's leaves and joins to their caches in
the order the tasks arrive, so every stage holds the same rows as this plan.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Piece", "Scheduler", "Task"]


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, start + len(ids))`` of prompt ``sequence``, prefilled in its own cache;
    ``last``: the prompt's end, whose logits give the sequence's first token."""

    sequence: int
    start: int
    ids: tuple[int, ...]
    last: bool


@dataclass(frozen=True)
class Task:
    """One trip of lane ``lane`` round the pipeline: ``leaves`` drop out of its rows (or
    their prefill caches are dropped), ``joins`` (prefilled) join them, then ``rows`` decode
    one token each from ``inputs``, and ``pieces`` are prefilled."""

    lane: int
    leaves: tuple[int, ...] = ()
    joins: tuple[int, ...] = ()
    rows: tuple[int, ...] = ()
    inputs: tuple[int, ...] = ()
    pieces: tuple[Piece, ...] = ()


@dataclass
class _Lane:
    rows: list[int] = field(default_factory=list)
    leaving: list[int] = field(default_factory=list)
    joining: list[int] = field(default_factory=list)
    filling: list[int] = field(default_factory=list)  # prompts prefilled in this lane


class Scheduler:
    """The plan of ``lanes`` lanes (no more than there are prompts) of at most
    ``rows_per_lane`` sequences each, over ``prompts`` (token ids) that each get up to
    ``max_new_tokens`` new tokens.

    ``first_token`` holds, per sequence, when its first token came back (``time.perf_counter``);
    ``on_tokens(n)`` hears of every ``n`` tokens that come back."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        lanes: int,
        rows_per_lane: int | None = None,
        prefill_chunk: int | None = None,
        eos_token_id: int | None = None,
        on_tokens: Callable[[int], None] | None = None,
    ) -> None:
        self.prompts = [tuple(p) for p in prompts]
        self.max_new_tokens = max_new_tokens
        self.eos_token_id = eos_token_id
        self.prefill_chunk = prefill_chunk
        n = len(self.prompts)
        # a lane beyond one per prompt would never hold a sequence: none is kept for it
        lanes = max(1, min(lanes, n))
        self.rows_per_lane = rows_per_lane or max(1, math.ceil(n / lanes))
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.first_token: list[float | None] = [None] * n
        self.on_tokens = on_tokens
        self._waiting = deque(range(n))
        self._sent = [0] * n  # prompt tokens sent to be prefilled
        self._lanes = [_Lane() for _ in range(lanes)]
        self._finished = 0

    @property
    def lanes(self) -> int:
        return len(self._lanes)

    @property
    def done(self) -> bool:
        """Every sequence has ended."""
        return self._finished == len(self.prompts)

    def task(self, lane: int) -> Task | None:
        """Lane ``lane``'s next trip; None when it has nothing left to do (it stays idle:
        no prompt waits any more)."""
        plan = self._lanes[lane]
        leaves, plan.leaving = tuple(plan.leaving), []
        joins, plan.joining = tuple(plan.joining), []
        plan.rows = [r for r in plan.rows if r not in leaves] + list(joins)
        pieces = self._pieces(plan)
        if not (leaves or plan.rows or pieces):
            return None
        rows = tuple(plan.rows)
        inputs = tuple(self._last_token(r) for r in rows)
        return Task(lane, leaves, joins, rows, inputs, pieces)

    def _last_token(self, sequence: int) -> int:
        return self.tokens[sequence][-1]

    def _pieces(self, plan: _Lane) -> tuple[Piece, ...]:
        """The prefill of this trip: the lane's unfinished prompts first, then waiting ones
        while the lane has room, ``prefill_chunk`` tokens in all (None: whole prompts)."""
        budget = self.prefill_chunk if self.prefill_chunk is not None else math.inf
        pieces: list[Piece] = []

        def take(sequence: int) -> None:
            nonlocal budget
            prompt, start = self.prompts[sequence], self._sent[sequence]
            n = int(min(len(prompt) - start, budget))
            pieces.append(
                Piece(sequence, start, prompt[start : start + n], start + n == len(prompt))
            )
            self._sent[sequence] += n
            budget -= n

        for sequence in plan.filling:
            if budget > 0 and self._sent[sequence] < len(self.prompts[sequence]):
                take(sequence)
        while (
            budget > 0 and self._waiting and len(plan.rows) + len(plan.filling) < self.rows_per_lane
        ):
            sequence = self._waiting.popleft()
            plan.filling.append(sequence)
            take(sequence)
        return tuple(pieces)

    def take(self, lane: int, sequences: Sequence[int], tokens: Sequence[int]) -> None:
        """The tokens the last stage picked on lane ``lane``'s trip: one for each row that
        decoded, and the first of each prompt whose prefill ended."""
        plan = self._lanes[lane]
        now = time.perf_counter()
        for sequence, token in zip(sequences, tokens, strict=True):
            got = self.tokens[sequence]
            got.append(int(token))
            if len(got) == 1:
                self.first_token[sequence] = now
            ended = len(got) >= self.max_new_tokens or token == self.eos_token_id
            if sequence in plan.filling:
                plan.filling.remove(sequence)
                (plan.leaving if ended else plan.joining).append(sequence)
            elif ended:
                plan.leaving.append(sequence)
            self._finished += ended
        if self.on_tokens is not None and len(tokens):
            self.on_tokens(len(tokens))
