"""The executor: runs one rank's program of actions over its stages and a transport.

It is the only place that interprets a schedule, for both facades: ``GPipe`` runs one program
per device on threads over the in-process transport, ``Pipeline`` runs one program per process
over torch.distributed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from torch import Tensor

from gpipe.comm.transport import Transport
from gpipe.errors import PipelineError
from gpipe.runtime.microbatch import Batch
from gpipe.runtime.stage import Grads, Stage
from gpipe.runtime.stage_streams import StageStreams
from gpipe.schedules import RECV_KINDS, RECV_OF, Action, Kind

__all__ = ["StepData", "run_program"]

_WHAT = {
    Kind.FORWARD: "forward",
    Kind.BACKWARD: "backward",
    Kind.WEIGHT: "weight gradients",
    Kind.RECOMPUTE: "recomputation",
}


@dataclass
class StepData:
    """What flows into and out of the pipeline during one step, per micro-batch.

    ``inputs`` feed the first stage; ``targets`` and ``loss_weights`` feed a loss on the last
    stage; ``grad_outputs`` start the backward when the loss lives outside the pipeline.
    ``failed`` is the stage whose computation raised, if one did: the one a failed step's
    peers are told of.
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
    failed: int | None = None


def _received(
    held: dict[Action, Any], stage: int, kind: Kind, mb: int, peers: Mapping[int, Any]
) -> dict[int, Grads]:
    """The skip messages (or their gradients) parked for this compute action, by peer stage."""
    return {peer: held.pop(Action(stage, kind, mb, peer)) for peer in peers}


def _forward(
    action: Action, stage: Stage, data: StepData, held: dict[Action, Any], split: bool
) -> None:
    s, mb = action.stage, action.microbatch
    last = s == data.n_stages - 1
    if s == 0:
        if data.inputs is None:
            raise PipelineError("stage 0 was given no inputs")
        inputs = data.inputs[mb]
    else:
        inputs = held.pop(Action(s, Kind.RECV_F, mb))
    skips = _received(held, s, Kind.RECV_SKIP, mb, stage.ports.imports)
    target = data.targets[mb] if last and data.targets is not None else None
    weight = data.loss_weights[mb] if last and data.loss_weights is not None else 1.0
    outputs, sent_skips, loss = stage.forward(
        mb,
        inputs,
        skips,
        build_graph=data.build_graph,
        checkpoint=data.build_graph and data.checkpoint(mb),
        target=target,
        weight=weight,
        split_backward=split,
    )
    for dst, message in sent_skips.items():
        held[Action(s, Kind.SEND_SKIP, mb, dst)] = message
    if last:
        if loss is not None:
            data.losses[mb] = loss
        if data.keep_outputs:
            data.outputs[mb] = outputs
    else:
        held[Action(s, Kind.SEND_F, mb)] = outputs


def _backward(
    action: Action, stage: Stage, data: StepData, held: dict[Action, Any], split: bool
) -> None:
    s, mb = action.stage, action.microbatch
    if s == data.n_stages - 1:
        grads = data.grad_outputs[mb] if data.grad_outputs is not None else None
    else:
        grads = held.pop(Action(s, Kind.RECV_B, mb))
    skip_grads = _received(held, s, Kind.RECV_SKIP_B, mb, stage.ports.exports)
    run = stage.backward_input if split else stage.backward
    input_grads, sent = run(mb, grads, skip_grads)
    for src, message in sent.items():
        held[Action(s, Kind.SEND_SKIP_B, mb, src)] = message
    if s == 0:
        data.input_grads[mb] = input_grads
    else:
        held[Action(s, Kind.SEND_B, mb)] = input_grads


def _compute(
    action: Action, stage: Stage, data: StepData, held: dict[Action, Any], split: bool
) -> None:
    if action.kind is Kind.WEIGHT:
        stage.backward_weight(action.microbatch)
    elif action.kind is Kind.RECOMPUTE:
        stage.recompute(action.microbatch)
    elif action.kind is Kind.FORWARD:
        _forward(action, stage, data, held, split)
    else:
        _backward(action, stage, data, held, split)


def run_program(
    program: Sequence[Action],
    stages: Mapping[int, Stage],
    transport: Transport,
    data: StepData,
    on_action: Callable[[Action, float, float], None] | None = None,
    stop: threading.Event | None = None,
    before_action: Callable[[Action], None] | None = None,
    streams: StageStreams | None = None,
) -> None:
    """Run ``program`` in order.

    An exception raised inside a stage reaches the caller as it was raised, with a note
    naming the stage, the pass and the micro-batch. ``stop``, when set by a failing peer,
    ends the program before its next compute action. ``before_action`` and ``on_action``
    (with the action's start and end) are called around every action. With ``streams``,
    each stage's work is issued on its own CUDA stream (``stage_streams``).
    """
    held: dict[Action, Any] = {}
    split = any(a.kind is Kind.WEIGHT for a in program)  # backward comes as B, then W
    if streams is not None:
        streams.begin()
    try:
        for action in program:
            if streams is not None:
                streams.issue_on(_issuing_stage(action, stages))
            if before_action is not None:
                before_action(action)
            start = perf_counter() if on_action is not None else 0.0
            if action.is_compute:
                _checked_compute(action, stages[action.stage], data, held, split, stop)
            else:
                _communicate(action, transport, held, streams, stages)
            if on_action is not None:
                on_action(action, start, perf_counter())
        if streams is not None:
            streams.issue_on(None)
        transport.flush()
    finally:
        if streams is not None:
            streams.end()


def _issuing_stage(action: Action, stages: Mapping[int, Stage]) -> int | None:
    """The stage whose stream ``action``'s work is issued on; None for a receive from another
    process, which lands on the process's stream (``stage_streams``)."""
    if action.kind in RECV_KINDS and action.other_stage not in stages:
        return None
    return action.stage


def _checked_compute(
    action: Action,
    stage: Stage,
    data: StepData,
    held: dict[Action, Any],
    split: bool,
    stop: threading.Event | None,
) -> None:
    if stop is not None and stop.is_set():
        raise PipelineError(f"stage {action.stage}: stopped because another stage failed")
    try:
        _compute(action, stage, data, held, split)
    except PipelineError:
        raise
    except Exception as exc:
        data.failed = action.stage
        exc.add_note(
            f"raised in pipeline stage {action.stage}, {_WHAT[action.kind]} of micro-batch "
            f"{action.microbatch}"
        )
        raise


def _communicate(
    action: Action,
    transport: Transport,
    held: dict[Action, Any],
    streams: StageStreams | None,
    stages: Mapping[int, Stage],
) -> None:
    """A send or a receive; with ``streams``, the streams of the two ends meet on it."""
    peer = action.other_stage
    assert peer is not None
    if action.kind in RECV_KINDS:
        message = transport.recv(peer, action.stage, action.microbatch, action.kind)
        if streams is not None and peer in stages:
            streams.taken_over(message, peer, action.stage, action.kind)
        elif streams is not None:
            streams.arrived(message, action.stage)
        held[action] = message
        return
    transport.send(held.pop(action), action.stage, peer, action.microbatch, action.kind)
    if streams is not None and peer in stages:
        streams.handed_over(action.stage, peer, RECV_OF[action.kind])
