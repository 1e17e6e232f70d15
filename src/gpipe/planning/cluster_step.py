"""What a layout's step is made of, before it is timed: each pipeline stage's costs (from
``gpipe.planning.layer_costs``), the simulator's ``Costs``, each process's parameters and
memory, the optimizer's step and the FLOPs counted.

Both the simulation (``gpipe.planning.cluster.predict``) and the search's quick estimate
(``gpipe.planning.cluster_search``) start from a ``StepModel``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpipe.planning.cluster_layout import Layout, layers_per_stage, stage_params
from gpipe.planning.cluster_memory import (
    BYTES_PER_PARAM,
    FRAMEWORK_BYTES,
    REDUCED_BYTES,
    MemoryParts,
    states_bytes,
)
from gpipe.planning.costs import Costs
from gpipe.planning.layer_costs import PassCosts, Work, block_costs, embedding_costs, head_costs
from gpipe.planning.roofline import COLLECTIVE_EFFICIENCY, Link, stream_seconds
from gpipe.planning.transformer import TransformerShape
from gpipe.schedules import traits

__all__ = ["StepModel", "kinds_per_stage", "pipeline_costs", "stage_costs", "step_flops"]

_OPTIMIZER_BYTES = {"bf16": 30, "fp16": 30}  # Adam's reads and writes a parameter


def step_flops(
    shape: TransformerShape, tokens: float, seq_len: int, recompute: str
) -> tuple[float, float]:
    """FLOPs of a step over ``tokens`` tokens: as Megatron-LM's equation 3 counts them
    (forward, backward twice the forward, and the forward again that ``recompute`` redoes;
    the logits three times) and the model's own (without recomputation); windowed blocks
    count the attention of their window."""
    blocks = shape.blocks_flops(seq_len)
    selective = shape.blocks_attention_flops(seq_len)
    again = {"none": 0.0, "selective": selective, "full": blocks}[recompute]
    model = tokens * (3 * blocks + 3 * shape.logit_flops())
    return model + tokens * again, model


def stage_costs(
    embedding: PassCosts,
    block: PassCosts,
    head: PassCosts,
    counts: Sequence[int],
    *,
    moe_block: PassCosts | None = None,
    moe_counts: Sequence[int] = (),
    others: Sequence[tuple[PassCosts, Sequence[int]]] = (),
) -> list[PassCosts]:
    """Each stage's costs per micro-batch: ``counts[s]`` blocks (and ``moe_counts[s]``
    blocks with experts, and of each of ``others``, blocks of another kind such as those
    with a sliding window, its count), the embedding on the first stage and the head on
    the last. The layers' costs may come from the roofline (a cluster plan) or from timing them
    (``benchmarks.bench_scaling`` on this machine's CPU): the pipeline is assembled the same
    way from either."""
    scaled = {n: block.times(n) for n in set(counts)}
    stages = [scaled[n] for n in counts]
    if moe_block is not None:
        stages = [
            s + moe_block.times(n) if n else s for s, n in zip(stages, moe_counts, strict=True)
        ]
    for other, other_counts in others:
        stages = [s + other.times(n) if n else s for s, n in zip(stages, other_counts, strict=True)]
    stages[0] = stages[0] + embedding
    stages[-1] = stages[-1] + head
    return stages


def pipeline_costs(
    stages: Sequence[PassCosts],
    *,
    message_bytes: float,
    latency: float,
    transfer: float,
    blocking: bool = False,
    grad_bytes: Sequence[float] | float = 0.0,
    allreduce_bandwidth: float | None = None,
) -> Costs:
    """The simulator's costs of a pipeline of ``stages``: their compute and activations; a
    message between stages arriving ``transfer`` seconds after it is sent (``latency`` of
    it fixed), or, ``blocking``, holding the sending stage until it is through (a
    send on the compute stream); ``grad_bytes`` per stage for the replicas to reduce."""
    n = len(stages)
    forward = [s.forward for s in stages]
    backward = [s.backward for s in stages]
    bandwidth = message_bytes / max(transfer - latency, 1e-12) if message_bytes else math.inf
    if blocking and n > 1:
        forward = [f + (transfer if i < n - 1 else 0.0) for i, f in enumerate(forward)]
        backward = [b + (transfer if i > 0 else 0.0) for i, b in enumerate(backward)]
        bandwidth = math.inf  # the send's time is the sender's: it arrives as it ends
    return Costs(
        forward=forward,
        backward=backward,
        weight=[s.weight for s in stages],
        recompute=[s.recompute for s in stages],
        latency=latency,
        bandwidth=bandwidth,
        message_bytes=message_bytes,
        activation_bytes=[s.stored for s in stages],
        grad_bytes=grad_bytes if isinstance(grad_bytes, float) else list(grad_bytes),
        allreduce_bandwidth=allreduce_bandwidth,
    )


@functools.lru_cache(maxsize=4096)
def _block(
    shape: TransformerShape, work: Work, moe: bool = False, window: int | None = None
) -> PassCosts:
    """One block's costs, the same for every layout with this shape of work."""
    return block_costs(shape, work, moe, window)


def kinds_per_stage(
    shape: TransformerShape, n_stages: int, seq_len: int | None = None
) -> dict[tuple[bool, int | None], list[int]]:
    """Per kind of block (with experts or not, its attention window), how many of them each
    stage holds (``layers_per_stage``'s blocks in order); the dense and the expert blocks
    with full attention always listed, and with them those whose window spans ``seq_len``
    (so that they cost exactly what full attention does)."""
    kinds = [(moe, None if seq_len and w and w >= seq_len else w) for moe, w in shape.block_kinds()]
    counts: dict[tuple[bool, int | None], list[int]] = {
        (False, None): [0] * n_stages,
        (True, None): [0] * n_stages,
    }
    start = 0
    for stage, n in enumerate(layers_per_stage(shape.layers, n_stages)):
        for kind in kinds[start : start + n]:
            counts.setdefault(kind, [0] * n_stages)[stage] += 1
        start += n
    return counts


@dataclass(frozen=True)
class StepModel:
    """A layout's costs: ``stages`` (each pipeline stage's, per micro-batch), ``params``
    (each stage's, on one GPU of its tensor-parallel group), the stages each process holds
    (``held``, as the schedule places them) and its parameters (``rank_params``)."""

    shape: TransformerShape
    layout: Layout
    stages: tuple[PassCosts, ...]
    params: tuple[float, ...]
    held: tuple[tuple[int, ...], ...]
    rank_params: tuple[float, ...]

    @classmethod
    def of(cls, shape: TransformerShape, layout: Layout) -> StepModel:
        device, t = layout.cluster.device, layout.tensor_parallel
        work = Work(
            device,
            t,
            layout.micro_batch,
            layout.seq_len,
            Link.of_group(device, t, layout.cluster.gpus),
            layout.recompute,
            layout.software,
        )
        kinds = kinds_per_stage(shape, layout.n_stages, layout.seq_len)
        dense, moe = kinds.pop((False, None)), kinds.pop((True, None))
        stages = stage_costs(
            embedding_costs(shape, work),
            _block(shape, work),
            head_costs(shape, work),
            dense,
            moe_block=_block(shape, work, moe=True) if shape.is_moe else None,
            moe_counts=moe,
            others=[(_block(shape, work, m, w), n) for (m, w), n in kinds.items()],
        )
        params = stage_params(shape, layout)
        placement, n, k = traits(layout.schedule).placement, layout.n_stages, layout.stages
        held = tuple(placement.stages_of(r, n, k) for r in range(k))
        rank_params = tuple(sum(params[s] for s in stages_of) for stages_of in held)
        return cls(shape, layout, tuple(stages), tuple(params), held, rank_params)

    @property
    def message_bytes(self) -> float:
        """One micro-batch's activations between two stages, in 16-bit."""
        layout = self.layout
        return 2.0 * layout.micro_batch * layout.seq_len * self.shape.hidden

    def transfer_seconds(self) -> float:
        """A message between stages: Megatron's scatter-gather, each GPU of the group
        sending 1/T of it on its own link and the receivers all-gathering it in the node."""
        layout, device, t = self.layout, self.layout.cluster.device, self.layout.tensor_parallel
        pp = Link.of_group(device, t * layout.data_parallel * layout.stages, layout.cluster.gpus)
        wire = self.message_bytes / t / (pp.bandwidth * COLLECTIVE_EFFICIENCY)
        tp = Link.of_group(device, t, layout.cluster.gpus)
        return pp.latency + wire + tp.ring(self.message_bytes, t)

    def costs(self) -> Costs:
        """The simulator's costs (``pipeline_costs``): the message between stages blocks
        its sender without ``p2p_overlap``; the replicas reduce 16-bit gradients (sharded,
        reduce-scattered: half an all-reduce's traffic)."""
        layout, device = self.layout, self.layout.cluster.device
        gpus, t, d = layout.cluster.gpus, layout.tensor_parallel, layout.data_parallel
        pp = Link.of_group(device, t * d * layout.stages, gpus)
        dp = Link.of_group(device, t * d, gpus)
        share = 1.0 if layout.shard is None else 0.5
        return pipeline_costs(
            self.stages,
            message_bytes=self.message_bytes,
            latency=pp.latency,
            transfer=self.transfer_seconds(),
            blocking=not layout.software.p2p_overlap and layout.stages > 1,
            grad_bytes=[p * REDUCED_BYTES[layout.precision] * share for p in self.params],
            allreduce_bandwidth=dp.bandwidth * COLLECTIVE_EFFICIENCY,
        )

    def gather_seconds(self) -> list[float]:
        """Per process, the all-gather of its updated 16-bit parameters over its replicas
        (sharded states only)."""
        layout = self.layout
        if layout.shard is None:
            return [0.0] * layout.stages
        d = layout.data_parallel
        link = Link.of_group(layout.cluster.device, layout.tensor_parallel * d, layout.cluster.gpus)
        weight = BYTES_PER_PARAM[layout.precision][0]
        return [link.ring(p * weight, d) for p in self.rank_params]

    def optimizer_seconds(self) -> float:
        """Adam's step on the fullest process's (shard of its) parameters: memory-bound."""
        layout = self.layout
        updated = max(self.rank_params) / (layout.data_parallel if layout.shard else 1)
        return stream_seconds(layout.cluster.device, _OPTIMIZER_BYTES[layout.precision] * updated)

    def peak_memory(self, activations: Sequence[float]) -> MemoryParts:
        """The fullest process's memory, each process ``r`` holding ``activations[r]`` bytes
        of the micro-batches in flight. Processes that hold the same parameters and stage
        costs differ only by their activations, so one of each kind is counted."""
        best: dict[tuple[float, float], int] = {}
        for rank, held in enumerate(self.held):
            working = max(self.stages[s].working for s in held)
            key = (self.rank_params[rank], working)
            if key not in best or activations[rank] > activations[best[key]]:
                best[key] = rank
        parts = (self.memory(r, activations[r]) for r in best.values())
        return max(parts, key=lambda p: p.total)

    def memory(self, rank: int, activations: float) -> MemoryParts:
        """Process ``rank``'s memory at its peak, holding ``activations`` bytes of the
        micro-batches in flight."""
        layout, held = self.layout, self.held[rank]
        weights, grads, optimizer = states_bytes(
            self.rank_params[rank], layout.precision, layout.data_parallel, layout.shard
        )
        stages: Sequence[PassCosts] = [self.stages[s] for s in held]
        working = max((s.working for s in stages), default=0.0)
        p2p = 4 * self.message_bytes  # an activation and a gradient, in and out
        return MemoryParts(
            weights=weights,
            gradients=grads,
            optimizer=optimizer,
            activations=activations + working,
            buffers=p2p + FRAMEWORK_BYTES,
        )

    def flops(self) -> tuple[float, float]:
        """The step's FLOPs: Megatron's count (recomputation included) and the model's. With
        FlashAttention, selective recomputation redoes nothing (``block_costs``: no scores are
        kept to drop), so it counts none."""
        layout = self.layout
        tokens = layout.global_batch * layout.seq_len
        recompute = layout.recompute
        if recompute == "selective" and layout.software.attention == "flash":
            recompute = "none"
        return step_flops(self.shape, tokens, layout.seq_len, recompute)
