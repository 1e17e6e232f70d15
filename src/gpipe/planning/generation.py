"""The memory of generating through a pipeline: each stage's weights and the KV cache of every
group of sequences in flight (``Pipeline.generate``).

Every stage holds, for each of its attention layers, the keys and values of every sequence in
flight: ``batch`` rows in ``in_flight`` groups of at most ``ceil(batch / in_flight)``, each row
as long as the context at most (a group's rows are padded to its longest, never past the
context). While a group's layer cache grows, its old and new buffers are both held: that
transient, one group's layer, is counted too. No gradients, optimizer state or kept
activations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GenerationPlan", "StageGeneration", "plan_generation"]


@dataclass(frozen=True)
class StageGeneration:
    """One stage: its attention layers, and bytes of weights, KV cache and the transient copy
    of one group's layer while it grows."""

    attention_layers: int
    weight_bytes: int
    cache_bytes: int
    transient_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.transient_bytes


@dataclass(frozen=True)
class GenerationPlan:
    batch: int
    context: int
    in_flight: int
    rows_per_group: int
    stages: tuple[StageGeneration, ...]

    @property
    def peak_bytes(self) -> int:
        return max(s.total_bytes for s in self.stages)

    def fits(self, device_bytes: float) -> bool:
        return self.peak_bytes <= device_bytes


def plan_generation(
    weight_bytes: Sequence[int],
    attention_layers: Sequence[int],
    *,
    kv_width: int,
    dtype_bytes: int,
    batch: int,
    context: int,
    in_flight: int,
) -> GenerationPlan:
    """The plan of stages holding ``weight_bytes`` and ``attention_layers`` each, whose
    attention keeps ``kv_width`` numbers a token for keys and as many for values (heads
    times head size; key-value heads under grouped queries), of ``dtype_bytes`` each, with
    ``batch`` sequences of up to ``context`` tokens in ``in_flight`` groups."""
    for name, value in (("batch", batch), ("context", context), ("in_flight", in_flight)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if len(weight_bytes) != len(attention_layers):
        raise ValueError("give the weights and the attention layers of every stage")
    rows = math.ceil(batch / in_flight)
    per_layer_row = 2 * context * kv_width * dtype_bytes  # keys and values of one row
    stages = tuple(
        StageGeneration(
            attention_layers=layers,
            weight_bytes=int(weights),
            cache_bytes=layers * batch * per_layer_row,  # the groups hold every row once
            transient_bytes=rows * per_layer_row if layers else 0,
        )
        for weights, layers in zip(weight_bytes, attention_layers, strict=True)
    )
    return GenerationPlan(batch, context, in_flight, rows, stages)
