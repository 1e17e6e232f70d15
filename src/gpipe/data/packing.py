"""Packing sequences of different lengths into rows and micro-batches of near-equal tokens.

In a pipeline every stage waits for the slowest micro-batch, so the micro-batches of a step
should carry about the same number of tokens. ``pack`` spreads the sequences over ``chunks``
micro-batches by a balanced bin packing (the longest first, each to the lightest micro-batch,
then moves and swaps between the heaviest and the lightest) and packs each micro-batch's
sequences into rows of at most ``max_tokens`` (best-fit decreasing). ``pack(...,
balanced=False)`` is the plain way, for comparison: sequences into rows first-fit in the order
given, rows cut into ``chunks`` runs of equal row counts.

Each micro-batch is an ``(inputs, targets)`` pair that ``Pipeline.step(microbatches=...)``
takes: ``inputs`` a dict of ``input_ids`` and ``position_ids`` (rows x T, T the micro-batch's
longest row; position ids restart at 0 with every document), ``cu_seqlens`` (int32, the
documents' boundaries in the micro-batch's tokens laid row after row, each row's padding a
segment of its own, as varlen attention kernels read them) and ``max_seqlen``; ``targets``
the next token of the same document, ``ignore_index`` where there is none (a document's last
token, padding), so no token predicts across documents.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gpipe.runtime.stage import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "Plan", "counts_of", "pack", "plan", "spread"]

Plan = list[list[list[int]]]  # micro-batch -> row -> the indices of its sequences, in order
_MAX_IMPROVEMENTS = 10_000  # moves and swaps tried after the greedy pass, at most


def _lengths(sequences: Sequence[Any], max_tokens: int, chunks: int) -> list[int]:
    """Each sequence's tokens, after the checks that one error each explains."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if len(sequences) == 0:
        raise ValueError("pack needs at least one sequence, got none")
    lengths = []
    for i, seq in enumerate(sequences):
        n = int(seq.numel()) if isinstance(seq, Tensor) else len(seq)
        if isinstance(seq, Tensor) and seq.dim() != 1:
            raise ValueError(f"sequences[{i}] must be 1-D token ids, got shape {tuple(seq.shape)}")
        if n == 0:
            raise ValueError(f"sequences[{i}] is empty")
        if n > max_tokens:
            raise ValueError(
                f"sequences[{i}] has {n} tokens, more than max_tokens={max_tokens}: cut it "
                "first or raise max_tokens"
            )
        lengths.append(n)
    return lengths


def _best_fit_rows(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Rows of at most ``max_tokens``: the longest sequence first, each into the row it
    fills most (best-fit decreasing); each row's sequences in the order given."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        fits = [r for r in range(len(rows)) if room[r] >= lengths[i]]
        if fits:
            r = min(fits, key=lambda r: room[r])
            rows[r].append(i)
            room[r] -= lengths[i]
        else:
            rows.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(row) for row in rows]


