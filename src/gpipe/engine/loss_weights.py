"""What the last stage needs for each micro-batch's loss: its targets and its weight.

The weight is the micro-batch's share of the mini-batch loss over every replica's rows (or,
with ``counts``, over every replica's counts).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gpipe.parallel.replicas import Replicas
from gpipe.runtime.microbatch import check_payload, payload_to, scatter_payload
from gpipe.runtime.stage import NO_TARGET

__all__ = ["loss_weights", "scatter_targets"]


def scatter_targets(
    targets: Any, rows: int, n_microbatches: int, chunks: int, device: torch.device
) -> list[Any]:
    """Each micro-batch's targets; without targets, ``loss_fn`` takes the outputs alone."""
    if targets is None:
        return [NO_TARGET] * n_microbatches
    n = check_payload(targets, "targets")
    if n != rows:
        raise ValueError(f"targets have {n} rows but inputs have {rows}")
    return scatter_payload(payload_to(targets, device), chunks)


def loss_weights(
    sizes: list[int],
    reduction: str,
    *,
    rows_all: int,
    scale: float = 1.0,
    counts: Any = None,
    replicas: Replicas | None,
    stage: int,
    device: torch.device,
) -> list[float]:
    """Each micro-batch's loss weight, times a loss ``scale``: 1 when losses add up
    (``reduction="sum"``), else its share of the rows of every replica (``rows_all``), or
    of the counts, summed over the replicas."""
    if reduction == "sum":
        if counts is not None:
            raise ValueError(
                "counts= weights the micro-batches' mean losses; with "
                "loss_reduction='sum' the losses add up as they are"
            )
        return [scale] * len(sizes)
    if counts is None:  # every replica's rows: the loss is that of their union
        parts, total = [float(n) for n in sizes], float(rows_all)
    else:
        parts, total = _counted(counts, sizes, replicas, stage, device)
    return [scale * part / total for part in parts]


def _counted(
    counts: Any,
    sizes: list[int],
    replicas: Replicas | None,
    stage: int,
    device: torch.device,
) -> tuple[list[float], float]:
    """Each micro-batch's share of ``counts`` (one per row, or one per token: rows x
    tokens), and their total over the replicas."""
    rows = sum(sizes)
    parts: list[float] = []
    try:
        given = torch.as_tensor(counts, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError):  # ragged: micro-batches of several lengths
        problem: str | None = (
            "counts must be one tensor, one count per row (or per token, rows x tokens, "
            f"where every row has as many), got a {type(counts).__name__} of another shape"
        )
    else:
        problem = _shape_problem(given, rows)
        if problem is None:
            parts = [float(part.sum()) for part in given.split(sizes)]  # a token's, its row's
            empty = [i for i, part in enumerate(parts) if part == 0]
            if empty:
                problem = (
                    f"counts are 0 for every row of micro-batch {empty[0]}: a mean over "
                    "nothing has no weight; drop such rows or use more of them per micro-batch"
                )
    # a replica with bad counts sends NaN, so that every replica stops, not times out
    total = torch.tensor([math.nan if problem else sum(parts)], dtype=torch.float64, device=device)
    if replicas is not None:
        replicas.sum(total, "the counts", stage)
    if problem is not None:
        raise ValueError(problem)
    if math.isnan(float(total)):
        raise ValueError("another replica refused its counts this step (its error says why)")
    return parts, float(total)


def _shape_problem(given: torch.Tensor, rows: int) -> str | None:
    """What is wrong with counts of one per row or one per token, if anything."""
    if given.dim() not in (1, 2) or given.shape[0] != rows:
        return (
            f"counts must hold one count per row of the mini-batch ({rows}), or one per "
            f"token ({rows} x tokens), got shape {tuple(given.shape)}"
        )
    if (given < 0).any():
        at = tuple(int(i) for i in (given < 0).nonzero()[0])
        where = f"row {at[0]}" + (f", token {at[1]}" if len(at) > 1 else "")
        return f"counts must not be negative, got {given[at].item():g} for {where}"
    return None
