"""Where a cluster plan puts things: D data-parallel replicas of a pipeline of K processes,
each a group of T tensor-parallel GPUs, and the model's blocks over the pipeline's stages.

Ranks are numbered tensor innermost, then data, then pipeline (as ``Pipeline`` numbers
them), so a tensor-parallel group is T neighbouring GPUs, a data-parallel group spans T x D
of them, and a stage's neighbour is T x D ranks away: whether each group fits in a node
decides its link (``roofline.Link.of_group``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpipe.planning.cluster_memory import BYTES_PER_PARAM
from gpipe.planning.hardware import Cluster
from gpipe.planning.layer_costs import RECOMPUTE, STACKS, Software
from gpipe.planning.transformer import TransformerShape
from gpipe.schedules import Placement, traits

__all__ = [
    "Layout",
    "blocks_per_stage",
    "check_layout",
    "check_virtual_stages",
    "layers_per_stage",
    "splits_over",
    "stage_params",
]


@dataclass(frozen=True)
class Layout:
    """How a step runs on the cluster: ``data_parallel`` x ``tensor_parallel`` x ``stages``
    GPUs, ``global_batch`` sequences of ``seq_len`` tokens in micro-batches of
    ``micro_batch``, the pipeline's ``schedule`` with ``virtual_stages`` stages per process
    where it takes several, re-materialization ``recompute``, the replicas' ``shard``, and
    the software ``stack`` (``layer_costs.STACKS``; None: the device's)."""

    cluster: Cluster
    data_parallel: int
    tensor_parallel: int
    stages: int
    global_batch: int
    micro_batch: int
    seq_len: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    shard: str | None = None
    precision: str = "bf16"
    stack: str | None = None

    @property
    def microbatches(self) -> int:
        """M: micro-batches each pipeline runs per step."""
        return self.global_batch // (self.data_parallel * self.micro_batch)

    @property
    def n_stages(self) -> int:
        return self.stages * traits(self.schedule).stages_per_rank(self.virtual_stages)

    @property
    def software(self) -> Software:
        return STACKS[self.stack or self.cluster.device.stack]

    def describe(self) -> str:
        """One line, as the search's table and the errors print a layout."""
        several = traits(self.schedule).several_stages_per_rank
        v = f" v={self.n_stages // self.stages}" if several else ""
        return (
            f"D={self.data_parallel} T={self.tensor_parallel} K={self.stages} "
            f"{self.schedule}{v} b={self.micro_batch} M={self.microbatches} "
            f"recompute={self.recompute} shard={self.shard or 'none'}"
        )


def check_layout(shape: TransformerShape, layout: Layout) -> None:
    """Refuse, in one line each, a layout that cannot run: its product is not the GPU
    count, the batch does not divide, T does not divide the heads, too few layers, or a
    schedule that does not run its micro-batches."""
    d, t, k = layout.data_parallel, layout.tensor_parallel, layout.stages
    gpus = layout.cluster.gpus
    sizes = {"--tensor-parallel": t, "--stages": k, "--micro-batch": layout.micro_batch}
    for flag, value in sizes.items():
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}")
    if d < 1 or d * t * k != gpus:
        raise ValueError(
            f"the layout does not cover the cluster: --tensor-parallel {t} x --stages {k} = "
            f"{t * k} GPUs per replica does not divide {gpus} GPUs"
            if d < 1 or gpus % (t * k)
            else f"the layout D {d} x T {t} x K {k} = {d * t * k} GPUs, but the cluster has {gpus}"
        )
    per_round = d * layout.micro_batch
    if layout.global_batch % per_round:
        raise ValueError(
            f"--global-batch {layout.global_batch} does not divide into D {d} replicas x "
            f"--micro-batch {layout.micro_batch} = {per_round} sequences"
        )
    if not splits_over(shape, t):
        widths = " and ".join(str(w) for w in shape.tensor_split_widths())
        raise ValueError(
            f"--tensor-parallel {t} must divide the {shape.heads} attention heads, the "
            f"{shape.kv_heads} key/value heads and the MLP's width {widths}"
        )
    if layout.n_stages > shape.layers:
        raise ValueError(
            f"{layout.n_stages} pipeline stages (--stages {k} x {layout.n_stages // k} per "
            f"process) for a model of {shape.layers} layers"
        )
    _check_schedule(layout)
    if layout.recompute not in RECOMPUTE:
        raise ValueError(f"--recompute must be one of {RECOMPUTE}, got {layout.recompute!r}")
    if layout.precision not in BYTES_PER_PARAM:
        raise ValueError(
            f"--precision must be one of {sorted(BYTES_PER_PARAM)}, got {layout.precision!r}"
        )
    if layout.shard is not None and d < 2:
        raise ValueError(f"--shard {layout.shard} splits states over replicas: D is {d}")


