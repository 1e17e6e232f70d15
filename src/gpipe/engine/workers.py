"""GPipe's step in one process: a worker thread per device, driven by autograd.

A forward runs the forward half of the schedule, each device's actions on its own worker; the
backward of its output runs the backward half the same way, in GPipe's clock-cycle order, so
that a failure stops every stage at the same cycle.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.comm.copy_streams import DeviceCopies
from gpipe.comm.in_process import InProcessTransport
from gpipe.engine.given_batches import GivenForward, given_outputs, take_step_data
from gpipe.engine.step_schedule import StepSchedules
from gpipe.errors import PipelineError
from gpipe.parallel.ties import sum_local
from gpipe.runtime.executor import StepData, run_program
from gpipe.runtime.failed_step import forget_failed_step
from gpipe.runtime.microbatch import Batch, as_tuple, gather, like, scatter
from gpipe.runtime.recompute import AutocastState
from gpipe.runtime.stage import Stage
from gpipe.schedules import FORWARD_KINDS, Action, Schedule, execution_order

__all__ = ["DeviceWorkers", "PipelinedForward"]


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


def _explain_in_place(error: BaseException) -> None:
    """Add what torch's message leaves out when a layer changed its partition's input in
    place: in torchgpipe that worked without re-materialization, here it never does."""
    if isinstance(error, RuntimeError) and "leaf Variable that requires grad" in str(error):
        error.add_note(
            "a partition receives its input as a leaf tensor, which its first layers may not "
            "change in place: make that layer out of place (nn.ReLU(inplace=False)) or cut the "
            "model elsewhere"
        )


@functools.lru_cache(maxsize=64)
def _device_programs(
    schedule: Schedule, phase: str, devices: tuple[torch.device, ...]
) -> dict[torch.device, tuple[Action, ...]]:
    """Each device's actions of one phase of ``schedule`` (``devices[s]`` holds stage ``s``),
    in clock-cycle order (which cannot deadlock). Worked out once per schedule: the order
    comes from the validator's ``execution_order``, too slow to run at every step."""
    programs: dict[torch.device, list[Action]] = {d: [] for d in dict.fromkeys(devices)}
    for action in sorted(execution_order(schedule), key=_clock_cycle(schedule)):
        if (action.kind in FORWARD_KINDS) == (phase == "forward"):
            programs[devices[action.stage]].append(action)
    return {device: tuple(program) for device, program in programs.items()}


