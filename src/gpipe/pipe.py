"""GPipe: the single-process facade, one partition per device, driven by autograd.

``model(x)`` runs the forward half of the GPipe schedule, one worker thread per device; the
output's ``backward()`` runs the backward half the same way. A caller's ``torch.autocast``
applies inside every partition, worker threads and recomputations included. Public API and
behaviour follow torchgpipe's ``GPipe`` (and PyTorch's retired ``Pipe``) so migrating is
changing an import.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.comm.copy_streams import DeviceCopies
from gpipe.comm.transport import InProcessTransport
from gpipe.errors import MovingDenied, PipelineError
from gpipe.parallel.ties import find_ties, sum_local, untie
from gpipe.runtime.batchnorm import commit_deferred_batch_norm, convert_deferred_batch_norm
from gpipe.runtime.executor import StepData, run_program
from gpipe.runtime.failed_step import forget_failed_step
from gpipe.runtime.given_batches import (
    GivenForward,
    check_microbatches,
    given_outputs,
    take_step_data,
)
from gpipe.runtime.microbatch import (
    Batch,
    as_tuple,
    check_batch,
    check_chunks,
    gather,
    like,
    scatter,
)
from gpipe.runtime.partitions import as_sequential, check_balance, split_sequential
from gpipe.runtime.recompute import (
    AutocastState,
    check_checkpoint,
    recomputed_layers,
    should_checkpoint,
)
from gpipe.runtime.stage import Stage
from gpipe.runtime.timeline import Event, Recorder
from gpipe.schedules import (
    FORWARD_KINDS,
    Action,
    Schedule,
    add_recompute,
    add_skips,
    execution_order,
    forward_only,
    gpipe,
)
from gpipe.skip.layout import SkipLayout
from gpipe.skip.skippable import find_skips

__all__ = ["GPipe"]

Device = torch.device | int | str


def _as_device(device: Device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _default_devices(n: int) -> list[torch.device]:
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")] * n


def _clock_cycle(schedule: Schedule) -> Callable[[Action], tuple[int, int]]:
    """GPipe's clock cycle of an action, then its stage: at forward cycle c stage j runs
    micro-batch c - j, and the backward mirrors it. Devices run their actions in this order,
    so that a failure stops every stage at the same cycle."""
    k, m = schedule.n_stages, schedule.n_microbatches

    def key(action: Action) -> tuple[int, int]:
        if action.kind in FORWARD_KINDS:
            return action.microbatch + action.stage, action.stage
        return (m - 1 - action.microbatch) + (k - 1 - action.stage), action.stage

    return key


class _Run:
    """The in-process machinery of one GPipe: stages, per-device programs and their workers."""

    def __init__(
        self,
        stages: Sequence[Stage],
        timeout: float,
        on_action: Callable[[Action, float, float], None] | None = None,
    ) -> None:
        self.stages = list(stages)
        self.devices = [stage.device for stage in self.stages]
        self.timeout = timeout
        self.on_action = on_action
        self.tied: list[list[nn.Parameter]] = []  # each tied parameter's copies, one per stage
        self._groups = list(dict.fromkeys(self.devices))  # one worker per distinct device
        self._pools: dict[torch.device, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self.copies = DeviceCopies()  # a copy stream per GPU, kept from step to step

    def _programs(self, schedule: Schedule, phase: str) -> dict[torch.device, list[Action]]:
        """Each device's actions of one phase, in clock-cycle order (which cannot deadlock)."""
        programs: dict[torch.device, list[Action]] = {d: [] for d in self._groups}
        for action in sorted(execution_order(schedule), key=_clock_cycle(schedule)):
            if (action.kind in FORWARD_KINDS) == (phase == "forward"):
                programs[self.devices[action.stage]].append(action)
        return programs

    def _pool(self, device: torch.device) -> ThreadPoolExecutor:
        with self._lock:
            if device not in self._pools:
                self._pools[device] = ThreadPoolExecutor(1, thread_name_prefix=f"gpipe-{device}")
            return self._pools[device]

    def run(
        self,
        schedule: Schedule,
        phase: str,
        data: StepData,
        autocast: AutocastState | None = None,
    ) -> None:
        """Run one phase on all devices at once; the last stage's device runs on this thread
        (in backward, autograd already occupies that device's thread with this very call).

        The first exception raised in a stage is re-raised here as it was, with a note naming
        the stage and micro-batch; the other devices stop before their next micro-batch.
        ``autocast``: the caller's settings, which the worker threads take on too."""
        transport = InProcessTransport(self.devices, self.timeout, self.copies)
        stages = dict(enumerate(self.stages))
        programs = self._programs(schedule, phase)
        inline = self.devices[-1]
        grad_mode = torch.is_grad_enabled()

        def work(program: list[Action]) -> None:
            try:
                mixed = autocast.restore() if autocast is not None else contextlib.nullcontext()
                with torch.set_grad_enabled(grad_mode), mixed:
                    run_program(
                        program, stages, transport, data, self.on_action, stop=transport.abort
                    )
            except BaseException:
                transport.abort.set()
                transport.wake()
                raise

        futures: list[Future[None]] = [
            self._pool(device).submit(work, program)
            for device, program in programs.items()
            if device != inline and program
        ]
        errors: list[BaseException] = []
        try:
            work(programs[inline])
        except BaseException as exc:
            errors.append(exc)
        for future in futures:
            try:
                future.result()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            forget_failed_step(self.stages)
            # The first failure is the cause; the others only stopped because of it.
            real = [e for e in errors if type(e) is not PipelineError] or errors
            raise real[0]


