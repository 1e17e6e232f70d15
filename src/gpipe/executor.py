"""The executor: runs one rank's program of actions over its stages and a transport.

It is the only place that interprets a schedule, for both facades: ``GPipe`` runs one program
per device on threads over the in-process transport, ``Pipeline`` runs one program per process
over torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from torch import Tensor

from .errors import PipelineError, StageError
from .microbatch import Batch
from .schedule import Action, Kind
from .stage import Grads, Stage
from .transport import Message, Transport

__all__ = ["StepData", "run_program"]


@dataclass
class StepData:
    """What flows into and out of the pipeline during one step, per micro-batch.

    ``inputs`` feed the first stage; ``targets`` and ``loss_weights`` feed a loss on the last
    stage; ``grad_outputs`` start the backward when the loss lives outside the pipeline.
    """

    n_stages: int
    build_graph: bool
    checkpoint: Callable[[int], bool] = lambda microbatch: False
    inputs: Sequence[Batch] | None = None
    targets: Sequence[Any] | None = None
    loss_weights: Sequence[float] | None = None
    grad_outputs: Sequence[Grads] | None = None
    keep_outputs: bool = True
    outputs: dict[int, Batch] = field(default_factory=dict)
    losses: dict[int, Tensor] = field(default_factory=dict)
    input_grads: dict[int, Grads] = field(default_factory=dict)


def _compute(
    action: Action, stage: Stage, data: StepData, held: dict[Action, Message], split: bool
) -> None:
    s, mb = action.stage, action.microbatch
    last = s == data.n_stages - 1
    if action.kind is Kind.WEIGHT:
        stage.backward_weight(mb)
        return
    if action.kind is Kind.FORWARD:
        if s == 0:
            if data.inputs is None:
                raise PipelineError("stage 0 was given no inputs")
            inputs = data.inputs[mb]
        else:
            inputs = held.pop(Action(s, Kind.RECV_F, mb))  # type: ignore[assignment]
        target = data.targets[mb] if last and data.targets is not None else None
        weight = data.loss_weights[mb] if last and data.loss_weights is not None else 1.0
        outputs, loss = stage.forward(
            mb,
            inputs,  # type: ignore[arg-type]
            build_graph=data.build_graph,
            checkpoint=data.build_graph and data.checkpoint(mb),
            target=target,
            weight=weight,
            split_backward=split,
        )
        if last:
            if loss is not None:
                data.losses[mb] = loss
            if data.keep_outputs:
                data.outputs[mb] = outputs
        else:
            held[Action(s, Kind.SEND_F, mb)] = outputs
    else:
        if last:
            grads = data.grad_outputs[mb] if data.grad_outputs is not None else None
        else:
            grads = held.pop(Action(s, Kind.RECV_B, mb))
        input_grads = stage.backward_input(mb, grads) if split else stage.backward(mb, grads)
        if s == 0:
            data.input_grads[mb] = input_grads
        else:
            held[Action(s, Kind.SEND_B, mb)] = input_grads


def run_program(
    program: Sequence[Action],
    stages: Mapping[int, Stage],
    transport: Transport,
    data: StepData,
    on_action: Callable[[Action, float, float], None] | None = None,
) -> None:
    """Run ``program`` in order. Failures of a stage are raised as StageError naming it."""
    held: dict[Action, Message] = {}
    split = any(a.kind is Kind.WEIGHT for a in program)  # backward comes as B, then W
    for action in program:
        stage = stages[action.stage]
        kind = action.kind
        start = perf_counter() if on_action is not None else 0.0
        if kind is Kind.RECV_F:
            held[action] = transport.recv(action.stage - 1, action.stage, action.microbatch, kind)
        elif kind is Kind.RECV_B:
            held[action] = transport.recv(action.stage + 1, action.stage, action.microbatch, kind)
        elif kind is Kind.SEND_F:
            message = held.pop(action)
            transport.send(message, action.stage, action.stage + 1, action.microbatch, kind)
        elif kind is Kind.SEND_B:
            message = held.pop(action)
            transport.send(message, action.stage, action.stage - 1, action.microbatch, kind)
        else:
            try:
                _compute(action, stage, data, held, split)
            except PipelineError:
                raise
            except Exception as exc:
                what = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward"}.get(
                    kind, "weight gradients"
                )
                raise StageError(
                    action.stage,
                    f"{what} of micro-batch {action.microbatch} failed: "
                    f"{type(exc).__name__}: {exc}",
                ) from exc
        if on_action is not None:
            on_action(action, start, perf_counter())
    transport.flush()
