"""The executor: a rank's program of actions run in its order, over any transport, by the stages
it names. Here in one process over the in-process transport, each rank on a thread of its own
as ``GPipe`` runs its devices, or every stage on one thread; the facades' tests run it end to
end."""

import threading

import pytest
import torch
from torch import nn
from torch.nn.functional import mse_loss

from gpipe.comm.in_process import InProcessTransport
from gpipe.errors import PipelineError
from gpipe.runtime.executor import StepData, run_program
from gpipe.runtime.partitions import stage_bounds
from gpipe.runtime.stage import Stage
from gpipe.schedules import Action, Kind, add_recompute, build, forward_only

from ..small_models import BALANCES, batch, mlp

CPU = torch.device("cpu")
EXACT = {"rtol": 1e-12, "atol": 1e-14}
M = 4  # micro-batches of 4 rows each


def _stages(model: nn.Sequential, loss_fn=mse_loss) -> dict[int, Stage]:
    """The model cut in two stages, the loss on the last."""
    children = list(model.children())
    bounds = stage_bounds(BALANCES[2])
    return {
        s: Stage(s, 2, nn.Sequential(*children[a:b]), CPU, loss_fn if s == 1 else None)
        for s, (a, b) in enumerate(bounds)
    }


def _data(x, y, **options) -> StepData:
    xs, ys = list(x.chunk(M)), list(y.chunk(M))
    weights = [len(part) / len(x) for part in xs]
    options.setdefault("build_graph", True)
    return StepData(n_stages=2, inputs=xs, targets=ys, loss_weights=weights, **options)


def _reference(x, y):
    model = mlp()
    loss = mse_loss(model(x), y)
    loss.backward()
    return loss, model


def _check_step(model, stages, data, x, y):
    loss, reference = _reference(x, y)
    torch.testing.assert_close(sum(data.losses[i] for i in range(M)), loss.detach(), **EXACT)
    ours = [p.grad for stage in stages.values() for p in stage.module.parameters()]
    for got, expected in zip(ours, [p.grad for p in reference.parameters()], strict=True):
        torch.testing.assert_close(got, expected, **EXACT)


def _on_threads(programs, stages, transport, data, **options):
    """Every rank's program on a thread of its own; the first error is raised."""
    errors = []

    def work(program):
        try:
            run_program(program, stages, transport, data, stop=transport.abort, **options)
        except BaseException as exc:
            errors.append(exc)
            transport.abort.set()
            transport.wake()

    threads = [threading.Thread(target=work, args=(p,)) for p in programs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]


def _one_thread_program() -> list[Action]:
    """Both stages on one thread, a micro-batch at a time: every send before its receive."""
    program = []
    for mb in range(M):
        program += [
            Action(0, Kind.FORWARD, mb),
            Action(0, Kind.SEND_F, mb),
            Action(1, Kind.RECV_F, mb),
            Action(1, Kind.FORWARD, mb),
            Action(1, Kind.BACKWARD, mb),
            Action(1, Kind.SEND_B, mb),
            Action(0, Kind.RECV_B, mb),
            Action(0, Kind.BACKWARD, mb),
        ]
    return program


