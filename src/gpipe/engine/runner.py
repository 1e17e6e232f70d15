"""The step runner: one step of this rank's stages, from its share of a mini-batch to the loss.

Its program of the schedule runs over the transport, and the loss, outputs and times come out,
known to every rank that needs them; with replicas, gradients are summed over them while the
last backward still runs. A call that fails on this rank tells its peers (an abort on every
channel it sends on), so that those waiting for it raise at once and go on to the next call
with it, rather than at their timeout.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import perf_counter
from typing import Any, NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.comm.distributed import DistributedTransport
from gpipe.comm.named_pipes import open_pipes
from gpipe.comm.payload import tensors_of, with_tensors
from gpipe.comm.process_group import bounded_wait
from gpipe.engine.loss_weights import loss_weights, scatter_targets
from gpipe.engine.placement import BuiltStages, RankPlacement, StageRecipe
from gpipe.engine.presplit import Presplit, first_parts, given_targets, later_sizes
from gpipe.engine.sequence_units import SequenceUnits
from gpipe.engine.step_schedule import StepSchedules
from gpipe.errors import PipelineError, StageError, first_line
from gpipe.parallel.replicas import GradientBuckets
from gpipe.parallel.sharding import ShardedGradients
from gpipe.parallel.ties import TiedGradients
from gpipe.runtime.batchnorm import commit_deferred_batch_norm
from gpipe.runtime.executor import StepData, run_program
from gpipe.runtime.failed_step import forget_failed_step
from gpipe.runtime.microbatch import (
    Batch,
    check_payload,
    gather_payload,
)
from gpipe.runtime.stage_streams import StageStreams
from gpipe.runtime.timeline import Recorder
from gpipe.schedules import Action, Kind, Schedule

__all__ = ["StepResult", "StepRunner", "StepTimes", "connect"]

_T = TypeVar("_T")

# where the last stage puts each micro-batch's outputs, made from the micro-batches' rows
OutputsFor = Callable[[list[int]], dict[int, Any]]


class StepResult(NamedTuple):
    """What ``step(..., return_outputs=True)`` returns: the loss on every rank; on the last
    stage the mini-batch's outputs (detached, micro-batches gathered in order; with
    ``microbatches=``, the list of each one's, which may differ in length) and each
    micro-batch's loss, as ``loss_fn`` gave it; None elsewhere."""

    loss: Tensor
    outputs: Batch | list[Any] | None
    losses: list[Tensor | None] | None


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


def connect(
    placement: RankPlacement,
    routes: tuple[tuple[int, int], ...],
    device: torch.device,
    timeout: float,
    local_pipes: bool,
) -> DistributedTransport:
    """The point-to-point transport of this rank's stages (and the skips ``routes`` between
    stages); on CPU with ``local_pipes``, through pipes to the processes of this machine."""
    # where the host cannot read the tensors cheaply, their descriptions go on a gloo group
    envelopes = None
    if device.type != "cpu" and placement.n_ranks > 1:
        ranks = [placement.global_rank(r) for r in range(placement.n_ranks)]
        envelopes = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    transport = DistributedTransport(
        [placement.rank_of(s) for s in range(placement.n_stages)],
        device,
        placement.group,
        timeout,
        envelope_group=envelopes,
    )
    if local_pipes and device.type == "cpu" and placement.n_ranks > 1:
        receives, sends = transport.channels(placement.stages, routes)
        transport.use_pipes(open_pipes(receives, sends, placement.group))
    return transport


def _gradient_points(program: tuple[Action, ...]) -> tuple[set[Action], set[Action]]:
    """Where each stage's gradients become final: the actions before which its buckets arm
    (its last backward, when whole: one autograd pass, so each gradient is added to once),
    and the ones after which the rest start (its last backward or, split, its last W, which
    may add to a gradient in several passes)."""
    last: dict[int, Action] = {}
    for a in program:
        if a.kind in (Kind.BACKWARD, Kind.WEIGHT):
            last[a.stage] = a
    arm = {a for a in last.values() if a.kind is Kind.BACKWARD}
    return arm, set(last.values())


_Call = TypeVar("_Call", bound=Callable[..., Any])


def _telling_peers_if_it_fails(method: _Call) -> _Call:
    """A call of the runner (a step, an evaluation, a forward) run under
    ``StepRunner._aborting``: where it fails on this rank, its peers hear of it at once."""

    @functools.wraps(method)
    def call(self: StepRunner, *args: Any, **kwargs: Any) -> Any:
        with self._aborting():
            return method(self, *args, **kwargs)

    return cast(_Call, call)


