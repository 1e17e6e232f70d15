"""The step runner (``gpipe.engine.StepRunner``) built by hand, without a facade: a training
step gives the un-pipelined loss and gradients and says where its time went; an evaluation and
a forward alone keep no graph; outputs come back whole or as each micro-batch's; a failed step
leaves nothing behind for the next; each step begins its transport with the programs of its
schedule and the step's size. In this process, both stages on its one rank; then a stage on
each of two processes, where the second reads the step's size off its first message, and a
call that failed on one of them leaves nothing that the next calls take for theirs; a step
that fails on one rank ends at once on the others, naming it, and a retry at once is exact."""

import re

import pytest
import torch
from torch import nn

from gpipe.runtime.timeline import Recorder

from ..small_models import batch, mlp
from ..workers import run
from . import runner_cases as cases
from .runner_cases import CHUNKS, EXACT

BALANCE = (4, 4)  # two stages on the one rank, looped
SCHEDULE = "interleaved"


@pytest.fixture
def runner(one_process_group):
    return cases.runner(mlp(), BALANCE, SCHEDULE)


def _train(runner, x, y, **options):
    options = {"scale": 1.0, "counts": None, "keep_outputs": False, "training": True} | options
    return runner.train(x, y, **options)


def test_a_training_step_gives_the_unpipelined_loss_and_gradients_and_where_its_time_went(
    runner,
):
    x, y = batch(16)
    loss, times = _train(runner, x, y)
    expected_loss, expected_grads = cases.reference(x, y)
    torch.testing.assert_close(loss, expected_loss.double(), **EXACT)
    cases.check_grads(runner, expected_grads)
    assert 0 < times.busy <= times.total and 0 <= times.idle_fraction < 1
    assert (times.allreduce_wait, times.allreduce_buckets, times.allreduce_early) == (0, 0, 0)


def test_kept_outputs_are_the_mini_batchs_and_each_micro_batchs_loss(runner):
    x, y = batch(10)
    result, _ = _train(runner, x, y, keep_outputs=True)
    model = mlp()
    torch.testing.assert_close(result.outputs, model(x).detach(), **EXACT)
    assert not result.outputs.requires_grad
    parts = zip(x.split([3, 3, 2, 2]), y.split([3, 3, 2, 2]), strict=True)
    expected = [nn.functional.mse_loss(model(a), b).detach() for a, b in parts]
    assert len(result.losses) == CHUNKS
    for got, want in zip(result.losses, expected, strict=True):
        torch.testing.assert_close(got, want, **EXACT)


def test_an_evaluation_is_the_loss_of_a_forward_alone(runner):
    x, y = batch(12)
    loss = runner.evaluate(x, y, counts=None, keep_outputs=False, training=True)
    torch.testing.assert_close(loss, nn.functional.mse_loss(mlp()(x), y).double(), **EXACT)
    assert all(p.grad is None for s in runner.stages.values() for p in s.module.parameters())


def test_a_forward_gathers_the_outputs_or_keeps_what_each_micro_batch_is_asked_for(runner):
    x, _ = batch(9)
    expected = mlp()(x).detach()
    torch.testing.assert_close(runner.forward(x, training=False), expected, **EXACT)
    kept = runner.forward_each(x, False, outputs_for=lambda sizes: {"sizes": sizes})
    assert kept is not None and len(kept) == CHUNKS
    assert [out.shape[0] for out in kept] == [3, 2, 2, 2]


def test_fewer_rows_than_chunks_make_fewer_micro_batches(runner):
    x, y = batch(2)
    result, _ = _train(runner, x, y, keep_outputs=True)
    assert len(result.losses) == 2


def test_a_failed_step_leaves_nothing_behind_for_the_next(one_process_group):
    model = mlp()
    model.insert(6, cases.FailsOnce())  # in the second stage
    runner = cases.runner(model, (4, 5), SCHEDULE)
    x, y = batch(16)
    with pytest.raises(ValueError, match="once"):
        _train(runner, x, y)
    # a Stage shows what it holds for a backward only in its private _saved: nothing, here
    assert all(not stage._saved for stage in runner.stages.values())
    for stage in runner.stages.values():
        stage.module.zero_grad(set_to_none=True)
    loss, _ = _train(runner, x, y)
    torch.testing.assert_close(loss, cases.reference(x, y)[0].double(), **EXACT)


class _Noting:
    """The runner's transport, noting how each step begins it and with what info words."""

    def __init__(self, transport):
        self._transport, self.begun = transport, []

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def __setattr__(self, name, value):
        if name == "info":
            self._transport.info = value
        else:
            object.__setattr__(self, name, value)

    def begin(self, programs, rank):
        self.begun.append((programs, rank, self._transport.info))
        self._transport.begin(programs, rank)