@pytest.mark.parametrize("recomputed", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_each_rank_on_its_own_thread_gives_the_unpipelined_loss_and_gradients(schedule, recomputed):
    """Zero-bubble's split backward (B, then W) and re-materialized micro-batches (R) too."""
    plan = build(schedule, 2, M)
    if recomputed:
        plan = add_recompute(plan, frozenset(range(M)))
    model, (x, y) = mlp(), batch(16)
    stages = _stages(model)
    data = _data(x, y, checkpoint=plan.recomputed.__contains__)
    _on_threads(plan.programs, stages, InProcessTransport([CPU, CPU], timeout=10), data)
    _check_step(model, stages, data, x, y)


class _Recording(InProcessTransport):
    """The in-process transport, noting every call the executor makes of it."""

    def __init__(self):
        super().__init__([CPU, CPU], timeout=10)
        self.calls = []

    def send(self, message, src, dst, microbatch, kind):
        self.calls.append(Action(src, kind, microbatch))
        super().send(message, src, dst, microbatch, kind)

    def recv(self, src, dst, microbatch, kind):
        self.calls.append(Action(dst, kind, microbatch))
        return super().recv(src, dst, microbatch, kind)

    def flush(self):
        self.calls.append("flush")


def test_one_thread_runs_every_stage_and_the_transport_carries_the_programs_messages_in_order():
    """The program's sends and receives reach the transport in its order, then one flush."""
    program = _one_thread_program()
    model, (x, y) = mlp(), batch(16)
    stages = _stages(model)
    data = _data(x, y)
    transport = _Recording()
    run_program(program, stages, transport, data)
    _check_step(model, stages, data, x, y)
    assert transport.calls == [*(a for a in program if not a.is_compute), "flush"]


def test_every_action_is_announced_before_and_timed_after_once_in_order():
    program = _one_thread_program()
    before, after = [], []
    run_program(
        program,
        _stages(mlp()),
        InProcessTransport([CPU, CPU]),
        _data(*batch(16)),
        on_action=lambda action, start, end: after.append((action, start <= end)),
        before_action=before.append,
    )
    assert before == program
    assert after == [(action, True) for action in program]


def test_forward_only_keeps_each_micro_batchs_outputs_and_loss_unless_told_not_to():
    model, (x, y) = mlp(), batch(16)
    plan = forward_only(2, M)
    data = _data(x, y, build_graph=False)
    _on_threads(plan.programs, _stages(model), InProcessTransport([CPU, CPU]), data)
    expected = model(x).detach().chunk(M)
    for i in range(M):
        torch.testing.assert_close(data.outputs[i], expected[i], **EXACT)
        torch.testing.assert_close(data.losses[i], mse_loss(expected[i], y.chunk(M)[i]) / M)
    data = _data(x, y, build_graph=False, keep_outputs=False)
    _on_threads(plan.programs, _stages(model), InProcessTransport([CPU, CPU]), data)
    assert data.outputs == {} and len(data.losses) == M


def test_gradients_of_the_outputs_start_the_backward_and_those_of_the_inputs_come_back():
    """Without a loss in the pipeline: ``grad_outputs`` start the last stage's backward, and
    the first stage's input gradients are the step's."""
    model = mlp()
    x, g = batch(16)
    x.requires_grad_(True)
    stages = _stages(model, loss_fn=None)
    data = StepData(
        n_stages=2,
        build_graph=True,
        inputs=list(x.chunk(M)),
        grad_outputs=[(part,) for part in g.chunk(M)],
    )
    _on_threads(build("gpipe", 2, M).programs, stages, InProcessTransport([CPU, CPU]), data)
    (expected,) = torch.autograd.grad(mlp()(x), x, g)
    got = torch.cat([data.input_grads[i][0] for i in range(M)])
    torch.testing.assert_close(got, expected, **EXACT)


class _Fails(nn.Module):
    """Raises in the forward of its second call, or in the backward of its first."""

    def __init__(self, where: str):
        super().__init__()
        self.where, self.calls = where, 0

    def forward(self, x):
        self.calls += 1
        if self.where == "forward" and self.calls == 2:
            raise ValueError("from the user's layer")
        return _RaiseInBackward.apply(x) if self.where == "backward" else x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("from the user's backward")


@pytest.mark.parametrize(
    ("where", "note"),
    [
        ("forward", "raised in pipeline stage 1, forward of micro-batch 1"),
        ("backward", "raised in pipeline stage 1, backward of micro-batch 0"),
    ],
)
def test_an_error_in_a_stage_keeps_its_type_and_notes_the_stage_the_pass_and_micro_batch(
    where, note
):
    stages = _stages(mlp())
    stages[1].module.append(_Fails(where))
    with pytest.raises(ValueError, match="from the user's") as raised:
        run_program(
            _one_thread_program(), stages, InProcessTransport([CPU, CPU]), _data(*batch(16))
        )
    assert raised.value.__notes__ == [note]


def test_a_stop_set_by_a_failed_peer_ends_the_program_before_its_next_compute_action():
    ran = []
    stop = threading.Event()
    stop.set()
    with pytest.raises(PipelineError, match="stage 0: stopped because another stage failed"):
        run_program(
            _one_thread_program(),
            _stages(mlp()),
            InProcessTransport([CPU, CPU]),
            _data(*batch(16)),
            on_action=lambda action, start, end: ran.append(action),
            stop=stop,
        )
    assert ran == []


def test_a_first_stage_without_inputs_is_named():
    data = StepData(n_stages=2, build_graph=False)
    with pytest.raises(PipelineError, match="stage 0 was given no inputs"):
        run_program(forward_only(2, M).programs[0], _stages(mlp()), InProcessTransport([CPU]), data)