class StepRunner:
    """Runs this rank's stages through training steps, evaluations and forwards.

    Building it is collective over the pipeline (the transport's groups and pipes, the ties'
    group, and the tied copies made equal). ``params``: this rank's parameters by their names
    in the whole model, copies of tied ones included; ``schedules``: what each kind of step
    runs; ``recipe``: what the stages were built with (their device, ``chunks``, replicas).

    Its public attributes are the step's collaborators, there to be read (and, in tests, one
    replaced): ``transport``, ``replicas``, ``buckets`` (each stage's gradient sums over the
    replicas), ``sharded`` (the stages sharded over them, or None), ``tied``, ``streams``
    (a CUDA stream per stage with ``overlap_stages``, else None) and ``units`` (the
    sub-sequences of ``seq_chunks``, else None)."""

    def __init__(
        self,
        placement: RankPlacement,
        built: BuiltStages,
        params: dict[str, nn.Parameter],
        schedules: StepSchedules,
        recipe: StageRecipe,
        *,
        loss_reduction: str,
        timeout: float,
        local_pipes: bool,
        bucket_bytes: float | None,
        recorder: Recorder | None,
        overlap_stages: bool = False,
    ) -> None:
        self.placement = placement
        self.stages = built.stages
        self.schedules = schedules
        self.device = recipe.device
        self.chunks = recipe.chunks
        self.loss_reduction = loss_reduction
        self.timeout = timeout
        self.replicas = recipe.replicas
        self.deferred_batch_norm = recipe.deferred_batch_norm
        # a training step's micro-batches cut along their sequence (``seq_chunks``), or None
        self.units = (
            None if recipe.seq_chunks is None else SequenceUnits(recipe.seq_chunks, loss_reduction)
        )
        self.recorder = recorder
        # a CUDA stream per stage, so that independent work of this rank's stages overlaps
        self.streams = StageStreams(placement.stages, self.device) if overlap_stages else None
        self.transport = connect(
            placement, built.skip_layout.routes, self.device, timeout, local_pipes
        )
        # where a failed call's abort goes: every channel this rank's stages send on
        self._sends = self.transport.channels(placement.stages, built.skip_layout.routes)[1]
        self._failed: int | None = None  # the stage of this rank whose computation raised
        # each stage's gradients, summed over replicas: in buckets, or by fully_shard's units
        self.buckets: dict[int, GradientBuckets | ShardedGradients] = {}
        self.sharded = built.sharded
        if self.sharded is not None:
            self.buckets.update(self.sharded.gradients)
        elif self.replicas is not None:
            for index, stage in self.stages.items():
                params_ = list(stage.module.parameters())
                self.buckets[index] = GradientBuckets(params_, self.replicas, index, bucket_bytes)
        self._rows_all = 0  # rows of the step over every replica
        self._call = 0  # the number of the call under way (``transport.new_call``)
        self.tied = TiedGradients(
            built.ties,
            params,
            placement.stages,
            placement.rank_of,
            placement.global_rank,
            timeout,
            pipeline_group=placement.group if recipe.mesh is not None else None,
        )
        self.tied.broadcast()  # each rank built its own copy: start them equal

    @property
    def stage_index(self) -> int:
        """This rank's first stage, which its errors name."""
        return self.placement.stages[0]

    # -- the kinds of step ------------------------------------------------------------------
    @_telling_peers_if_it_fails
    def train(
        self,
        inputs: Any,
        targets: Any,
        *,
        scale: float,
        counts: Any,
        keep_outputs: bool,
        training: bool,
        given: Presplit | None = None,
    ) -> tuple[Tensor | StepResult, StepTimes]:
        """Forward and backward of one mini-batch (or of the micro-batches ``given``), with the
        loss scaled by ``scale`` on the last stage; returns the loss (a ``StepResult`` with
        ``keep_outputs``) and the times. ``training``: the modules' mode (in eval mode nothing
        is re-materialized, and deferred BatchNorm commits nothing)."""
        started = perf_counter()
        schedule = None
        if given is not None:  # the user's own micro-batches are on every rank: all refuse
            schedule = self._refused_alike(  # too few, none waits
                lambda: self.schedules.step(len(given.sizes), training, True)
            )
        # a schedule that cannot run a replica's share stops the others' first stages too
        checked: list[Schedule] = []  # built on the first stage, by that check
        needs = None if given else lambda m: checked.append(self.schedules.step(m, training))
        rows, sizes, parts = self._start(inputs, given, needs)
        m = len(sizes)
        if schedule is None:
            schedule = checked[0] if checked else self.schedules.step(m, training)
        n_units = schedule.n_microbatches  # m, or m x seq_chunks sub-sequences
        data = self._data(
            parts if self.units is None else self.units.inputs(parts),
            build_graph=True,
            checkpoint=schedule.recomputed.__contains__,
            keep_outputs=keep_outputs,
        )
        weights: list[float] = []  # with units, the micro-batches' own loss weights
        if self.placement.is_last:
            self._targets(targets, rows, sizes, data, scale, counts, given)
            if self.units is not None:
                weights = self.units.targets(data, counts, sizes)
        busy = self._run(schedule, data, training)
        try:
            loss = self._loss(data, n_units) / scale
            waited, buckets, early = self._sum_gradients()
            self.tied.sum()
        except BaseException:
            self._forget_sums()  # a retried step must not take this one's sums
            raise
        times = StepTimes(perf_counter() - started, busy, waited, buckets, early)
        if self.units is not None and self.placement.is_last:
            self.units.join(data, m, weights)
        return self._answer(loss, data, m, keep_outputs, given is not None), times

    @_telling_peers_if_it_fails
    def evaluate(
        self,
        inputs: Any,
        targets: Any,
        *,
        counts: Any,
        keep_outputs: bool,
        training: bool,
        given: Presplit | None = None,
    ) -> Tensor | StepResult:
        """The mini-batch loss of a forward alone (a ``StepResult`` with ``keep_outputs``)."""
        rows, sizes, parts = self._start(inputs, given)
        m = len(sizes)
        data = self._data(parts, build_graph=False, keep_outputs=keep_outputs)
        if self.placement.is_last:
            self._targets(targets, rows, sizes, data, counts=counts, given=given)
        self._run(self.schedules.forward(m), data, training)
        loss = self._loss(data, m)
        return self._answer(loss, data, m, keep_outputs, given is not None)

    def forward(self, inputs: Any, training: bool) -> Any:
        """The outputs of a forward alone, on the last stage, micro-batches gathered in order;
        None elsewhere."""
        outputs = self.forward_each(inputs, training)
        return None if outputs is None else gather_payload(outputs)

    @_telling_peers_if_it_fails
    def forward_each(
        self,
        inputs: Any,
        training: bool,
        *,
        given: Presplit | None = None,
        outputs_for: OutputsFor | None = None,
    ) -> list[Any] | None:
        """A forward alone of one mini-batch (or of the micro-batches ``given``); on the last
        stage, each micro-batch's outputs in order, None elsewhere.

        ``outputs_for(sizes)``, called on the last stage with the micro-batches' rows, makes
        the mapping that each micro-batch's outputs are put in as soon as they are computed:
        it may keep only what it needs of them (``engine.logprobs.TokenLogprobs``)."""
        _, sizes, parts = self._start(inputs, given)
        m = len(sizes)
        data = self._data(parts, build_graph=False)
        if self.placement.is_last and outputs_for is not None:
            data.outputs = outputs_for(sizes)
        self._run(self.schedules.forward(m), data, training)
        if not self.placement.is_last:
            return None
        return [data.outputs[i] for i in range(m)]

    @contextlib.contextmanager
    def _aborting(self) -> Iterator[None]:
        """Where the call begun inside fails on this rank, tell its peers (``transport.abort``):
        of this rank's own error, or of the abort that ended it here, passed on. A peer
        waiting in the call raises at once rather than at its timeout, so that it starts the
        next call with this rank, not a timeout later (where this rank, waiting in that next
        call meanwhile, could time out in its turn)."""
        before, self._failed = self._call, None
        try:
            yield
        except Exception as exc:
            if self._call != before:  # refused before its call began: every rank refuses
                stage = self._failed
                if stage is None:
                    stage = exc.stage if isinstance(exc, StageError) else self.stage_index
                error = f"{type(exc).__name__}: {first_line(exc)}"
                self.transport.abort(stage, error, self._sends)
            raise

    # -- in and out ---------------------------------------------------------------------------
    def _start(
        self,
        inputs: Any,
        given: Presplit | None = None,
        needs: Callable[[int], object] | None = None,
    ) -> tuple[int, list[int], Any]:
        """The mini-batch's rows and its micro-batches' rows, and on the first rank the
        micro-batches' inputs (``given``, or ``inputs`` split into ``chunks``), which
        ``needs(m)`` may refuse there as bad inputs are refused.

        The first rank reads them off the inputs; every other rank off the envelope of its
        first message, which every step's program begins by receiving, so the pipeline needs
        no collective for them. Replicas share their row counts (one small all-reduce), and a
        traced step aligns the ranks' clocks with a broadcast."""
        # first, on every rank: what a failed call left is dropped
        self._call = self.transport.new_call()
        parts = None
        if self.recorder is not None:
            if self.placement.n_ranks > 1:  # align the ranks' clocks: a step starts here
                self.broadcast_number(
                    torch.zeros(1, device=self.device), 0, "the start of the step"
                )
            self.recorder.step()
        if self.placement.is_first:

            def split() -> tuple[int, list[int], list[Any]]:
                rows = given.rows if given else check_payload(inputs, "inputs")
                sizes, parts = first_parts(inputs, given, rows, self.chunks, self.device)
                if needs is not None:
                    needs(len(sizes))
                return rows, sizes, parts

            rows, sizes, parts = self._refused_alike(split)
            m = len(sizes)
        else:
            first = self.placement.stages[0]
            m, rows = self.transport.peek(first - 1, first, Kind.RECV_F)
            sizes = later_sizes(given, m, rows, self.chunks, self.stage_index)
        self.transport.info = (m, rows)
        self._rows_all = rows
        if self.replicas is not None:
            self._rows_all = sum(self.replicas.rows(rows, self.stage_index))
        return rows, sizes, parts

    def _refused_alike(self, check: Callable[[], _T]) -> _T:
        """``check()``; where it refuses this step on the first stage, the other replicas'
        first stages hear of it (a row count of -1) and raise at once, rather than wait for
        this one until the timeout and leave their sum pending for the next step."""
        try:
            return check()
        except (TypeError, ValueError):
            if self.replicas is not None and self.placement.is_first:
                with contextlib.suppress(ValueError, StageError):
                    self.replicas.rows(-1, self.stage_index)
            raise

    def _data(self, parts: list[Any] | None, **options: Any) -> StepData:
        """The step's data, with the micro-batches' inputs on the first rank."""
        data = StepData(n_stages=self.placement.n_stages, **options)
        if parts is not None:
            data.inputs = parts
        return data

    def _targets(
        self,
        targets: Any,
        rows: int,
        sizes: list[int],
        data: StepData,
        scale: float = 1.0,
        counts: Any = None,
        given: Presplit | None = None,
    ) -> None:
        """Give the last stage each micro-batch's target and the weight of its loss."""
        if given:
            data.targets = given_targets(given, self.device)
        else:
            data.targets = scatter_targets(targets, rows, len(sizes), self.chunks, self.device)
        data.loss_weights = loss_weights(
            sizes,
            self.loss_reduction,
            rows_all=self._rows_all,
            scale=scale,
            counts=counts,
            replicas=self.replicas,
            stage=self.stage_index,
            device=self.device,
        )

    def _loss(self, data: StepData, m: int) -> Tensor:
        """The mini-batch loss, computed on the last stage and known to every rank."""
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.placement.is_last:
            loss += sum(data.losses[i].double() for i in range(m))
        if self.placement.n_ranks > 1:
            last = self.placement.rank_of(self.placement.n_stages - 1)
            self.broadcast_number(loss, last, "the loss")
        if self.replicas is not None:
            self.replicas.sum(loss, "the loss", self.stage_index)
        return loss

    def _answer(
        self, loss: Tensor, data: StepData, m: int, keep_outputs: bool, given: bool
    ) -> Tensor | StepResult:
        """The loss; with ``keep_outputs``, also the last stage's outputs and per-micro-batch
        losses. The user's own micro-batches (``given``) keep their outputs apart, in a list,
        as ``forward_only`` does: they may differ in length, which no join can hold."""
        if not keep_outputs:
            return loss
        if not self.placement.is_last:
            return StepResult(loss, None, None)
        assert data.loss_weights is not None
        each = [_detached(data.outputs[i]) for i in range(m)]
        outputs = each if given else gather_payload(each)
        losses = [
            (data.losses[i] / data.loss_weights[i]).detach() if data.loss_weights[i] else None
            for i in range(m)
        ]
        return StepResult(loss, outputs, losses)

    def broadcast_number(self, value: Tensor, src_rank: int, what: str) -> Tensor:
        """Broadcast the one number ``value`` holds from ``src_rank``, with this call's number
        beside it; returns ``value``, set to it. The root may have broadcast in an earlier
        call that failed here before it was taken (the last stage ends its part of a step,
        then an earlier stage fails in its backward): gloo holds such a broadcast for the
        next one on the group, which takes it and drops it here rather than read it as this
        call's (every broadcast of a number is of one size, so none is misread as another's)."""
        call = float(self._call)
        message = torch.tensor([call, 0.0], dtype=torch.float64, device=value.device)
        message[1] = value.detach().reshape(())
        while True:
            self.broadcast(message, src_rank, what)
            sent, number = message.tolist()
            if sent >= call:
                break
        if sent != call:
            raise PipelineError(
                f"stage {self.stage_index}: {what} came from call {sent:.0f} during call "
                f"{self._call}: the ranks do not make the same calls"
            )
        if self.placement.rank != src_rank:
            with torch.no_grad():
                value.fill_(number)
        return value

    def broadcast(self, value: Tensor, src_rank: int, what: str) -> Tensor:
        """Broadcast ``value`` from ``src_rank``; losing it ends in StageError rather than a
        hang. A number goes by ``broadcast_number``, which a failed call cannot misalign."""
        src_stage = src_rank  # its first stage
        work = dist.broadcast(
            value,
            src=self.placement.global_rank(src_rank),
            group=self.placement.group,
            async_op=True,
        )
        waiting = f"waiting for {what}"
        watch = None
        if self.placement.rank == src_rank:  # a peer that failed will never take it: hear so

            def watch() -> None:
                self.transport.check(self.stage_index, f"{what} to be taken")

        bounded_wait(work, self.timeout, self.stage_index, waiting, f"stage {src_stage}", watch)
        return value

    # -- running the program ----------------------------------------------------------------
    def _run(self, schedule: Schedule, data: StepData, training: bool) -> float:
        """Run this rank's program; returns the seconds spent computing (forward, backward)."""
        busy = 0.0
        recorder = self.recorder
        program = schedule.programs[self.placement.rank]
        self.transport.begin(schedule.programs, self.placement.rank)
        arm, launch = _gradient_points(program) if self.buckets else (set(), set())

        reshards = self.sharded is not None and self.sharded.sharding.reshard_after_forward
        resharded = self.sharded if reshards else None

        def before(action: Action) -> None:
            if action in arm:
                self.buckets[action.stage].arm()
            elif resharded is not None and action.kind is Kind.WEIGHT:
                resharded.gradients[action.stage].before_weight()  # a forward since B freed them

        def timed(action: Action, start: float, end: float) -> None:
            nonlocal busy
            if action.is_compute:
                busy += end - start
            if action in launch:
                self.buckets[action.stage].launch()
            if recorder is not None:
                recorder.on_action(action, start, end)

        try:
            run_program(
                program,
                self.stages,
                self.transport,
                data,
                on_action=timed,
                before_action=before if arm or resharded else None,
                streams=self.streams,
            )
            if self.sharded is not None and not data.build_graph:
                self.sharded.reshard()  # a forward alone left the parameters gathered
            if self.deferred_batch_norm and training:
                modules = [stage.module for stage in self.stages.values()]
                if self.replicas is not None:
                    self.replicas.merge_batch_norm(modules, self.stage_index)
                for module in modules:
                    commit_deferred_batch_norm(module)
        except BaseException:
            self._failed = data.failed
            forget_failed_step(self.stages.values())
            self._forget_sums()
            raise
        return busy

    def _sum_gradients(self) -> tuple[float, int, int]:
        """Wait for the replicas' gradient sums; returns seconds waited, buckets, early."""
        waited, buckets, early = 0.0, 0, 0
        for grads in self.buckets.values():
            seconds, started = grads.finish()
            waited += seconds
            buckets += len(grads.buckets)
            early += started
        return waited, buckets, early

    def _forget_sums(self) -> None:
        for buckets in self.buckets.values():
            buckets.reset()


def _detached(payload: Any) -> Any:
    """``payload`` with every tensor detached."""
    return with_tensors(payload, [t.detach() for t in tensors_of(payload)])