def _greedy(lengths: list[int], chunks: int) -> list[list[int]]:
    """The longest sequence first, each to the micro-batch with the fewest tokens so far."""
    heap = [(0, c) for c in range(chunks)]
    groups: list[list[int]] = [[] for _ in range(chunks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, c = heapq.heappop(heap)
        groups[c].append(i)
        heapq.heappush(heap, (tokens + lengths[i], c))
    return groups


def _improve(groups: list[list[int]], lengths: list[int]) -> None:
    """Move one sequence, or swap two, between the heaviest and the lightest micro-batch while
    that narrows the gap between them (in place; each change lowers the sum of squared loads,
    so it ends)."""
    for _ in range(_MAX_IMPROVEMENTS):
        loads = [sum(lengths[i] for i in g) for g in groups]
        hi = max(range(len(groups)), key=loads.__getitem__)
        lo = min(range(len(groups)), key=loads.__getitem__)
        gap = loads[hi] - loads[lo]
        best_gain, move, back = 0, -1, None  # the gap narrows by best_gain: move goes, back comes
        for a in groups[hi]:
            if len(groups[hi]) > 1 and 0 < lengths[a] < gap:
                gain = gap - abs(gap - 2 * lengths[a])
                if gain > best_gain:
                    best_gain, move, back = gain, a, None
            for b in groups[lo]:
                d = lengths[a] - lengths[b]
                if 0 < d < gap and gap - abs(gap - 2 * d) > best_gain:
                    best_gain, move, back = gap - abs(gap - 2 * d), a, b
        if not best_gain:
            return
        groups[hi].remove(move)
        groups[lo].append(move)
        if back is not None:
            groups[lo].remove(back)
            groups[hi].append(back)


def _first_fit_rows(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Rows of at most ``max_tokens``, each sequence in the first row with room for it, in
    the order given."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        r = next((r for r in range(len(rows)) if room[r] >= n), len(rows))
        if r == len(rows):
            rows.append([])
            room.append(max_tokens)
        rows[r].append(i)
        room[r] -= n
    return rows


def _runs(rows: list[list[int]], chunks: int) -> Plan:
    """``rows`` cut into ``chunks`` runs of equal row counts (the first ones a row more)."""
    base, extra = divmod(len(rows), chunks)
    out, start = [], 0
    for c in range(chunks):
        end = start + base + (c < extra)
        out.append(rows[start:end])
        start = end
    return out


def spread(plan_: Plan, lengths: Sequence[int]) -> int:
    """The tokens of the heaviest micro-batch of ``plan_`` less those of the lightest."""
    loads = [sum(lengths[i] for row in mb for i in row) for mb in plan_]
    return max(loads) - min(loads)


def plan(lengths: Sequence[int], max_tokens: int, chunks: int, *, balanced: bool = True) -> Plan:
    """Which sequences (by index, of these ``lengths``) go into which row of which
    micro-batch; ``pack`` without the tensors. A balanced plan is never less even than the
    first-fit one: where first-fit happens to spread the tokens less, it is that one."""
    checked = _lengths([range(n) for n in lengths], max_tokens, chunks)
    rows = _first_fit_rows(checked, max_tokens)
    if not balanced:
        if len(rows) < chunks:
            raise ValueError(
                f"{len(checked)} sequences make {len(rows)} rows of max_tokens={max_tokens}, "
                f"too few for chunks={chunks} micro-batches"
            )
        return _runs(rows, chunks)
    if len(checked) < chunks:
        raise ValueError(
            f"{len(checked)} sequences cannot fill chunks={chunks} micro-batches: give at "
            "least one sequence per micro-batch"
        )
    groups = _greedy(checked, chunks)
    _improve(groups, checked)
    chosen = [_best_fit_rows(g, checked, max_tokens) for g in groups]
    if len(rows) >= chunks and spread(_runs(rows, chunks), checked) < spread(chosen, checked):
        return _runs(rows, chunks)
    return chosen


def _microbatch(
    rows: list[list[Tensor]], pad_id: int, ignore_index: int
) -> tuple[dict[str, Any], Tensor]:
    """One micro-batch's tensors from its rows of documents."""
    width = max(sum(len(d) for d in row) for row in rows)
    shape = (len(rows), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    targets = torch.full(shape, ignore_index, dtype=torch.long)
    bounds = [0]
    for r, row in enumerate(rows):
        at = 0
        for doc in row:
            n = len(doc)
            ids[r, at : at + n] = doc
            positions[r, at : at + n] = torch.arange(n)
            targets[r, at : at + n - 1] = doc[1:]
            at += n
            bounds.append(r * width + at)
        if at < width:
            bounds.append((r + 1) * width)
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    inputs = {
        "input_ids": ids,
        "position_ids": positions,
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
        "max_seqlen": max(lengths),
    }
    return inputs, targets


def pack(
    sequences: Sequence[Sequence[int] | Tensor],
    max_tokens: int,
    chunks: int,
    *,
    balanced: bool = True,
    pad_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> list[tuple[dict[str, Any], Tensor]]:
    """``sequences`` (lists or 1-D tensors of token ids) packed into ``chunks`` micro-batches
    of rows of at most ``max_tokens`` tokens, ready for ``Pipeline.step(microbatches=...)``
    (the module's docstring says what each holds). ``balanced`` evens the micro-batches'
    tokens; ``False`` packs first-fit in order. A sequence longer than ``max_tokens``, no
    sequences, or ``chunks`` < 1 raise ValueError."""
    lengths = _lengths(sequences, max_tokens, chunks)
    docs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    chosen = plan(lengths, max_tokens, chunks, balanced=balanced)
    return [
        _microbatch([[docs[i] for i in row] for row in mb], pad_id, ignore_index) for mb in chosen
    ]


def counts_of(
    microbatches: Sequence[tuple[Any, Tensor]], ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """Each row's tokens that have a target, micro-batch after micro-batch: the ``counts``
    that make a mean loss per token exact under ``loss_reduction="mean"``."""
    return torch.cat([(y != ignore_index).sum(dim=1) for _, y in microbatches]).double()
