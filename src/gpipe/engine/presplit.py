"""Micro-batches the user splits for ``Pipeline``: checked once, run as given.

``step(microbatches=[(inputs, targets), ...])`` runs them in order, each of its own length and
row count, instead of splitting one mini-batch into ``chunks``; ``GPipe``'s counterpart is
``given_batches``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpipe.comm.payload import check_same_structure, signature
from gpipe.errors import StageError
from gpipe.runtime.microbatch import check_payload, payload_to, scatter_payload, split_sizes
from gpipe.runtime.packed_check import check_packed
from gpipe.runtime.stage import NO_TARGET

__all__ = [
    "Presplit",
    "first_parts",
    "given_microbatches",
    "given_targets",
    "later_sizes",
    "presplit",
]


@dataclass(frozen=True)
class Presplit:
    """The user's micro-batches: their inputs, their targets (None when ``loss_fn`` takes
    the outputs alone) and their rows, in order."""

    inputs: list[Any]
    targets: list[Any] | None
    sizes: list[int]

    @property
    def rows(self) -> int:
        return sum(self.sizes)


def presplit(microbatches: Any) -> Presplit:
    """Check ``microbatches``: a non-empty list of ``(inputs, targets)`` pairs whose inputs
    share one structure (the same tree, tensors in the same places; lengths may differ), none
    empty, with targets for all of them or for none, each with its inputs' rows."""
    if not isinstance(microbatches, list | tuple) or not microbatches:
        sequence = isinstance(microbatches, list | tuple)
        got = repr(microbatches) if sequence else type(microbatches).__name__
        raise ValueError(
            f"microbatches must be a non-empty list of (inputs, targets) pairs, got {got}"
        )
    inputs: list[Any] = []
    targets: list[Any] = []
    sizes: list[int] = []
    first = None
    for i, item in enumerate(microbatches):
        where = f"microbatches[{i}]"
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise ValueError(
                f"{where} must be an (inputs, targets) pair (targets may be None), "
                f"got {type(item).__name__}"
            )
        x, y = item
        rows = check_payload(x, f"{where} inputs")
        check_packed(x, f"{where} inputs")  # cu_seqlens that match the tokens, if packed
        if first is None:
            first = signature(x)
        else:
            check_same_structure(first, x, f"{where} inputs")
        if (y is None) != (microbatches[0][1] is None):
            raise ValueError(
                f"{where} has {'no ' if y is None else ''}targets but microbatches[0] "
                f"{'has' if y is None else 'has none'}: give targets for every micro-batch or "
                "for none"
            )
        if y is not None:
            n = check_payload(y, f"{where} targets")
            if n != rows:
                raise ValueError(f"{where}: targets have {n} rows but inputs have {rows}")
            targets.append(y)
        inputs.append(x)
        sizes.append(rows)
    return Presplit(inputs, targets if targets else None, sizes)


def given_microbatches(inputs: Any, targets: Any, microbatches: Any) -> Presplit | None:
    """The user's own micro-batches, checked (``presplit``), or None for a mini-batch of
    ``inputs`` to split; refuses both at once."""
    if microbatches is None:
        return None
    if inputs is not None or targets is not None:
        raise ValueError(
            "give inputs and targets, or microbatches=[(inputs, targets), ...], not both"
        )
    return presplit(microbatches)


def given_targets(given: Presplit, device: torch.device) -> list[Any]:
    """Each micro-batch's targets on ``device``; without targets, ``loss_fn`` takes the
    outputs alone."""
    if given.targets is None:
        return [NO_TARGET] * len(given.sizes)
    return [payload_to(y, device) for y in given.targets]


def first_parts(
    inputs: Any, given: Presplit | None, rows: int, chunks: int, device: torch.device
) -> tuple[list[int], list[Any]]:
    """The first rank's micro-batches, rows and inputs on ``device``: those ``given``, or
    ``inputs`` (of ``rows`` rows) split into ``chunks``."""
    if given:
        return given.sizes, [payload_to(x, device) for x in given.inputs]
    return split_sizes(rows, chunks), scatter_payload(payload_to(inputs, device), chunks)


def later_sizes(given: Presplit | None, m: int, rows: int, chunks: int, stage: int) -> list[int]:
    """A later rank's micro-batch rows, which must agree with the ``m`` micro-batches of
    ``rows`` rows in all that the first rank sent (the last rank weighs losses by them)."""
    sizes = given.sizes if given else split_sizes(rows, chunks)
    if (len(sizes), sum(sizes)) != (m, rows):
        raise StageError(
            stage,
            f"the first stage sent {m} micro-batches of {rows} rows in all, but this stage "
            f"was given {len(sizes)} of {sum(sizes)}: pass the same microbatches= on every rank",
        )
    return sizes
