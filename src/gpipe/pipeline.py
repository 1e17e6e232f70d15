"""Pipeline: one stage per process over torch.distributed, for models that need many devices.

Every rank runs the same script. Each holds and initializes only its own partition, runs its
program of the schedule, and exchanges boundary tensors with its neighbours point-to-point.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from time import perf_counter
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.comm.distributed import DistributedTransport
from gpipe.comm.named_pipes import open_pipes
from gpipe.comm.payload import tensors_of, with_tensors
from gpipe.errors import StageError
from gpipe.parallel.replicas import GradientBuckets, Replicas, check_bucket_bytes
from gpipe.parallel.ties import TiedGradients, find_ties, untie
from gpipe.parallel.ties import counted as counted_once
from gpipe.planning.balancing import balance_by_time
from gpipe.runtime.batchnorm import (
    commit_deferred_batch_norm,
    convert_deferred_batch_norm,
    discard_deferred_batch_norm,
)
from gpipe.runtime.executor import StepData, run_program
from gpipe.runtime.loss_scaling import unscale_
from gpipe.runtime.microbatch import (
    Batch,
    check_chunks,
    check_payload,
    gather_payload,
    payload_to,
    scatter_payload,
    split_sizes,
)
from gpipe.runtime.partitions import (
    as_sequential,
    check_balance,
    even_balance,
    materialize,
    stage_bounds,
)
from gpipe.runtime.recompute import (
    check_autocast,
    check_checkpoint,
    recomputed_layers,
    should_checkpoint,
)
from gpipe.runtime.stage import NO_TARGET, LossFn, Stage
from gpipe.runtime.timeline import Event, Recorder, merge
from gpipe.schedules import (
    Action,
    Kind,
    Schedule,
    add_recompute,
    add_skips,
    forward_only,
    get_schedule,
)
from gpipe.skip.layout import SkipLayout
from gpipe.skip.skippable import find_skips

__all__ = [
    "Pipeline",
    "StepResult",
    "StepTimes",
    "agreed_balance",
    "finish_process_group",
    "backend_for",
    "init_process_group",
]

LOSS_REDUCTIONS = ("mean", "sum")


def _unscaled(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` ran since the last ``scaler.update``."""
    from torch.amp.grad_scaler import OptState

    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    return state.get("stage") is OptState.UNSCALED


class StepResult(NamedTuple):
    """What ``step(..., return_outputs=True)`` returns: the loss on every rank; on the last
    stage the mini-batch's outputs (detached, micro-batches gathered in order) and each
    micro-batch's loss, as ``loss_fn`` gave it; None elsewhere."""

    loss: Tensor
    outputs: Batch | None
    losses: list[Tensor] | None


@dataclass(frozen=True)
class StepTimes:
    """Where this rank's time went in the last ``step``: ``busy`` seconds of forward and
    backward out of ``total``; the rest is the bubble plus communication. With replicas,
    ``allreduce_wait`` seconds went to waiting for the gradients' sums after the last
    backward, of ``allreduce_buckets`` buckets of which ``allreduce_early`` had started
    during it."""

    total: float
    busy: float
    allreduce_wait: float = 0.0
    allreduce_buckets: int = 0
    allreduce_early: int = 0

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy / self.total if self.total > 0 else 0.0


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_process_group(device: torch.device, timeout: float = 60.0) -> None:
    """Join the default process group from torchrun's environment, if not joined yet:
    NCCL for CUDA devices, gloo otherwise."""
    if dist.is_initialized():
        return
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [v for v in needed if v not in os.environ]
    if missing:
        raise RuntimeError(
            "Pipeline needs a process group and found no torchrun environment (missing "
            f"{', '.join(missing)}): run under torchrun or gpipe.launch, or call "
            "torch.distributed.init_process_group first"
        )
    dist.init_process_group(
        backend_for(device), timeout=datetime.timedelta(seconds=max(timeout, 60.0))
    )