def check_virtual_stages(schedule: str, v: int) -> None:
    """Refuse stages per process that ``schedule`` does not hold."""
    kind = traits(schedule)
    if v > 1 and not kind.several_stages_per_rank:
        raise ValueError(f"--virtual-stages {v}: --schedule {schedule} runs one stage per process")
    if kind.placement is Placement.V and v not in (1, 2):
        raise ValueError(
            f"--virtual-stages {v}: --schedule {schedule} holds two stages per process (a V), "
            "so it takes --virtual-stages 2 or none"
        )


def _check_schedule(layout: Layout) -> None:
    k, m, v = layout.stages, layout.microbatches, layout.virtual_stages
    kind = traits(layout.schedule)
    check_virtual_stages(layout.schedule, v)
    if not kind.runs(k, m, v):
        rounds = ", a multiple of --stages" if kind.microbatches_per_round else ""
        raise ValueError(
            f"--schedule {layout.schedule} does not run {m} micro-batches on {k} stages (it "
            f"needs at least {kind.fewest_microbatches(k, v)}{rounds})"
        )


def splits_over(shape: TransformerShape, t: int) -> bool:
    """Whether a tensor-parallel group of ``t`` can split the model's heads and MLPs."""
    kv_split = shape.kv_heads % t == 0 or t % shape.kv_heads == 0
    return (
        shape.heads % t == 0 and kv_split and all(w % t == 0 for w in shape.tensor_split_widths())
    )


def layers_per_stage(layers: int, n_stages: int) -> list[int]:
    """Blocks per stage, as even as can be; the extra ones go to the middle stages, away
    from the embedding (first) and the logits (last)."""
    base, extra = divmod(layers, n_stages)
    counts = [base] * n_stages
    order = [*range(1, n_stages - 1), n_stages - 1, 0] if n_stages > 2 else list(range(n_stages))
    for s in order[:extra]:
        counts[s] += 1
    return counts


def blocks_per_stage(shape: TransformerShape, n_stages: int) -> tuple[list[int], list[int]]:
    """Per stage, its dense blocks and its blocks with experts (``layers_per_stage``'s
    blocks in order)."""
    dense, moe, start = [], [], 0
    for n in layers_per_stage(shape.layers, n_stages):
        experts = sum(shape.is_moe_block(i) for i in range(start, start + n))
        dense.append(n - experts)
        moe.append(experts)
        start += n
    return dense, moe


def stage_params(shape: TransformerShape, layout: Layout) -> list[float]:
    """Parameters per stage on one GPU of its tensor-parallel group; the last stage keeps
    its own copy of a tied embedding when the pipeline has several stages (as Megatron)."""
    t, layer, experts = layout.tensor_parallel, shape.layer_params(), shape.layer_params(True)
    dense, moe = blocks_per_stage(shape, layout.n_stages)
    params = [(n * layer + e * experts) / t for n, e in zip(dense, moe, strict=True)]
    params[0] += shape.embedding_params() / t
    if not shape.tied or layout.n_stages > 1:
        params[-1] += shape.embedding_params() / t
    return params
