"""Micro-batches the user splits for ``GPipe``: checked once, carried through autograd one by one.

Each is of its own rows and length, so they cannot be joined into one batch; ``Pipeline``'s
counterpart is ``presplit``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from gpipe.runtime.executor import StepData
from gpipe.runtime.microbatch import Batch, as_tuple, check_batch, like
from gpipe.runtime.recompute import AutocastState
from gpipe.schedules import Schedule

__all__ = ["GivenForward", "check_microbatches", "given_outputs", "take_step_data"]


def take_step_data(ctx: Any) -> StepData:
    """The step's data a pipelined forward left for its backward, taken once: a second
    backward through the same forward is an error, as autograd's own is."""
    data: StepData | None = ctx.data
    if data is None:
        raise RuntimeError("a pipelined forward can be backpropagated only once")
    ctx.data = None
    return data


class Runs(Protocol):
    """What runs a schedule's phases on every device (``workers.DeviceWorkers``, which
    imports this module)."""

    def run(
        self, schedule: Schedule, phase: str, data: StepData, autocast: AutocastState | None = ...
    ) -> None: ...

    def backward(self, schedule: Schedule, data: StepData) -> None: ...


def _form(batch: Batch) -> tuple[Any, ...]:
    """What two micro-batches must share: a tensor or a tuple of how many, and each tensor's
    dimensions and dtype (not its sizes)."""
    kind = "a tensor" if isinstance(batch, Tensor) else f"a tuple of {len(batch)} tensors"
    return (kind, *((t.dim(), t.dtype) for t in as_tuple(batch)))


def check_microbatches(microbatches: object, device: torch.device) -> list[Batch]:
    """``microbatches`` on ``device``: a non-empty list of batches (a tensor or a tuple of
    tensors each), none empty, all of one structure (tensors, dimensions and dtypes alike;
    sizes may differ). Errors name the micro-batch."""
    if not isinstance(microbatches, list | tuple) or not microbatches:
        got = repr(microbatches) if isinstance(microbatches, list | tuple) else None
        raise ValueError(
            "microbatches must be a non-empty list of micro-batches (a Tensor or a tuple of "
            f"Tensors each), got {got or type(microbatches).__name__}"
        )
    batches: list[Batch] = []
    first: tuple[Any, ...] = ()
    for i, given in enumerate(microbatches):
        batch = check_batch(given, f"microbatches[{i}]")
        form = _form(batch)
        if i == 0:
            first = form
        elif form != first:
            raise ValueError(
                f"microbatches[{i}] differs in structure from microbatches[0]: "
                f"{_describe(form)}, against {_describe(first)}; every micro-batch must hold "
                "the same tensors (their sizes may differ)"
            )
        batches.append(like(batch, [t.to(device) for t in as_tuple(batch)]))
    return batches


def _describe(form: tuple[Any, ...]) -> str:
    kind, *tensors = form
    shown = ", ".join(f"{dim}-d {str(dtype).removeprefix('torch.')}" for dim, dtype in tensors)
    return f"{kind} ({shown})"


class GivenForward(torch.autograd.Function):
    """Autograd's view of a pipelined forward over micro-batches the user split: each one's
    outputs come out on their own (they may differ in length), and the backward runs the
    backward schedule with each one's output gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        run: Runs,
        schedule: Schedule,
        data: StepData,
        forms: list[int],
        phony: Tensor,
        *inputs: Tensor,
    ) -> tuple[Tensor, ...]:
        run.run(schedule, "forward", data, AutocastState.capture())
        m = schedule.n_microbatches
        forms.extend(_width(data.outputs[i]) for i in range(m))  # for the caller
        outputs = tuple(t.detach() for i in range(m) for t in as_tuple(data.outputs[i]))
        ctx.mark_non_differentiable(*[t for t in outputs if not t.is_floating_point()])
        ctx.run, ctx.schedule, ctx.data = run, schedule, data
        ctx.widths = [len(as_tuple(data.outputs[i])) for i in range(m)]
        data.outputs.clear()
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        data = take_step_data(ctx)
        grads, at = [], 0
        for width in ctx.widths:
            grads.append(tuple(grad_outputs[at : at + width]))
            at += width
        data.grad_outputs = grads
        ctx.run.backward(ctx.schedule, data)
        n = ctx.schedule.n_microbatches
        input_grads = tuple(g for i in range(n) for g in data.input_grads[i])
        return (None, None, None, None, None, *input_grads)


def _width(batch: Batch) -> int:
    """0 for a tensor, else the tuple's length."""
    return 0 if isinstance(batch, Tensor) else len(batch)


def given_outputs(forms: Sequence[int], outputs: Sequence[Tensor]) -> list[Batch]:
    """Each micro-batch's outputs, a tensor (form 0) or a tuple of ``form`` tensors, as the
    last partition gave them."""
    found: list[Batch] = []
    at = 0
    for form in forms:
        width = max(form, 1)
        found.append(outputs[at] if form == 0 else tuple(outputs[at : at + width]))
        at += width
    return found
