"""Where a pipeline's stages sit on its ranks, and this rank's stages built.

Building makes this rank's layers real on its device, unties parameters shared across stages
into copies, and routes skips between stages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from gpipe.parallel.sharding import ShardedStages, Sharding, check_units_for_sub_sequences
from gpipe.parallel.tensor import ParallelMesh, TensorPlan
from gpipe.parallel.ties import Tie, find_ties, untie
from gpipe.runtime.batchnorm import convert_deferred_batch_norm
from gpipe.runtime.compiled import CompileOptions, compile_layers
from gpipe.runtime.partitions import materialize, stage_bounds
from gpipe.runtime.recompute import Layers, recomputed_layers
from gpipe.runtime.seq_chunks import SeqChunks
from gpipe.runtime.stage import LossFn, Stage
from gpipe.schedules import SCHEDULES, Placement, traits
from gpipe.skip.layout import SkipLayout
from gpipe.skip.skippable import Skip

if TYPE_CHECKING:
    from gpipe.parallel.replicas import Replicas

__all__ = ["BuiltStages", "RankPlacement", "StageRecipe", "build_stages", "check_stages_per_rank"]


def _loss_parallel() -> Callable[[], AbstractContextManager[None]]:
    """torch's ``loss_parallel`` context, imported only by runs that split their logits."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel


def check_stages_per_rank(n_stages: int, n_ranks: int, schedule: str) -> None:
    """Refuse stages that do not sit evenly on the ranks, or several stages per rank under a
    schedule that places one on each, or a V that is not 2K stages long."""
    placing = " or ".join(
        f"schedule={name!r}" for name in SCHEDULES if traits(name).several_stages_per_rank
    )
    if n_stages % n_ranks:
        raise ValueError(
            f"balance has {n_stages} partitions but the process group has {n_ranks} "
            "processes; Pipeline runs one stage per process, or the same number of stages "
            f"on each with {placing}"
        )
    if n_stages != n_ranks and not traits(schedule).several_stages_per_rank:
        raise ValueError(
            f"balance has {n_stages} partitions for {n_ranks} processes: several stages per "
            f"process need {placing}, not {schedule!r}"
        )
    traits(schedule).placement.check(n_stages, n_ranks, schedule)


@dataclass(frozen=True)
class RankPlacement:
    """Which stages each rank of the pipeline's group holds: of ``len(balance)`` stages on K
    ranks, rank r holds r, r + K, r + 2K, ... (one stage, unless the schedule loops), or
    under a V schedule r and 2K - 1 - r."""

    balance: tuple[int, ...]
    rank: int
    n_ranks: int
    group: dist.ProcessGroup | None  # None: the whole world
    layout: Placement | tuple[int, ...] = Placement.LOOPED  # or each stage's rank

    @property
    def n_stages(self) -> int:
        return len(self.balance)

    @property
    def stages(self) -> tuple[int, ...]:
        """This rank's stages, in order."""
        if isinstance(self.layout, tuple):
            return tuple(s for s, r in enumerate(self.layout) if r == self.rank)
        return self.layout.stages_of(self.rank, self.n_stages, self.n_ranks)

    @property
    def is_first(self) -> bool:
        return self.rank_of(0) == self.rank

    @property
    def is_last(self) -> bool:
        return self.rank_of(self.n_stages - 1) == self.rank

    @property
    def stage_to_rank(self) -> tuple[int, ...]:
        return tuple(self.rank_of(s) for s in range(self.n_stages))

    def rank_of(self, stage: int) -> int:
        """The rank (in the pipeline's group) that holds ``stage``."""
        if isinstance(self.layout, tuple):
            return self.layout[stage]
        return self.layout.rank_of(stage, self.n_stages, self.n_ranks)

    def global_rank(self, rank: int) -> int:
        """The rank in the world of rank ``rank`` of the pipeline's group."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def stage_of(self, layer: int) -> int:
        """The stage that holds layer ``layer`` of the whole model."""
        bounds = stage_bounds(self.balance)
        if not 0 <= layer < bounds[-1][1]:
            raise IndexError(f"layer must be in [0, {bounds[-1][1]}), got {layer}")
        return next(s for s, (start, stop) in enumerate(bounds) if start <= layer < stop)


@dataclass(frozen=True)
class StageRecipe:
    """How this rank builds its stages and what they run with."""

    device: torch.device
    chunks: int
    checkpoint: str | Layers
    loss_fn: LossFn | None
    autocast: torch.dtype | None
    deferred_batch_norm: bool
    seed: int  # of the initialization of layers built on the meta device
    sharding: Sharding | None = None  # over ``replicas``, which it needs
    replicas: Replicas | None = None
    tensor_plan: TensorPlan | None = None  # over the tensor dimension of ``mesh``
    mesh: ParallelMesh | None = None
    loss_parallel: bool = False  # the loss over logits split by vocabulary
    compile: CompileOptions | None = None  # torch.compile's arguments for each layer
    split_backward: bool = False  # the schedule runs input and weight gradients apart
    seq_chunks: SeqChunks | None = None  # micro-batches cut along their sequence


class BuiltStages(NamedTuple):
    """This rank's stages, and what the whole pipeline shares about them."""

    layers: dict[str, nn.Module]  # this rank's layers, by their names in the whole model
    stages: dict[int, Stage]
    ties: list[Tie]  # parameters that layers of several stages share
    skip_layout: SkipLayout
    sharded: ShardedStages | None = None  # the stages sharded over their replicas


