"""A training step's micro-batches cut along their sequence into units, and joined back.

With ``seq_chunks`` the schedule counts sub-sequences, not micro-batches: sub-sequence j of
micro-batch i is unit i x S + j. The first stage feeds units, the last stage takes each
unit's loss on its own tokens' targets, weighted by its share of the micro-batch's loss;
after the step, each micro-batch's outputs and loss are put back together from its units'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gpipe.runtime.executor import StepData
from gpipe.runtime.seq_chunks import SeqChunks, join_sequence, sequence_length, split_sequence
from gpipe.runtime.stage import NO_TARGET

__all__ = ["SequenceUnits"]


class SequenceUnits:
    """Cuts a step's micro-batches into ``seq.chunks`` sub-sequences each and joins them
    back; ``loss_reduction`` says how a micro-batch's loss weight is shared among them."""

    def __init__(self, seq: SeqChunks, loss_reduction: str) -> None:
        self.seq = seq
        self.loss_reduction = loss_reduction

    def inputs(self, parts: list[Any] | None) -> list[Any] | None:
        """Each micro-batch's inputs cut into its sub-sequences, in unit order."""
        if parts is None:
            return None
        if not isinstance(parts[0], Tensor):
            raise TypeError(
                "seq_chunks cuts token ids, a tensor [rows, tokens], into sub-sequences; got "
                f"a {type(parts[0]).__name__}: packed documents and other payloads are not "
                "supported with seq_chunks yet"
            )
        return [
            unit
            for part in parts
            for unit in split_sequence(part, self.seq.lengths(sequence_length(part)))
        ]

    def targets(self, data: StepData, counts: Any, sizes: Sequence[int]) -> list[float]:
        """Cut the last stage's targets into units, each with its share of its micro-batch's
        loss weight: for a mean loss, its share of the tokens, or with ``counts`` (one per
        token) of their counts; the whole weight, for losses that add up. A unit whose tokens
        all count 0 weighs nothing. Returns the micro-batches' own weights, for ``join``."""
        assert data.targets is not None and data.loss_weights is not None
        per_token = None if counts is None else torch.as_tensor(counts, dtype=torch.float64)
        if per_token is not None and per_token.dim() != 2:
            raise ValueError(
                "with seq_chunks, counts= needs one count per token (rows x tokens, such as "
                "targets != -100): a sub-sequence's share of the mean is its tokens' count"
            )
        rows = [None] * len(sizes) if per_token is None else per_token.cpu().split(list(sizes))
        targets, weights = [], []
        for target, weight, counted in zip(data.targets, data.loss_weights, rows, strict=True):
            if target is NO_TARGET:
                raise ValueError(
                    "seq_chunks needs targets: each sub-sequence's loss is taken on its own "
                    "tokens' targets"
                )
            length = sequence_length(target)
            targets += split_sequence(target, self.seq.lengths(length))
            weights += [weight * share for share in self._shares(length, counted)]
        microbatch_weights = list(data.loss_weights)
        data.targets, data.loss_weights = targets, weights
        return microbatch_weights

    def _shares(self, length: int, counted: Tensor | None) -> list[float]:
        """Each unit's share of a micro-batch of ``length`` tokens' loss weight."""
        if self.loss_reduction == "sum":
            return [1.0] * self.seq.chunks
        if counted is None:
            return self.seq.weights(length)
        if counted.shape[1] != length:
            raise ValueError(
                f"counts= per token must cover each sequence of {length} tokens, got "
                f"{counted.shape[1]} a row"
            )
        units = [float(c.sum()) for c in counted.split(self.seq.lengths(length), dim=1)]
        return [unit / sum(units) for unit in units]

    def join(self, data: StepData, m: int, weights: list[float]) -> None:
        """On the last stage, each of the ``m`` micro-batches' outputs and loss from its
        units', and their own loss ``weights`` back."""
        s = self.seq.chunks
        if data.keep_outputs and data.outputs:
            data.outputs = {
                i: join_sequence([data.outputs[i * s + j] for j in range(s)]) for i in range(m)
            }
        data.losses = {
            i: torch.stack([data.losses[i * s + j] for j in range(s)]).sum() for i in range(m)
        }
        data.loss_weights = weights
