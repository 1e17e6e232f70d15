"""GPipe: the single-process facade, one partition per device, driven by autograd.

``model(x)`` runs the forward half of the GPipe schedule, one worker thread per device; the
output's ``backward()`` runs the backward half the same way. Public API and behaviour follow
torchgpipe's ``GPipe`` (and PyTorch's retired ``Pipe``) so migrating is changing an import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from .checkpointing import check_checkpoint, should_checkpoint
from .errors import MovingDenied, PipelineError
from .executor import StepData, run_program
from .microbatch import Batch, check_batch, gather, scatter
from .partition import as_sequential, check_balance, split_sequential
from .schedule import Action, Kind, Schedule, execution_order, forward_only, gpipe
from .stage import Stage
from .trace import Event, Recorder
from .transport import InProcessTransport

__all__ = ["GPipe"]

Device = torch.device | int | str


def _as_device(device: Device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _default_devices(n: int) -> list[torch.device]:
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")] * n


class _Run:
    """The in-process machinery of one GPipe: stages, per-device programs and their workers."""

    def __init__(
        self,
        partitions: Sequence[nn.Module],
        devices: Sequence[torch.device],
        timeout: float,
        on_action: Callable[[Action, float, float], None] | None = None,
    ) -> None:
        self.devices = list(devices)
        self.stages = [
            Stage(j, len(partitions), p, d)
            for j, (p, d) in enumerate(zip(partitions, devices, strict=True))
        ]
        self.timeout = timeout
        self.on_action = on_action
        self._groups = list(dict.fromkeys(self.devices))  # one worker per distinct device
        self._pools: dict[torch.device, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def _programs(self, schedule: Schedule, phase: str) -> dict[torch.device, list[Action]]:
        """Each device's actions in one global order that cannot deadlock, for one phase."""
        forward_kinds = (Kind.RECV_F, Kind.FORWARD, Kind.SEND_F)
        programs: dict[torch.device, list[Action]] = {d: [] for d in self._groups}
        for action in execution_order(schedule):
            if (action.kind in forward_kinds) == (phase == "forward"):
                programs[self.devices[action.stage]].append(action)
        return programs

    def _pool(self, device: torch.device) -> ThreadPoolExecutor:
        with self._lock:
            if device not in self._pools:
                self._pools[device] = ThreadPoolExecutor(1, thread_name_prefix=f"gpipe-{device}")
            return self._pools[device]

    def run(self, schedule: Schedule, phase: str, data: StepData) -> None:
        """Run one phase on all devices at once; the last stage's device runs on this thread
        (in backward, autograd already occupies that device's thread with this very call)."""
        transport = InProcessTransport(self.devices, self.timeout)
        stages = dict(enumerate(self.stages))
        programs = self._programs(schedule, phase)
        inline = self.devices[-1]
        grad_mode = torch.is_grad_enabled()

        def work(program: list[Action]) -> None:
            try:
                with torch.set_grad_enabled(grad_mode):
                    run_program(program, stages, transport, data, self.on_action)
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
            for stage in self.stages:
                stage.clear()
            # The first failure is the cause; the others only stopped because of it.
            real = [e for e in errors if type(e) is not PipelineError] or errors
            raise real[0]


class _PipelineFunction(torch.autograd.Function):
    """Autograd's view of a whole pipelined forward: its backward runs the backward schedule."""

    @staticmethod
    def forward(
        ctx: Any, run: _Run, schedule: Schedule, data: StepData, phony: Tensor, *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        run.run(schedule, "forward", data)
        outputs = gather([data.outputs[i] for i in range(schedule.n_microbatches)])
        outputs = tuple(t.detach() for t in outputs)
        ctx.mark_non_differentiable(*[t for t in outputs if not t.is_floating_point()])
        ctx.run, ctx.schedule, ctx.data = run, schedule, data
        ctx.sizes = [b[0].size(0) for b in data.outputs.values()]
        data.outputs.clear()
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        data: StepData = ctx.data
        if data is None:
            raise RuntimeError("a pipelined forward can be backpropagated only once")
        ctx.data = None
        splits = [g.split(ctx.sizes, dim=0) for g in grad_outputs]
        data.grad_outputs = [tuple(s[i] for s in splits) for i in range(len(ctx.sizes))]
        ctx.run.run(ctx.schedule, "backward", data)
        n = ctx.schedule.n_microbatches
        per_input = list(zip(*(data.input_grads[i] for i in range(n)), strict=True))
        input_grads = tuple(
            None if any(g is None for g in grads) else torch.cat(grads, dim=0)
            for grads in per_input
        )
        return (None, None, None, None, *input_grads)


class GPipe(nn.Module):
    """Wraps an ``nn.Sequential`` for GPipe pipeline parallelism in one process.

    Args:
        module: the model, an ``nn.Sequential`` cut into consecutive partitions.
        balance: number of layers in each partition.
        devices: one device per partition (default: every CUDA device, else CPU).
        chunks: number of micro-batches a mini-batch is split into.
        checkpoint: when to re-materialize: ``"always"``, ``"except_last"`` or ``"never"``.
        deferred_batch_norm: not supported yet; ``True`` raises NotImplementedError.
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
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
            raise ValueError(f"number of chunks must be positive integer, got {chunks!r}")
        check_checkpoint(checkpoint)
        if deferred_batch_norm:
            raise NotImplementedError(
                "deferred_batch_norm=True is not supported yet; use deferred_batch_norm=False"
            )
        module = as_sequential(module)
        self.balance = check_balance(len(module), None if balance is None else list(balance))
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
        self.devices = all_devices[: len(self.balance)]
        self.chunks = chunks
        self.checkpoint = checkpoint
        parts = split_sequential(module, self.balance)
        self.partitions = nn.ModuleList(
            [nn.Module.to(p, d) for p, d in zip(parts, self.devices, strict=True)]
        )
        self.recorder = Recorder(0) if trace else None
        hook = None if self.recorder is None else self.recorder.on_action
        self._run = _Run(list(self.partitions), self.devices, timeout, hook)

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
    def forward(self, input: Tensor | tuple[Tensor, ...]) -> Any:
        """Pipelined forward over micro-batches; the output is on the last device."""
        if self.recorder is not None:
            self.recorder.step()  # a step is this forward and the backward of its output
        batch = check_batch(input)
        batch = tuple(t.to(self.devices[0]) for t in batch)
        microbatches = scatter(batch, self.chunks)
        m, k = len(microbatches), len(self.partitions)
        mode = self.checkpoint if self.training else "never"
        if not torch.is_grad_enabled():
            data = StepData(n_stages=k, build_graph=False, inputs=microbatches)
            self._run.run(forward_only(k, m), "forward", data)
            outputs: Batch = gather([data.outputs[i] for i in range(m)])
        else:
            data = StepData(
                n_stages=k,
                build_graph=True,
                checkpoint=lambda mb: should_checkpoint(mode, mb, m),
                inputs=microbatches,
            )
            phony = torch.empty(0, device=self.devices[0], requires_grad=True)
            outputs = _PipelineFunction.apply(self._run, gpipe(k, m), data, phony, *batch)
        return outputs[0] if len(outputs) == 1 else outputs

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