class DeviceWorkers:
    """The in-process machinery of one ``GPipe``: its stages, one worker thread per distinct
    device, and the schedules its steps run.

    ``tied``: each parameter that several stages share, as its copies (one per stage), whose
    gradients are summed after every backward. ``on_action(action, start, end)`` hears of
    every action run (a ``Recorder``'s). ``copies``: the GPUs' copy streams, kept from step to
    step."""

    def __init__(
        self,
        stages: Sequence[Stage],
        schedules: StepSchedules,
        timeout: float,
        *,
        tied: Sequence[Sequence[nn.Parameter]] = (),
        on_action: Callable[[Action, float, float], None] | None = None,
    ) -> None:
        self.stages = list(stages)
        self.schedules = schedules
        self.devices = [stage.device for stage in self.stages]
        self.timeout = timeout
        self.tied = tied
        self.on_action = on_action
        self.copies = DeviceCopies()
        self._pools: dict[torch.device, ThreadPoolExecutor] = {}
        # the graphs each training forward kept, by its step's data, until its backward
        self._kept: dict[int, list[dict[int, object]]] = {}
        self._lock = threading.Lock()

    # -- a forward, whose output's backward runs the backward schedule ------------------------
    def forward(self, batch: Batch, chunks: int, training: bool) -> Batch:
        """``batch`` (on the first device) split into ``chunks`` micro-batches and run through
        the stages; their outputs gathered on the last device. Under grad, the output's
        ``backward()`` runs the backward schedule (``training``: the modules' mode, which
        decides re-materialization)."""
        schedule, data = self._step(scatter(batch, chunks), training)
        if not data.build_graph:
            self.run(schedule, "forward", data, AutocastState.capture())
            return gather([data.outputs[i] for i in range(schedule.n_microbatches)])
        phony = torch.empty(0, device=self.devices[0], requires_grad=True)
        shape: list[Batch] = []
        outputs = PipelinedForward.apply(  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            self, schedule, data, shape, phony, *as_tuple(batch)
        )
        return like(shape[0], outputs)

    def forward_each(self, microbatches: list[Batch], training: bool) -> list[Batch]:
        """The user's own ``microbatches`` (checked, on the first device) run through the
        stages: each one's outputs, through which ``backward`` runs as one."""
        schedule, data = self._step(microbatches, training)
        if not data.build_graph:
            self.run(schedule, "forward", data, AutocastState.capture())
            return [data.outputs[i] for i in range(schedule.n_microbatches)]
        phony = torch.empty(0, device=self.devices[0], requires_grad=True)
        inputs = [t for batch in microbatches for t in as_tuple(batch)]
        forms: list[int] = []
        outputs = GivenForward.apply(  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            self, schedule, data, forms, phony, *inputs
        )
        return given_outputs(forms, outputs)

    def _step(self, microbatches: list[Batch], training: bool) -> tuple[Schedule, StepData]:
        """The schedule and data of a forward over ``microbatches``: forward-only without
        grad, else the training step's with the micro-batches it re-materializes."""
        m, k = len(microbatches), len(self.stages)
        if not torch.is_grad_enabled():
            data = StepData(n_stages=k, build_graph=False, inputs=microbatches)
            return self.schedules.forward(m), data
        schedule = self.schedules.step(m, training)
        data = StepData(
            n_stages=k,
            build_graph=True,
            checkpoint=schedule.recomputed.__contains__,
            inputs=microbatches,
        )
        return schedule, data

    def backward(self, schedule: Schedule, data: StepData) -> None:
        """The backward half of ``schedule``; then each tied parameter's copies hold the sum
        of their gradients."""
        kept = self._kept.pop(id(data), None)
        for stage, saved in zip(self.stages, kept or [{}] * len(self.stages), strict=True):
            stage.give_saved(saved)
        self.run(schedule, "backward", data)
        sum_local(self.tied)

    # -- running one phase on every device ----------------------------------------------------
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
        programs = _device_programs(schedule, phase, tuple(self.devices))
        inline = self.devices[-1]
        grad_mode = torch.is_grad_enabled()

        def work(program: Sequence[Action]) -> None:
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
            _explain_in_place(real[0])
            raise real[0]
        if phase == "forward" and data.build_graph:
            self._keep(data)

    def _keep(self, data: StepData) -> None:
        """Take what a training forward left in the stages into its own step's keeping until
        its backward: another forward may run in between (two inputs through one model, then
        one loss, as in torchgpipe), and an output dropped unused frees its graphs."""
        key = id(data)
        self._kept[key] = [stage.take_saved() for stage in self.stages]
        weakref.finalize(data, self._kept.pop, key, None)

    def _pool(self, device: torch.device) -> ThreadPoolExecutor:
        with self._lock:
            if device not in self._pools:
                self._pools[device] = ThreadPoolExecutor(1, thread_name_prefix=f"gpipe-{device}")
            return self._pools[device]


class PipelinedForward(torch.autograd.Function):
    """Autograd's view of a whole pipelined forward: its backward runs the backward schedule."""

    @staticmethod
    def forward(
        ctx: Any,
        workers: DeviceWorkers,
        schedule: Schedule,
        data: StepData,
        shape: list[Batch],
        phony: Tensor,
        *inputs: Tensor,
    ) -> tuple[Tensor, ...]:
        workers.run(schedule, "forward", data, AutocastState.capture())
        microbatches = [data.outputs[i] for i in range(schedule.n_microbatches)]
        shape.append(microbatches[0])  # a tensor or a tuple: the caller returns the same
        outputs = tuple(t.detach() for t in as_tuple(gather(microbatches)))
        ctx.mark_non_differentiable(*[t for t in outputs if not t.is_floating_point()])
        ctx.workers, ctx.schedule, ctx.data = workers, schedule, data
        ctx.sizes = [as_tuple(b)[0].size(0) for b in microbatches]
        data.outputs.clear()
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        data = take_step_data(ctx)
        splits = [g.split(ctx.sizes, dim=0) for g in grad_outputs]
        data.grad_outputs = [tuple(s[i] for s in splits) for i in range(len(ctx.sizes))]
        ctx.workers.backward(ctx.schedule, data)
        n = ctx.schedule.n_microbatches
        per_input = list(zip(*(data.input_grads[i] for i in range(n)), strict=True))
        input_grads = tuple(
            None if any(g is None for g in grads) else torch.cat(grads, dim=0)
            for grads in per_input
        )
        return (None, None, None, None, None, *input_grads)