def test_each_step_begins_its_transport_with_its_schedules_programs_and_its_size(runner):
    runner.transport = noting = _Noting(runner.transport)
    x, y = batch(16)
    _train(runner, x, y)
    runner.evaluate(x, y, counts=None, keep_outputs=False, training=False)
    step, forward = runner.schedules.step(CHUNKS, True), runner.schedules.forward(CHUNKS)
    assert noting.begun == [(step.programs, 0, (CHUNKS, 16)), (forward.programs, 0, (CHUNKS, 16))]


def test_a_traced_step_records_every_action_of_its_program(one_process_group):
    recorder = Recorder(0)
    runner = cases.runner(mlp(), BALANCE, SCHEDULE, recorder=recorder)
    _train(runner, *batch(16))
    program = runner.schedules.step(CHUNKS, True).programs[0]
    recorded = sorted((e.stage, e.kind, e.microbatch) for e in recorder.events())
    assert recorded == sorted((a.stage, a.kind.value, a.microbatch) for a in program)


@pytest.mark.parametrize("local_pipes", [False, True], ids=["gloo", "pipes"])
def test_a_stage_on_each_of_two_processes_and_the_second_reads_the_steps_size(local_pipes):
    results = run(cases.two_ranks, 2, (local_pipes,), threads=1)
    assert results[0]["loss"] == results[1]["loss"]
    assert results[0]["info"] == results[1]["info"] == (CHUNKS, 10)


@pytest.mark.parametrize("local_pipes", [False, True], ids=["gloo", "pipes"])
def test_a_call_that_failed_on_one_process_leaves_nothing_the_next_calls_take(local_pipes):
    """The first process saw no error (it sent every micro-batch and returned); what the
    second did not take is dropped, and the calls after it are exact on both."""
    results = run(cases.after_a_failed_call, 2, (local_pipes,), threads=1)
    assert results == {0: None, 1: "once"}


def test_a_step_that_failed_after_the_last_stage_broadcast_its_loss_leaves_no_loss_behind():
    """The first stage fails in a backward after the last stage has done all of its part
    and broadcast the loss; that broadcast, taken by nobody, is no later step's loss."""
    results = run(cases.after_a_failed_backward, 2, (), threads=1)
    assert results[0] == results[1]  # the same steps failed on both ranks
    assert results[0] in ([0], [0, 1])  # and the last two ran, exactly


def test_a_forward_alone_after_a_failed_step_takes_its_own_broadcast_not_the_steps():
    results = run(cases.forward_only_after_a_failed_step, 2, (), threads=1)
    assert results[0]  # the first stage's backward failed; the last stage may not know it


def test_steps_refused_on_the_first_stage_before_it_sent_anything_leave_the_next_exact():
    results = run(cases.after_two_refused_steps, 2, (), threads=1)
    assert results == {0: ["TypeError"] * 2, 1: ["StageError"] * 2}


OOM = "OutOfMemoryError: out of memory in the loss"
GRADIENTS = r"gradients of micro-batch \d from stage {}"


def _told(rank: int, waited_for: str, failed: int, error: str) -> str:
    """How rank ``rank``'s step ends when it hears of stage ``failed``'s ``error``."""
    told = f"stage {failed} failed: {re.escape(error)}"
    return f"StageError: stage {rank}: stopped waiting for {waited_for}: {told}"


# how each rank's failed step ends: its own error, or a StageError that names the stage that
# failed first and its error (in "last of three", relayed to the first stage by the middle)
ENDED = {
    "loss": [_told(0, GRADIENTS.format(1), 1, OOM), OOM],
    "backward": [
        "ValueError: backward once",
        _told(1, "the loss to be taken", 0, "ValueError: backward once"),
    ],
    "middle": [
        _told(0, GRADIENTS.format(1), 1, "ValueError: once"),
        "ValueError: once",
        _told(2, "activations of micro-batch 2 from stage 1", 1, "ValueError: once"),
    ],
    "last of three": [
        _told(0, GRADIENTS.format(1), 2, OOM),
        _told(1, GRADIENTS.format(2), 2, OOM),
        OOM,
    ],
}


@pytest.mark.parametrize(
    ("case", "local_pipes"),
    [
        ("loss", True),
        ("loss", False),
        ("backward", True),
        ("middle", True),
        ("last of three", False),
    ],
)
def test_a_step_that_fails_on_one_rank_ends_at_once_on_the_others_and_a_retry_is_exact(
    case, local_pipes
):
    """Each peer of the failing rank raises a StageError naming the stage that failed and its
    error as soon as it hears (not at the timeout of 30 s, after which the failing rank's
    retry could time out waiting for it in turn); then a retry on every rank is exact."""
    n = len(cases.FAILURES[case][1])
    ended = run(cases.failed_then_retried, n, (case, local_pipes), threads=1)
    for rank, wanted in enumerate(ENDED[case]):
        assert re.fullmatch(wanted, ended[rank]), (rank, ended[rank])
