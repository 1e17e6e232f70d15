"""The build step of ``Pipeline``: from a checked ``PipelineConfig`` and the whole model to
this rank's stages and the engine that runs their steps.

In order: this rank's device and what the options say about the model on it; the process
groups (``gpipe.parallel.world.join``); the schedule, micro-batches and cut that every rank
agrees on (measured or searched on the first rank, told to the others); this rank's stages
(``gpipe.engine.build_stages``); and their collaborators: ``Precision`` for autocast and
loss scaling, ``StepRunner`` for the steps. Collective over the pipeline's ranks from
``join`` on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gpipe.comm.agreement import on_first_rank
from gpipe.comm.process_group import rank_device
from gpipe.engine import (
    BuiltStages,
    RankPlacement,
    ScheduleSource,
    StageRecipe,
    StepRunner,
    StepSchedules,
    build_stages,
)
from gpipe.parallel.world import World, join
from gpipe.pipeline_config import ModelSettings, PipelineConfig
from gpipe.planning.auto import AutoChoice, agreed_choice
from gpipe.planning.balancing import balance_by_time
from gpipe.runtime.compiled import warn_eager_training
from gpipe.runtime.microbatch import Batch
from gpipe.runtime.partitions import as_sequential, check_balance, even_balance
from gpipe.runtime.precision import Precision
from gpipe.runtime.stage_streams import overlaps_stages
from gpipe.runtime.timeline import Recorder

__all__ = ["Assembly", "Cut", "agreed_balance", "assemble"]


def agreed_balance(
    layers: nn.Sequential | Iterable[nn.Module],
    parts: int,
    sample: Batch | None,
    *,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    timeout: float = 1.0,
) -> list[int]:
    """Layers per stage, decided once for all ranks of ``group``: its first rank measures each
    layer's time on ``sample`` (``balance_by_time``; as even as possible by layer count if it
    has no sample) and tells the others, who agree even where their clocks would not."""
    module = as_sequential(layers)

    def decide() -> list[int]:
        if sample is None:
            return even_balance(len(module), parts)
        return balance_by_time(parts, module, sample, timeout=timeout, device=device)

    return list(on_first_rank(decide, group, "balancing by time"))


@dataclass(frozen=True)
class Cut:
    """The schedule, micro-batches and balance that every rank of a pipeline runs."""

    source: ScheduleSource
    chunks: int
    balance: list[int]
    auto_choice: AutoChoice | None  # what ``schedule="auto"`` chose, when it did


@dataclass(frozen=True)
class Assembly:
    """What the build step made on this rank, for ``Pipeline`` to hold and delegate to."""

    device: torch.device
    settings: ModelSettings
    world: World
    rank: int  # in the pipeline's group
    n_ranks: int
    cut: Cut
    placement: RankPlacement
    built: BuiltStages
    precision: Precision
    runner: StepRunner
    recorder: Recorder | None


def assemble(
    module: nn.Sequential,
    config: PipelineConfig,
    *,
    sample: Batch | None,
    group: dist.ProcessGroup | None,
) -> Assembly:
    """Build this rank's part of a pipeline over ``module`` as ``config`` says: collective
    over the world when it joins the process groups, over the pipeline afterwards."""
    device = rank_device(config.device)
    settings = config.check_model(module, device, group)
    world = join(device, group, settings.dims, config.timeout)
    n_ranks, rank = dist.get_world_size(world.group), dist.get_rank(world.group)
    # with several pipelines side by side, all of them follow the first's choices
    agreeing = None if world.several_pipelines else world.group
    cut = _agree_on_cut(module, config, sample, n_ranks, device, agreeing)
    recipe = _recipe(config, settings, world, cut, device)
    if recipe.compile is not None and cut.source.splits_backward:
        warn_eager_training(cut.source.name)
    placement = RankPlacement(tuple(cut.balance), rank, n_ranks, world.group, cut.source.layout())
    built = build_stages(module, settings.skips, placement, recipe)
    precision = Precision(
        settings.autocast,
        device,
        _found_inf_groups(world, n_ranks),
        config.timeout,
        placement.stages[0],
    )
    recorder = Recorder(rank) if config.trace else None
    runner = StepRunner(
        placement,
        built,
        _named_parameters(built),
        _step_schedules(config, settings, cut, placement, built, n_ranks),
        recipe,
        loss_reduction=config.loss_reduction,
        timeout=config.timeout,
        local_pipes=config.local_pipes,
        bucket_bytes=settings.dims.bucket_bytes,
        recorder=recorder,
        overlap_stages=overlaps_stages(
            config.overlap_stages, cut.source.name, device, len(placement.stages)
        ),
    )
    return Assembly(
        device, settings, world, rank, n_ranks, cut, placement, built, precision, runner, recorder
    )


def _agree_on_cut(
    module: nn.Sequential,
    config: PipelineConfig,
    sample: Batch | None,
    n_ranks: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> Cut:
    """``schedule="auto"``'s choice, or the given schedule with ``balance`` (measured on the
    first rank of ``group`` when None), checked against each other."""
    source, chunks, balance = config.schedule_source(), config.microbatches(), config.balance
    choice = None
    if config.auto:
        choice = agreed_choice(
            module,
            sample,
            n_ranks=n_ranks,
            chunks=config.chunks,
            checkpoint=str(config.checkpoint),  # a mode's name: check_auto refuses Layers
            memory_budget=config.memory_budget,
            device=device,
            group=group,
        )
        source, chunks, balance = ScheduleSource.of(choice.schedule), choice.chunks, choice.balance
    parts = source.parts(n_ranks)
    if balance is None:
        if parts == 1:
            balance = [len(module)]
        else:
            balance = agreed_balance(module, parts, sample, device=device, group=group)
    checked = check_balance(len(module), balance)
    if not checked:
        raise ValueError("Pipeline needs at least one layer: layers is empty")
    source.check(len(checked), n_ranks, chunks)
    return Cut(source, chunks, checked, choice)


def _recipe(
    config: PipelineConfig,
    settings: ModelSettings,
    world: World,
    cut: Cut,
    device: torch.device,
) -> StageRecipe:
    """How this rank builds its stages and what they run with."""
    return StageRecipe(
        device=device,
        chunks=cut.chunks,
        checkpoint=config.checkpoint,
        loss_fn=config.loss_fn,
        autocast=settings.autocast,
        deferred_batch_norm=config.deferred_batch_norm,
        seed=config.seed,
        sharding=settings.dims.sharding,
        replicas=world.replicas,
        tensor_plan=settings.dims.tensor_plan,
        mesh=world.mesh,
        loss_parallel=settings.dims.loss_parallel,
        compile=settings.compile,
        split_backward=cut.source.splits_backward,
        seq_chunks=settings.seq_chunks,
    )


def _found_inf_groups(world: World, n_ranks: int) -> list[dist.ProcessGroup | None]:
    """The groups a step's found-inf flag is reduced over: the pipeline's, its replicas' and
    its tensor ranks', where there are several."""
    groups: list[dist.ProcessGroup | None] = [world.group] if n_ranks > 1 else []
    groups += [world.replicas.group] if world.replicas is not None else []
    groups += [world.mesh.group("tensor")] if world.mesh is not None else []
    return groups


def _named_parameters(built: BuiltStages) -> dict[str, nn.Parameter]:
    """This rank's parameters by their names in the whole model, every name of a shared one."""
    return {
        name: parameter
        for prefix, layer in built.layers.items()
        for name, parameter in layer.named_parameters(prefix=prefix, remove_duplicate=False)
    }


def _step_schedules(
    config: PipelineConfig,
    settings: ModelSettings,
    cut: Cut,
    placement: RankPlacement,
    built: BuiltStages,
    n_ranks: int,
) -> StepSchedules:
    """Where the schedule of each step comes from (``gpipe.engine.step_schedule``)."""
    return StepSchedules(
        cut.source,
        n_ranks,
        placement.stage_to_rank,
        built.skip_layout.routes,
        config.checkpoint,
        settings.seq_chunks.chunks if settings.seq_chunks is not None else 1,
    )
