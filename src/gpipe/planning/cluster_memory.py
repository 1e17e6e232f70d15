"""What one GPU of a cluster plan holds at its peak: its share of the weights, gradients and
optimizer state (whole or sharded over its replicas), the activations its schedule keeps in
flight, and buffers.

Mixed precision keeps 16-bit weights and Adam's fp32 master weights, momentum and variance;
``bf16`` sums the gradients over micro-batches in fp32 (Megatron-LM's main gradients, 4 bytes
a parameter), ``fp16`` in fp16 (2 bytes, and an fp32 copy for the optimizer: 16 bytes of
optimizer state). A cluster's step is planned in 16-bit precision only: the catalogue holds
each device's 16-bit tensor-core peak. The replicas reduce 16-bit gradients under mixed
precision (``REDUCED_BYTES``: PyTorch FSDP's ``reduce_dtype``, Megatron-LM's
``--grad-reduce-in-bf16``; Megatron-LM's default of fp32 doubles that traffic). The shard modes are
``Pipeline``'s (``gpipe.planning.shards``): ``optimizer`` and ``gradients`` split the
optimizer state over the D replicas (gradients still sum whole during the step),
``full`` splits the weights too and gathers a stage's weights for the step.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BYTES_PER_PARAM", "FRAMEWORK_BYTES", "REDUCED_BYTES", "MemoryParts", "states_bytes"]

# (weights, gradients, optimizer state) bytes per parameter, by precision
BYTES_PER_PARAM = {"bf16": (2, 4, 12), "fp16": (2, 2, 16)}
# bytes per parameter of the gradients the replicas reduce: 16-bit under mixed precision
REDUCED_BYTES = {"bf16": 2, "fp16": 2}
# The CUDA context, NCCL's communicators and cuBLAS's workspace, and the allocator's slack
FRAMEWORK_BYTES = 2.0 * 2**30


@dataclass(frozen=True)
class MemoryParts:
    """Bytes on one GPU at its peak, by part."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    def gib(self) -> dict[str, float]:
        """The parts and the total in GiB, for printing and JSON."""
        parts = {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
            "total": self.total,
        }
        return {k: v / 2**30 for k, v in parts.items()}


def states_bytes(
    params: float, precision: str, data_parallel: int, shard: str | None
) -> tuple[float, float, float]:
    """Weights, gradients and optimizer state of a GPU holding ``params`` parameters, at
    the step's peak."""
    w, g, o = BYTES_PER_PARAM[precision]
    d = data_parallel
    if shard is None:
        return params * w, params * g, params * o
    if shard in ("optimizer", "gradients"):
        return params * w, params * g, params * o / d
    # full: the shard and the stage's weights gathered for the step beside it
    return params * w * (1 + 1 / d), params * g, params * o / d