def backend_for(device: torch.device) -> str:
    """The process group's backend for ``device`` (and, on CUDA, make it the current one):
    gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo beside it for the few small CPU
    tensors the bookkeeping exchanges (row counts, flags, timings), which NCCL refuses."""
    if device.type != "cuda":
        return "gloo"
    torch.cuda.set_device(device)
    return "cpu:gloo,cuda:nccl"


def finish_process_group() -> None:
    """Leave the default process group cleanly before the process exits.

    A rank that exits while its peer is still reading the last collective's bytes can make
    gloo abort the peer; waiting at a barrier and destroying the group first prevents that.
    A peer that has failed already does not make this one fail too.
    """
    if not dist.is_initialized():
        return
    # A peer that is gone already (DistBackendError is a RuntimeError) leaves nothing to wait for.
    with contextlib.suppress(RuntimeError):
        dist.barrier()
    dist.destroy_process_group()


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
    decision: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            if sample is None:
                decision = [even_balance(len(module), parts)]
            else:
                decision = [balance_by_time(parts, module, sample, timeout=timeout, device=device)]
        except Exception as exc:  # every rank must hear of it, or the others would wait
            decision = [f"{type(exc).__name__}: {exc}"]
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(decision, src=source, group=group)
    if isinstance(decision[0], str):
        raise ValueError(f"balancing by time on rank 0 failed: {decision[0]}")
    return list(decision[0])


