"""How long one GPU takes for a matrix product, an attention kernel or a memory-bound pass,
and a ring collective over a link: the calibrated roofline the cluster planner builds on.

A matrix product of ``m x k`` by ``k x n`` takes its FLOPs at the device's sustained rate
(``Device.gemm_efficiency`` of the dense peak) plus the time to stream its three operands
once through device memory. The sum, rather than the larger of the two, is what makes small
products slower per FLOP than large ones: a product whose operands are large beside its work
(a thin or short matrix) spends a visible share of its time loading them, as measured GEMM
throughput curves show. Memory-bound kernels (norms, activations, softmax, residual adds,
the optimizer) stream their bytes at ``STREAM_EFFICIENCY`` of the memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpipe.planning.hardware import Device

__all__ = [
    "COLLECTIVE_EFFICIENCY",
    "FLASH_BACKWARD",
    "FLASH_FORWARD",
    "Link",
    "STREAM_EFFICIENCY",
    "flash_seconds",
    "matmul_seconds",
    "stream_seconds",
]

STREAM_EFFICIENCY = 0.8  # of the memory bandwidth, by streaming kernels
COLLECTIVE_EFFICIENCY = 0.8  # of a link's bandwidth, by NCCL's ring collectives
# A fused attention kernel (FlashAttention 2/3) runs at this share of the GEMM rate, forward
# and backward; its backward does 2.5 forwards' worth of products (it recomputes the scores).
FLASH_FORWARD = 0.9
FLASH_BACKWARD = 0.75
_INTRA_NODE_LATENCY = 1e-6  # a step of a collective within a node, seconds


def matmul_seconds(device: Device, m: float, n: float, k: float, count: float = 1.0) -> float:
    """``count`` products of ``m x k`` by ``k x n`` in 16-bit: FLOPs at the sustained rate,
    plus the operands and the result streamed once."""
    flops = 2.0 * m * n * k * count
    nbytes = 2.0 * (m * k + k * n + m * n) * count
    return flops / (device.peak_flops * device.gemm_efficiency) + nbytes / device.hbm_bandwidth


def flash_seconds(device: Device, flops: float, backward: bool = False) -> float:
    """A fused attention kernel's ``flops`` (the products it runs, the masked blocks it skips
    left out), forward or backward."""
    rate = device.peak_flops * device.gemm_efficiency
    return flops / (rate * (FLASH_BACKWARD if backward else FLASH_FORWARD))


def stream_seconds(device: Device, nbytes: float) -> float:
    """A memory-bound kernel that reads and writes ``nbytes`` in all."""
    return nbytes / (device.hbm_bandwidth * STREAM_EFFICIENCY)


@dataclass(frozen=True)
class Link:
    """What joins the members of a group of GPUs: ``bandwidth`` bytes per second each GPU
    sends (one direction) and ``latency`` seconds per step."""

    bandwidth: float
    latency: float

    @classmethod
    def of_group(cls, device: Device, span: int, gpus: int | None = None) -> Link:
        """The link of groups whose members lie within ``span`` consecutive ranks, one group
        from every multiple of ``span`` up to ``gpus`` (None: as many as there are): NVLink
        (or the like) if each group lies in a node, else the per-GPU network (on more than
        one node that nodes do not divide into groups, some group spans two, and the step
        waits for the slowest)."""
        per_node = device.gpus_per_node
        one_node = gpus is not None and gpus <= per_node
        if span <= per_node and (per_node % span == 0 or one_node):
            return cls(device.intra_node_bandwidth, _INTRA_NODE_LATENCY)
        return cls(device.inter_node_bandwidth, device.latency_us * 1e-6)

    def ring(self, nbytes: float, members: int, passes: int = 1) -> float:
        """A ring all-gather or reduce-scatter (``passes=1``) or all-reduce (2) of ``nbytes``
        over ``members`` GPUs."""
        if members < 2:
            return 0.0
        wire = (members - 1) / members * nbytes / (self.bandwidth * COLLECTIVE_EFFICIENCY)
        return passes * (wire + (members - 1) * self.latency)