def build_stages(
    module: nn.Sequential, skips: Sequence[Skip], placement: RankPlacement, recipe: StageRecipe
) -> BuiltStages:
    """Build this rank's stages out of ``module``, identical on every rank: only this rank's
    layers are allocated (and, built on the meta device, initialized from the seed and their
    index, so that the weights do not depend on the number of stages)."""
    balance = list(placement.balance)
    skip_layout = SkipLayout(skips, balance)
    recomputed = recomputed_layers(recipe.checkpoint, module, balance)
    # a parameter that layers of several stages share: a copy on each, gradients summed
    # over the copies at the end of every step (so they stay equal)
    ties = find_ties(module, balance)
    children = list(module.named_children())
    if recipe.tensor_plan is not None:
        stage_layers = [[n for n, _ in children[a:b]] for a, b in stage_bounds(balance)]
        recipe.tensor_plan.check_sharing(module, stage_layers, ties)
    untie(module, ties)
    if recipe.sharding is not None and recipe.seq_chunks is not None:
        for stage, (start, stop) in enumerate(stage_bounds(balance)):
            partition = nn.Sequential(OrderedDict(children[start:stop]))
            check_units_for_sub_sequences(partition, recipe.sharding, stage)
    layers: dict[str, nn.Module] = {}
    stages: dict[int, Stage] = {}
    for stage in placement.stages:
        start, stop = stage_bounds(balance)[stage]
        for index in range(start, stop):
            name, layer = children[index]
            if recipe.deferred_batch_norm:
                layer = convert_deferred_batch_norm(layer, recipe.chunks, auto_commit=False)
            layers[name] = materialize(layer, index, recipe.device, recipe.seed)
        partition = nn.Sequential(
            OrderedDict((name, layers[name]) for name, _ in children[start:stop])
        )
        if recipe.tensor_plan is not None and recipe.mesh is not None:
            # before any other wrapping: re-materialization, then sharded replicas
            recipe.tensor_plan.apply(partition, recipe.mesh.tensor)
        if recipe.compile is not None:
            compile_layers(
                partition,
                recipe.compile,
                split_backward=recipe.split_backward,
                sub_sequences=recipe.seq_chunks is not None,
            )
        stages[stage] = Stage(
            stage,
            placement.n_stages,
            partition,
            recipe.device,
            recipe.loss_fn,
            ports=skip_layout.ports(stage),
            autocast=recipe.autocast,
            recomputed_layers=recomputed[stage],
            payloads=True,
            loss_context=_loss_parallel() if recipe.loss_parallel else None,
            seq_chunks=recipe.seq_chunks.chunks if recipe.seq_chunks is not None else 1,
        )
    sharded = None
    if recipe.sharding is not None and recipe.replicas is not None:
        data_mesh = recipe.mesh.data if recipe.mesh is not None else None
        sharded = ShardedStages(stages, recipe.replicas, recipe.sharding, data_mesh)
    return BuiltStages(layers, stages, ties, skip_layout, sharded)