class Pipeline(nn.Module):
    """This rank's stage of a pipeline over ``layers``; ``step`` trains on one mini-batch.

    Args:
        layers: the whole model as an ``nn.Sequential`` or list of layers, identical on every
            rank. Build it on the meta device to allocate only this rank's layers: they are then
            initialized by ``reset_parameters`` from ``seed`` and the layer's index, so the
            weights do not depend on the number of stages.
        balance: layers per stage, one stage per process. ``None`` measures each layer's
            forward and backward time on ``sample`` and cuts where the slowest stage is
            fastest (``gpipe.planning.balancing.balance_by_time``, on the first rank, told
            to the others);
            without a sample, as even as possible by layer count.
        sample: one micro-batch of the model's input, for ``balance=None``; read on the first
            rank only, so the others may pass None.
        chunks: micro-batches per mini-batch.
        checkpoint: re-materialization, ``"always"``, ``"except_last"`` or ``"never"``; or
            ``gpipe.runtime.recompute.Layers(every=k)`` / ``Layers(select=...)`` to recompute some
            layers of every stage and keep the others' activations.
        schedule: the schedule's name (``"gpipe"``).
        loss_fn: ``loss_fn(output, target) -> scalar``, evaluated on the last stage.
        loss_reduction: ``"mean"`` if ``loss_fn`` averages over the batch (each micro-batch's
            loss is then weighted by its share of the rows), ``"sum"`` if it adds up.
        device: this rank's device (default: ``cuda:LOCAL_RANK`` if CUDA is available, else CPU).
        group: the process group of the pipeline's ranks (default: the whole world).
        data_parallel: D replicas of the pipeline side by side over a world of D x K
            processes (rank = position in the pipeline x D + replica: a stage's replicas are
            neighbours, on one machine where they fit); each trains on its own shard
            (``gpipe.parallel.replicas.shard``), gradients are summed across replicas in
            buckets while
            the last backward still runs, and ``step`` returns the loss of the union of the
            shards, weighted by rows.
        bucket_bytes: the size of those buckets; by default a quarter of the stage's
            gradients, between 1 MiB and 25 MiB (``gpipe.parallel.replicas.bucket_size``), so that
            most of them start before the last backward ends.
        deferred_batch_norm: replace every BatchNorm by
            ``gpipe.runtime.batchnorm.DeferredBatchNorm``,
            so running statistics are tracked once per mini-batch, from all its micro-batches.
        autocast: a dtype (``torch.bfloat16``, ``torch.float16``) each stage's forward and
            recomputation run under, as ``torch.autocast`` on this rank's device (a caller's
            ``torch.autocast`` around ``step`` works too, recomputation included).
        local_pipes: on CPU, exchange tensors with the processes of this machine through
            pipes rather than gloo's loopback TCP (far cheaper per message); gloo still
            carries collectives and the traffic with other machines.
        seed: seed of the initialization of layers built on the meta device.
        timeout: seconds a stage waits for a neighbour before it raises StageError.
        trace: record what this rank runs when, for ``timeline`` (``self.recorder``).

    Layers may be ``gpipe.skip.skippable``: a skip that crosses stages is sent straight from
    the stage that stashes it to the stage that pops it, and its gradient comes back the same
    way. Layers of different stages may share a parameter (one ``nn.Parameter`` in both, as
    a tied embedding and output projection): each stage then holds a copy, and when
    ``step`` returns, every copy's gradient is the sum over all of them, so the optimizer
    keeps them equal (``self.ties`` lists them).
    """

    def __init__(
        self,
        layers: nn.Sequential | Iterable[nn.Module],
        balance: list[int] | None = None,
        *,
        sample: Batch | None = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        schedule: str = "gpipe",
        loss_fn: LossFn | None = None,
        loss_reduction: str = "mean",
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        data_parallel: int = 1,
        bucket_bytes: float | None = None,
        deferred_batch_norm: bool = False,
        autocast: torch.dtype | None = None,
        local_pipes: bool = True,
        seed: int = 0,
        timeout: float = 60.0,
        trace: bool = False,
    ) -> None:
        super().__init__()
        chunks = check_chunks(chunks)
        self.checkpoint = check_checkpoint(checkpoint)
        self._schedule_fn = get_schedule(schedule)
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        module = as_sequential(layers)
        skips = find_skips(module)  # a bad skip is refused before any process group work
        self.device = _default_device() if device is None else torch.device(device)
        self.autocast = check_autocast(autocast, self.device)
        if (
            isinstance(data_parallel, bool)
            or not isinstance(data_parallel, int)
            or data_parallel < 1
        ):
            raise ValueError(f"data_parallel must be a positive integer, got {data_parallel!r}")
        bucket_bytes = check_bucket_bytes(bucket_bytes)
        if data_parallel != 1 and group is not None:
            raise ValueError(
                "pass group or data_parallel, not both: data_parallel lays its pipelines out "
                "over the whole world"
            )
        if group is None:
            init_process_group(self.device, timeout)
        self.replicas: Replicas | None = None
        if data_parallel != 1:
            self.replicas = Replicas.create(data_parallel, float(timeout))
            group = self.replicas.pipeline_group
        self.group = group
        self.n_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if balance is None:
            if self.n_ranks == 1:
                balance = [len(module)]
            else:
                balance = agreed_balance(
                    module, self.n_ranks, sample, device=self.device, group=group
                )
        self.balance = check_balance(len(module), balance)
        if not self.balance:
            raise ValueError("Pipeline needs at least one layer: layers is empty")
        self.n_stages = len(self.balance)
        if self.n_stages % self.n_ranks:
            raise ValueError(
                f"balance has {self.n_stages} partitions but the process group has "
                f"{self.n_ranks} processes; Pipeline runs one stage per process, or the "
                "same number of stages on each with schedule='interleaved'"
            )
        if self.n_stages != self.n_ranks and schedule != "interleaved":
            raise ValueError(
                f"balance has {self.n_stages} partitions for {self.n_ranks} processes: "
                f"several stages per process need schedule='interleaved', not {schedule!r}"
            )
        self.chunks = chunks
        self.deferred_batch_norm = deferred_batch_norm
        self.skip_layout = SkipLayout(skips, self.balance)
        self.schedule_name = schedule
        self.loss_fn = loss_fn
        self.loss_reduction = loss_reduction
        self.timeout = float(timeout)

        recomputed = recomputed_layers(self.checkpoint, module, self.balance)
        # a parameter that layers of several stages share: a copy on each, gradients summed
        # over the copies at the end of every step (so they stay equal)
        self.ties = find_ties(module, self.balance)
        untie(module, self.ties)
        # this rank's stages: r, r + K, r + 2K, ... (one, unless interleaved)
        self.stages = tuple(range(self.rank, self.n_stages, self.n_ranks))
        self.stage_index = self.stages[0]
        children = list(module.named_children())
        self._stages: dict[int, Stage] = {}
        for stage in self.stages:
            start, stop = stage_bounds(self.balance)[stage]
            for index in range(start, stop):
                name, layer = children[index]
                if deferred_batch_norm:
                    layer = convert_deferred_batch_norm(layer, chunks, auto_commit=False)
                self.add_module(name, materialize(layer, index, self.device, seed))
            partition = nn.Sequential(
                OrderedDict((name, self._modules[name]) for name, _ in children[start:stop])
            )
            self._stages[stage] = Stage(
                stage,
                self.n_stages,
                partition,
                self.device,
                loss_fn,
                ports=self.skip_layout.ports(stage),
                autocast=self.autocast,
                recomputed_layers=recomputed[stage],
                payloads=True,
            )
        # where the host cannot read the tensors cheaply, their descriptions go on a gloo group
        envelopes = None
        if self.device.type != "cpu" and self.n_ranks > 1:
            ranks = [self._global(r) for r in range(self.n_ranks)]
            envelopes = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self._transport = DistributedTransport(
            [s % self.n_ranks for s in range(self.n_stages)],
            self.device,
            group,
            self.timeout,
            envelope_group=envelopes,
        )
        if local_pipes and self.device.type == "cpu" and self.n_ranks > 1:
            receives, sends = self._transport.channels(self.stages, self.skip_layout.routes)
            self._transport.use_pipes(open_pipes(receives, sends, group))
        self.last_step: StepTimes | None = None
        self.recorder = Recorder(self.rank) if trace else None
        self._buckets: dict[int, GradientBuckets] = {}
        if self.replicas is not None:
            for stage, runner in self._stages.items():
                params = list(runner.module.parameters())
                self._buckets[stage] = GradientBuckets(params, self.replicas, stage, bucket_bytes)
        self._rows_all = 0  # rows of the step over every replica
        self._tied = TiedGradients(
            self.ties,
            dict(self.named_parameters(remove_duplicate=False)),
            self.stages,
            self.rank_of,
            self._global,
            self.timeout,
        )
        self._tied.broadcast()  # each rank built its own copy: start them equal

    @property
    def is_first(self) -> bool:
        return 0 in self._stages

    @property
    def is_last(self) -> bool:
        return self.n_stages - 1 in self._stages

    def stage_of(self, layer: int) -> int:
        """The stage that holds layer ``layer`` of the whole model."""
        bounds = stage_bounds(self.balance)
        if not 0 <= layer < bounds[-1][1]:
            raise IndexError(f"layer must be in [0, {bounds[-1][1]}), got {layer}")
        return next(s for s, (start, stop) in enumerate(bounds) if start <= layer < stop)

    def rank_of(self, stage: int) -> int:
        """The rank (in the pipeline's group) that holds ``stage``."""
        return stage % self.n_ranks

    def global_rank(self, rank: int) -> int:
        """The rank in the world of rank ``rank`` of this pipeline's group."""
        return self._global(rank)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _recomputed(self, n_microbatches: int) -> frozenset[int]:
        """The micro-batches a training step re-materializes."""
        mode = self.checkpoint if self.training else "never"
        return frozenset(
            i for i in range(n_microbatches) if should_checkpoint(mode, i, n_microbatches)
        )

    def schedule_for(self, n_microbatches: int) -> Schedule:
        """The schedule a step with ``n_microbatches`` micro-batches runs."""
        if self.n_stages == self.n_ranks:
            schedule = self._schedule_fn(self.n_stages, n_microbatches)
        else:
            schedule = self._schedule_fn(self.n_stages, n_microbatches, self.n_ranks)  # type: ignore[call-arg]
        schedule = add_skips(schedule, self.skip_layout.routes)
        return add_recompute(schedule, self._recomputed(n_microbatches))

    def _forward_schedule(self, n_microbatches: int) -> Schedule:
        schedule = forward_only(self.n_stages, n_microbatches, self.n_ranks)
        return add_skips(schedule, self.skip_layout.routes)

    def _broadcast(self, value: Tensor, src_rank: int, what: str) -> Tensor:
        """Broadcast from ``src_rank``; losing it ends in StageError rather than a hang."""
        src_stage = src_rank  # its first stage
        work = dist.broadcast(value, src=self._global(src_rank), group=self.group, async_op=True)
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise StageError(
                self.stage_index, f"lost stage {src_stage} while waiting for {what} ({exc})"
            ) from exc
        return value

    def _start(self, inputs: Any) -> tuple[int, int, Batch | None]:
        """The mini-batch's row and micro-batch counts, and on the first rank its inputs.

        The first rank reads them off the inputs; every other rank off the envelope of its
        first message, which every step's program begins by receiving, so the pipeline needs
        no collective for them. Replicas share their row counts (one small all-reduce), and a
        traced step aligns the ranks' clocks with a broadcast."""
        batch = None
        if self.recorder is not None:
            if self.n_ranks > 1:  # align the ranks' clocks: a step starts here everywhere
                self._broadcast(torch.zeros(1, device=self.device), 0, "the start of the step")
            self.recorder.step()
        if self.is_first:
            try:
                rows = check_payload(inputs, "inputs")
            except (TypeError, ValueError):
                if self.replicas is not None:  # the other replicas stop too, not time out
                    with contextlib.suppress(ValueError, StageError):
                        self.replicas.rows(-1, self.stage_index)
                raise
            batch = payload_to(inputs, self.device)
            m = len(split_sizes(rows, self.chunks))
        else:
            first = self.stages[0]
            m, rows = self._transport.peek(first - 1, first, Kind.RECV_F)
        self._transport.info = (m, rows)
        self._rows_all = rows
        if self.replicas is not None:
            self._rows_all = sum(self.replicas.rows(rows, self.stage_index))
        return rows, m, batch

    def _run(self, schedule: Schedule, data: StepData) -> float:
        """Run this rank's program; returns the seconds spent computing (forward, backward)."""
        busy = 0.0
        recorder = self.recorder
        program = schedule.programs[self.rank]
        self._transport.begin(schedule.programs, self.rank)
        arm, launch = self._gradient_points(program) if self._buckets else ({}, {})

        def before(action: Action) -> None:
            if action in arm:
                self._buckets[action.stage].arm()

        def timed(action: Action, start: float, end: float) -> None:
            nonlocal busy
            if action.is_compute:
                busy += end - start
            if action in launch:
                self._buckets[action.stage].launch()
            if recorder is not None:
                recorder.on_action(action, start, end)

        try:
            run_program(
                program,
                self._stages,
                self._transport,
                data,
                on_action=timed,
                before_action=before if arm else None,
            )
        except BaseException:
            for stage in self._stages.values():
                stage.clear()
                discard_deferred_batch_norm(stage.module)
            for buckets in self._buckets.values():
                buckets.reset()
            raise
        if self.deferred_batch_norm and self.training:
            modules = [stage.module for stage in self._stages.values()]
            if self.replicas is not None:
                self.replicas.merge_batch_norm(modules, self.stage_index)
            for module in modules:
                commit_deferred_batch_norm(module)
        return busy

    @staticmethod
    def _gradient_points(program: tuple[Action, ...]) -> tuple[set[Action], set[Action]]:
        """Where each stage's gradients become final: the actions before which its buckets
        arm (its last backward, when whole: one autograd pass, so each gradient is added to
        once), and the ones after which the rest start (its last backward or, split, its
        last W, which may add to a gradient in several passes)."""
        last: dict[int, Action] = {}
        for a in program:
            if a.kind in (Kind.BACKWARD, Kind.WEIGHT):
                last[a.stage] = a
        arm = {a for a in last.values() if a.kind is Kind.BACKWARD}
        return arm, set(last.values())

    def _sum_gradients(self) -> tuple[float, int, int]:
        """Wait for the replicas' gradient sums; returns seconds waited, buckets, early."""
        waited, buckets, early = 0.0, 0, 0
        for grads in self._buckets.values():
            seconds, started = grads.finish()
            waited += seconds
            buckets += len(grads.buckets)
            early += started
        return waited, buckets, early

    def _targets(
        self,
        targets: Any,
        rows: int,
        sizes: list[int],
        data: StepData,
        scale: float = 1.0,
        counts: Any = None,
    ) -> None:
        """Give the last stage each micro-batch's target and the weight of its loss (times a
        loss scale). Without targets, ``loss_fn`` takes the outputs alone."""
        if targets is None:
            data.targets = [NO_TARGET] * len(sizes)
        else:
            n = check_payload(targets, "targets")
            if n != rows:
                raise ValueError(f"targets have {n} rows but inputs have {rows}")
            data.targets = scatter_payload(payload_to(targets, self.device), self.chunks)
        if self.loss_reduction == "sum":
            if counts is not None:
                raise ValueError(
                    "counts= weights the micro-batches' mean losses; with "
                    "loss_reduction='sum' the losses add up as they are"
                )
            data.loss_weights = [scale] * len(sizes)
            return
        if counts is None:  # every replica's rows: the loss is that of their union
            parts, total = [float(n) for n in sizes], float(self._rows_all)
        else:
            parts, total = self._counted(counts, rows, sizes)
        data.loss_weights = [scale * part / total for part in parts]

    def _counted(self, counts: Any, rows: int, sizes: list[int]) -> tuple[list[float], float]:
        """Each micro-batch's share of ``counts`` (one per row), and their total over the
        replicas."""
        given = torch.as_tensor(counts, dtype=torch.float64).detach().cpu()
        parts: list[float] = []
        problem = None
        if given.dim() != 1 or given.numel() != rows:
            problem = (
                f"counts must hold one count per row of the mini-batch ({rows}), got shape "
                f"{tuple(given.shape)}"
            )
        elif (given < 0).any():
            row = int((given < 0).nonzero()[0])
            problem = f"counts must not be negative, got {given[row].item():g} for row {row}"
        else:
            parts = [float(part.sum()) for part in given.split(sizes)]
            empty = [i for i, part in enumerate(parts) if part == 0]
            if empty:
                problem = (
                    f"counts are 0 for every row of micro-batch {empty[0]}: a mean over "
                    "nothing has no weight; drop such rows or use more of them per micro-batch"
                )
        # a replica with bad counts sends NaN, so that every replica stops, not times out
        total = torch.tensor(
            [math.nan if problem else sum(parts)], dtype=torch.float64, device=self.device
        )
        if self.replicas is not None:
            self.replicas.sum(total, "the counts", self.stage_index)
        if problem is not None:
            raise ValueError(problem)
        if math.isnan(float(total)):
            raise ValueError("another replica refused its counts this step (its error says why)")
        return parts, float(total)

    def _loss(self, data: StepData, m: int) -> Tensor:
        """The mini-batch loss, computed on the last stage and known to every rank."""
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.is_last:
            loss += sum(data.losses[i].double() for i in range(m))
        if self.n_ranks > 1:
            self._broadcast(loss, self.rank_of(self.n_stages - 1), "the loss")
        if self.replicas is not None:
            self.replicas.sum(loss, "the loss", self.stage_index)
        return loss

    def step(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        scaler: torch.amp.GradScaler | None = None,
        return_outputs: bool = False,
        counts: Any = None,
    ) -> Tensor | StepResult:
        """Forward and backward of one mini-batch; gradients accumulate in ``.grad``.

        ``inputs`` are read on the first stage and ``targets`` on the last (other ranks may
        pass None); either may be any payload (a dict, a dataclass ...: ``gpipe.runtime.microbatch``
        says which leaves are split into micro-batches). Without targets the last stage
        computes ``loss_fn(outputs)``, for models that compute their own loss. ``counts``
        (last stage, ``loss_reduction="mean"``) gives each row's weight in the mean, such as
        its number of valid tokens when ``loss_fn`` averages over tokens: each micro-batch's
        loss then weighs by its share of the counts, not of the rows, which keeps the step
        exact when padding differs between micro-batches. Returns the mini-batch loss, the
        same on every rank; with
        ``return_outputs``, a ``StepResult`` that also holds the last stage's outputs for
        the whole mini-batch and each micro-batch's loss (None on other ranks). With a
        ``scaler`` (``torch.amp.GradScaler``, for float16) the loss is scaled on the last
        stage; then ``unscale_``, ``scaler.step`` and ``scaler.update`` as usual.
        """
        self._need_loss_fn("step", return_outputs)
        scale = self._loss_scale(scaler)
        started = perf_counter()
        rows, m, batch = self._start(inputs)
        sizes = split_sizes(rows, self.chunks)
        schedule = self.schedule_for(m)
        data = StepData(
            n_stages=self.n_stages,
            build_graph=True,
            checkpoint=schedule.recomputed.__contains__,
            keep_outputs=return_outputs,
        )
        if batch is not None:
            data.inputs = scatter_payload(batch, self.chunks)
        if self.is_last:
            self._targets(targets, rows, sizes, data, scale, counts)
        busy = self._run(schedule, data)
        try:
            loss = self._loss(data, m) / scale
            waited, buckets, early = self._sum_gradients()
            self._tied.sum()
        except BaseException:
            for gradient_buckets in self._buckets.values():
                gradient_buckets.reset()  # a retried step must not take this one's sums
            raise
        self.last_step = StepTimes(perf_counter() - started, busy, waited, buckets, early)
        return self._result(loss, data, m) if return_outputs else loss

    def _need_loss_fn(self, method: str, return_outputs: bool) -> None:
        if self.loss_fn is not None:
            return
        hint = (
            "; for the outputs alone, call the pipeline (pipe(inputs)), which runs the "
            "forward without a loss"
            if return_outputs or method == "evaluate"
            else ""
        )
        raise ValueError(
            f"{method}() needs a loss_fn; pass loss_fn= to Pipeline (loss_fn(outputs, "
            f"targets), or loss_fn(outputs) when the model computes its own loss){hint}"
        )

    def _loss_scale(self, scaler: torch.amp.GradScaler | None) -> float:
        if scaler is None or not scaler.is_enabled():
            return 1.0
        if self.autocast is torch.bfloat16:
            warnings.warn(
                "scaler= with autocast=torch.bfloat16: bfloat16 has float32's range, so loss "
                "scaling only costs time",
                stacklevel=3,
            )
        # scale() sets the scaler up on this rank's device, as unscale_ will need everywhere
        return float(scaler.scale(torch.ones((), device=self.device)))

    def _result(self, loss: Tensor, data: StepData, m: int) -> StepResult:
        """The step's loss, and on the last stage its outputs and per-micro-batch losses."""
        if not self.is_last:
            return StepResult(loss, None, None)
        assert data.loss_weights is not None
        outputs = gather_payload([data.outputs[i] for i in range(m)])
        outputs = with_tensors(outputs, [t.detach() for t in tensors_of(outputs)])
        losses = [
            (data.losses[i] / data.loss_weights[i]).detach() if data.loss_weights[i] else None
            for i in range(m)
        ]
        return StepResult(loss, outputs, losses)  # type: ignore[arg-type]

    def unscale_(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
        """``scaler.unscale_(optimizer)`` with the found-inf flag reduced over every stage and
        replica, so that every rank's ``scaler.step`` steps or skips alike; returns whether
        it will skip. Once per step, after ``step`` and before clipping."""
        groups: list[dist.ProcessGroup | None] = [self.group] if self.n_ranks > 1 else []
        if self.replicas is not None:
            groups.append(self.replicas.group)
        return unscale_(scaler, optimizer, groups)

    @torch.no_grad()
    def evaluate(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        return_outputs: bool = False,
        counts: Any = None,
    ) -> Tensor | StepResult:
        """The mini-batch loss without gradients or kept activations, on every rank (with
        ``return_outputs``, a ``StepResult``, as ``step``'s)."""
        self._need_loss_fn("evaluate", return_outputs)
        rows, m, batch = self._start(inputs)
        sizes = split_sizes(rows, self.chunks)
        data = StepData(n_stages=self.n_stages, build_graph=False, keep_outputs=return_outputs)
        if batch is not None:
            data.inputs = scatter_payload(batch, self.chunks)
        if self.is_last:
            self._targets(targets, rows, sizes, data, counts=counts)
        self._run(self._forward_schedule(m), data)
        loss = self._loss(data, m)
        return self._result(loss, data, m) if return_outputs else loss

    @torch.no_grad()
    def forward(self, inputs: Any = None) -> Any:
        """Inference over micro-batches; the output on the last stage, None elsewhere."""
        _, m, batch = self._start(inputs)
        data = StepData(n_stages=self.n_stages, build_graph=False)
        if batch is not None:
            data.inputs = scatter_payload(batch, self.chunks)
        self._run(self._forward_schedule(m), data)
        if not self.is_last:
            return None
        return gather_payload([data.outputs[i] for i in range(m)])

    def timeline(self) -> list[Event]:
        """What every rank ran in the last ``step``, ``evaluate`` or forward, merged.

        Collective: every rank of the pipeline must call it; each gets the whole timeline.
        """
        if self.recorder is None:
            raise RuntimeError("timeline() needs a recording; pass trace=True to Pipeline")
        gathered: list[list[Event] | None] = [None] * self.n_ranks
        dist.all_gather_object(gathered, self.recorder.events(), group=self.group)
        return merge([events or [] for events in gathered])

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        parameters: Iterable[nn.Parameter] | None = None,
        *,
        scaler: torch.amp.GradScaler | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> Tensor:
        """Clip the gradients of all stages by their global norm; returns that norm.

        ``parameters`` (default: all of this rank's, a parameter that stages share counted
        once) are those counted in the norm; when you pass them, leave out the copies of a
        weight tied by hand to another stage's so that it counts once. Every gradient of
        this rank is scaled. With a ``scaler`` (and its ``optimizer``) the gradients are
        unscaled first, if ``unscale_`` has not done it yet this step.
        """
        if scaler is not None:
            if optimizer is None:
                raise ValueError("clip_grad_norm_(scaler=...) needs optimizer= to unscale")
            if not _unscaled(scaler, optimizer):
                self.unscale_(scaler, optimizer)
        counted = (
            counted_once(self.ties, dict(self.named_parameters()))
            if parameters is None
            else parameters
        )
        grads = [p.grad.detach() for p in counted if p.grad is not None]
        if norm_type == float("inf"):
            local = max((g.abs().max() for g in grads), default=torch.tensor(0.0))
            total = local.to(self.device, torch.float64).reshape(1)
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.group)
            norm = total[0]
        else:
            local = sum(
                (g.double().norm(norm_type) ** norm_type for g in grads),
                torch.zeros((), dtype=torch.float64, device=self.device),
            )
            total = local.reshape(1).clone()
            dist.all_reduce(total, group=self.group)
            norm = total[0] ** (1.0 / norm_type)
        scale = max_norm / (float(norm) + 1e-6)
        if scale < 1.0:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    def extra_repr(self) -> str:
        return (
            f"stages={list(self.stages)} of {self.n_stages}, balance={self.balance}, "
            f"chunks={self.chunks}, checkpoint={self.checkpoint!r}, "
            f"schedule={self.schedule_name!r}, device={self.device}"
        )