class _PipelineFunction(torch.autograd.Function):
    """Autograd's view of a whole pipelined forward: its backward runs the backward schedule."""

    @staticmethod
    def forward(
        ctx: Any,
        run: _Run,
        schedule: Schedule,
        data: StepData,
        shape: list[Batch],
        phony: Tensor,
        *inputs: Tensor,
    ) -> tuple[Tensor, ...]:
        run.run(schedule, "forward", data, AutocastState.capture())
        microbatches = [data.outputs[i] for i in range(schedule.n_microbatches)]
        shape.append(microbatches[0])  # a tensor or a tuple: the caller returns the same
        outputs = tuple(t.detach() for t in as_tuple(gather(microbatches)))
        ctx.mark_non_differentiable(*[t for t in outputs if not t.is_floating_point()])
        ctx.run, ctx.schedule, ctx.data = run, schedule, data
        ctx.sizes = [as_tuple(b)[0].size(0) for b in microbatches]
        data.outputs.clear()
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        data = take_step_data(ctx)
        splits = [g.split(ctx.sizes, dim=0) for g in grad_outputs]
        data.grad_outputs = [tuple(s[i] for s in splits) for i in range(len(ctx.sizes))]
        ctx.run.run(ctx.schedule, "backward", data)
        sum_local(ctx.run.tied)
        n = ctx.schedule.n_microbatches
        per_input = list(zip(*(data.input_grads[i] for i in range(n)), strict=True))
        input_grads = tuple(
            None if any(g is None for g in grads) else torch.cat(grads, dim=0)
            for grads in per_input
        )
        return (None, None, None, None, None, *input_grads)


class GPipe(nn.Module):
    """Wraps an ``nn.Sequential`` for GPipe pipeline parallelism in one process.

    Args:
        module: the model, an ``nn.Sequential`` cut into consecutive partitions. Its layers
            may be ``gpipe.skip.skippable``: a skip that crosses partitions is copied straight
            to the partition that pops it.
        balance: number of layers in each partition (a list or tuple); ``gpipe.planning.balancing``
            chooses one from measured costs.
        devices: one device per partition (default: every CUDA device, else CPU).
        chunks: number of micro-batches a mini-batch is split into.
        checkpoint: when to re-materialize: ``"always"``, ``"except_last"`` or ``"never"``;
            or ``gpipe.runtime.recompute.Layers(...)`` to recompute only some layers.
        deferred_batch_norm: replace every BatchNorm by
            ``gpipe.runtime.batchnorm.DeferredBatchNorm``,
            so running statistics are tracked once per mini-batch, from all its micro-batches.
        timeout: seconds a stage waits for its neighbour before it gives up.
        trace: record what each stage runs when, for ``timeline`` (``self.recorder``).
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Iterable[int] | None = None,
        *,
        devices: Iterable[Device] | None = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        timeout: float = 60.0,
        trace: bool = False,
    ) -> None:
        super().__init__()
        chunks = check_chunks(chunks)
        checkpoint = check_checkpoint(checkpoint)
        module = as_sequential(module)
        self.balance = check_balance(len(module), None if balance is None else list(balance))
        skips = find_skips(module)
        all_devices = (
            _default_devices(len(self.balance))
            if devices is None
            else [_as_device(d) for d in devices]
        )
        if len(all_devices) < len(self.balance):
            raise IndexError(
                "too few devices to hold given partitions "
                f"(devices: {len(all_devices)}, partitions: {len(self.balance)})"
            )
        if deferred_batch_norm:
            module = convert_deferred_batch_norm(module, chunks, auto_commit=False)  # type: ignore[assignment]
        self.devices = all_devices[: len(self.balance)]
        # a parameter that layers of several partitions share: a copy on each, gradients
        # summed after the backward (so the copies stay equal)
        self.ties = find_ties(module, self.balance)
        untie(module, self.ties)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        parts = split_sequential(module, self.balance)
        self.partitions = nn.ModuleList(
            [nn.Module.to(p, d) for p, d in zip(parts, self.devices, strict=True)]
        )
        self.skip_layout = SkipLayout(skips, self.balance)
        recomputed = recomputed_layers(checkpoint, module, self.balance)
        # between partitions any payload may pass (a split model's sizes ride along); what
        # the last one returns is a tensor or a tuple of tensors, as torchgpipe's rule says
        stages = [
            Stage(
                j,
                len(parts),
                p,
                d,
                ports=self.skip_layout.ports(j),
                recomputed_layers=r,
                payloads=j < len(parts) - 1,
            )
            for j, (p, d, r) in enumerate(
                zip(self.partitions, self.devices, recomputed, strict=True)
            )
        ]
        self.recorder = Recorder(0) if trace else None
        hook = None if self.recorder is None else self.recorder.on_action
        self._run = _Run(stages, timeout, hook)
        self._run.tied = [
            [module.get_parameter(tie.name(s)) for s in tie.stages] for tie in self.ties
        ]

    # -- Sequential-like access to the layers -------------------------------------------------
    def __len__(self) -> int:
        return sum(len(p) for p in self.partitions)

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self)
        try:
            return layers[index]
        except IndexError:
            raise IndexError(f"layer index {index} out of range for {len(layers)} layers") from None

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition

    # -- Placement is fixed by `devices` ------------------------------------------------------
    def cuda(self, device: Any = None) -> GPipe:
        raise MovingDenied(
            "denied to move parameters and buffers, because GPipe places them by its devices"
        )

    def cpu(self) -> GPipe:
        raise MovingDenied(
            "denied to move parameters and buffers, because GPipe places them by its devices"
        )

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        moving = (
            "device" in kwargs
            or "tensor" in kwargs
            or (args and isinstance(args[0], (torch.device, int, str, Tensor)))
        )
        if moving:
            raise MovingDenied(
                "denied to move parameters and buffers, because GPipe places "
                "them by its devices; only dtype casts are allowed"
            )
        return super().to(*args, **kwargs)

    # -- Running -----------------------------------------------------------------------------
    def forward(
        self,
        input: Tensor | tuple[Tensor, ...] | None = None,
        *,
        microbatches: Sequence[Tensor | tuple[Tensor, ...]] | None = None,
    ) -> Any:
        """Pipelined forward over micro-batches; the output is on the last device, a tensor
        or a tuple as the last partition returns it.

        ``microbatches=[x0, x1, ...]`` runs your own micro-batches instead of splitting
        ``input`` into ``chunks``: each a tensor or a tuple of tensors of one structure, of
        its own rows and length, run in order; returns the list of their outputs (which
        cannot be joined when their lengths differ), through which ``backward`` runs as one.
        """
        if microbatches is not None:
            if input is not None:
                raise ValueError("give input or microbatches=[...], not both")
            return self._forward_given(microbatches)
        if not self.partitions:  # an empty Sequential is the identity
            return check_batch(input, batched=False)
        if self.recorder is not None:
            self.recorder.step()  # a step is this forward and the backward of its output
        batch = check_batch(input)
        batch = like(batch, [t.to(self.devices[0]) for t in as_tuple(batch)])
        schedule, data = self._step_of(scatter(batch, self.chunks))
        m = schedule.n_microbatches
        if not data.build_graph:
            self._run.run(schedule, "forward", data, AutocastState.capture())
            self._commit()
            return gather([data.outputs[i] for i in range(m)])
        phony = torch.empty(0, device=self.devices[0], requires_grad=True)
        shape: list[Batch] = []
        outputs = _PipelineFunction.apply(self._run, schedule, data, shape, phony, *as_tuple(batch))
        self._commit()
        return like(shape[0], outputs)

    def _forward_given(self, given: object) -> list[Any]:
        """The forward over the user's own micro-batches: a list of their outputs."""
        microbatches = check_microbatches(given, self.devices[0])
        if not self.partitions:
            return microbatches
        if self.recorder is not None:
            self.recorder.step()
        schedule, data = self._step_of(microbatches)
        if not data.build_graph:
            self._run.run(schedule, "forward", data, AutocastState.capture())
            self._commit()
            return [data.outputs[i] for i in range(schedule.n_microbatches)]
        phony = torch.empty(0, device=self.devices[0], requires_grad=True)
        inputs = [t for batch in microbatches for t in as_tuple(batch)]
        forms: list[int] = []
        after = functools.partial(sum_local, self._run.tied)
        outputs = GivenForward.apply(self._run, schedule, data, forms, after, phony, *inputs)
        self._commit()
        return given_outputs(forms, outputs)

    def _step_of(self, microbatches: list[Batch]) -> tuple[Schedule, StepData]:
        """The schedule and data of a forward over ``microbatches``: forward-only without
        grad, else GPipe's with the micro-batches ``checkpoint`` re-materializes."""
        m, k = len(microbatches), len(self.partitions)
        routes = self.skip_layout.routes
        if not torch.is_grad_enabled():
            data = StepData(n_stages=k, build_graph=False, inputs=microbatches)
            return add_skips(forward_only(k, m), routes), data
        mode = self.checkpoint if self.training else "never"
        recomputed = frozenset(i for i in range(m) if should_checkpoint(mode, i, m))
        data = StepData(
            n_stages=k, build_graph=True, checkpoint=recomputed.__contains__, inputs=microbatches
        )
        return add_recompute(add_skips(gpipe(k, m), routes), recomputed), data

    def _commit(self) -> None:
        """After a training forward, fold the micro-batches' BatchNorm statistics in."""
        if self.deferred_batch_norm and self.training:
            for partition in self.partitions:
                commit_deferred_batch_norm(partition)

    def timeline(self) -> list[Event]:
        """What every stage ran in the last step: the last forward and its backward, if run."""
        if self.recorder is None:
            raise RuntimeError("timeline() needs a recording; pass trace=True to GPipe")
        return self.recorder.events()

    def extra_repr(self) -> str:
        return (
            f"balance={self.balance}, chunks={self.chunks}, checkpoint={self.checkpoint!r}, "
            f"devices={[str(d) for d in self.devices]}"
        )
