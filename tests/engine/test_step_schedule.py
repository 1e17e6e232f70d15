"""A hand-built ``Schedule`` given to ``Pipeline`` is validated once, at construction: a
broken one is refused there, before any process joins, with the validator's error naming the
rank, the step and the action; a valid one is accepted and runs as given."""

import dataclasses
import re

import pytest
import torch
from torch.nn.functional import mse_loss

from gpipe import Pipeline
from gpipe.engine import ScheduleSource, StepSchedules
from gpipe.schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    add_recompute,
    add_skips,
    forward_only,
    gpipe,
    seq_chunked,
)

from ..small_models import batch, mlp
from ..workers import run


def _by_hand(*programs: str, microbatches: int = 2, ranks: tuple[int, ...] = ()) -> Schedule:
    """A schedule written as each rank's actions, printed as ``gpipe`` prints them
    (``1SEND_F0``); stage s on rank s, or on ``ranks[s]``."""
    parsed = tuple(
        tuple(
            Action(int(stage), Kind(kind), int(mb))
            for stage, kind, mb in re.findall(r"(\d+)([A-Z_]+)(\d+)", program)
        )
        for program in programs
    )
    ranks = ranks or tuple(range(len(programs)))
    return Schedule("by hand", len(ranks), microbatches, parsed, ranks)


# the last stage runs each micro-batch's backward right after its forward
ONE_F_ONE_B = (
    "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
    "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
)


def test_a_broken_hand_built_schedule_is_refused_at_construction_naming_rank_step_action():
    rank1 = "1B0 1RECV_F0 1F0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"  # a backward first
    broken = _by_hand(ONE_F_ONE_B[0], rank1)
    # refused before any process group is joined: this process has none
    with pytest.raises(ScheduleError, match=r"rank 1, step 0 waits at 1B0 \(needs 1F0\)"):
        Pipeline(mlp(), [4, 4], chunks=2, schedule=broken, loss_fn=mse_loss)


def test_an_action_run_twice_is_refused_at_construction_naming_rank_step_action():
    good = gpipe(2, 2)
    twice = dataclasses.replace(
        good, programs=((*good.programs[0], Action(0, Kind.FORWARD, 1)), good.programs[1])
    )
    with pytest.raises(ScheduleError, match=r"rank 0, step 8: action 0F1 appears twice"):
        Pipeline(mlp(), [4, 4], chunks=2, schedule=twice, loss_fn=mse_loss)


def test_skips_that_do_not_fit_a_hand_built_order_are_refused_when_the_steps_are_built():
    """Stage 1 forwards micro-batch 1 before 0, which is valid alone; a skip from stage 0 to
    stage 2 would reach stage 2 in another order than it is sent in."""
    hand = _by_hand(
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B1 0RECV_B0 0B0",
        "1RECV_F0 1RECV_F1 1F1 1SEND_F1 1F0 1SEND_F0 1RECV_B1 1B1 1SEND_B1 1RECV_B0 1B0 1SEND_B0",
        "2RECV_F1 2F1 2RECV_F0 2F0 2B1 2SEND_B1 2B0 2SEND_B0",
    )
    source = ScheduleSource.of(hand)  # valid without skips
    StepSchedules(source, 3, (0, 1, 2), (), "never")
    with pytest.raises(ScheduleError, match=r"rank 2, step 1: 2RECV_SKIP1@0: .* order"):
        StepSchedules(source, 3, (0, 1, 2), ((0, 2),), "never")


def _exact_step(pipe: Pipeline) -> None:
    """One step of ``pipe`` gives un-pipelined training's loss and gradients, in float64."""
    x, y = batch(5)
    reference = mlp()
    ref_loss = mse_loss(reference(x), y)
    ref_loss.backward()
    exact = {"rtol": 1e-12, "atol": 1e-14}
    loss = pipe.step(x, y)
    if pipe.is_last:
        torch.testing.assert_close(loss, ref_loss, **exact)
    ref_params = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **exact)


def hand_built_step() -> dict:
    """A Pipeline over the valid hand-built schedule: it runs as given, and computes what
    un-pipelined training computes; so does one whose first stage is on the last rank.
    Neither passes ``chunks``: a given schedule's micro-batch count is the default."""
    schedule = _by_hand(*ONE_F_ONE_B)
    pipe = Pipeline(mlp(), [4, 4], checkpoint="never", schedule=schedule, loss_fn=mse_loss)
    _exact_step(pipe)
    reversed_ranks = _by_hand(*reversed(ONE_F_ONE_B), ranks=(1, 0))
    turned = Pipeline(mlp(), [4, 4], schedule=reversed_ranks, loss_fn=mse_loss)
    _exact_step(turned)
    return {
        "name": pipe.schedule_name,
        "runs": pipe.schedule_for(2) == schedule,
        "chunks": (pipe.chunks, turned.chunks),
        "stages": turned.stages,
    }


def test_a_valid_hand_built_schedule_is_accepted_and_runs_as_given():
    results = run(hand_built_step, 2)
    assert results == {
        r: {"name": "by hand", "runs": True, "chunks": (2, 2), "stages": (1 - r,)} for r in range(2)
    }


def _idle_rank() -> Schedule:
    """gpipe's schedule of two stages, on three ranks: the third holds nothing."""
    two = gpipe(2, 2)
    return dataclasses.replace(two, programs=(*two.programs, ()))


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (forward_only(2, 2), "schedule 'forward-only' has no backward (backward=False): a "
         "Pipeline trains with it, so it needs each stage's backward of each micro-batch"),
        (add_recompute(gpipe(2, 2), frozenset({0})), "schedule 'gpipe' holds recomputations "
         "(R), which a Pipeline adds itself (it places them as checkpoint= says)"),
        (add_skips(gpipe(2, 2), ((0, 1),)), "holds skip actions, which a Pipeline adds itself"),
        (seq_chunked("1f1b", 2, 2, 2), "holds sub-sequences, which a Pipeline adds itself"),
        (_idle_rank(), "schedule 'gpipe' gives rank 2 no stage (stage_to_rank=(0, 1)): every "
         "process of a Pipeline holds one at least"),
    ],
)  # fmt: skip
def test_a_given_schedule_a_pipeline_cannot_train_with_is_refused_at_construction(
    schedule, message
):
    """Without a backward, a step left every gradient None, silently; with the pipeline's own
    additions, they were added twice; a rank without a stage has nothing to build."""
    with pytest.raises(ValueError, match=re.escape(message)):
        Pipeline(mlp(), [4, 4], schedule=schedule, loss_fn=mse_loss)


def test_a_step_with_fewer_rows_than_the_schedules_fewest_micro_batches_is_one_line():
    """chunks=2 under v-min on 2 processes, and a short last mini-batch of one row: the step's
    one micro-batch is refused in words that say what to pass, not the generator's."""
    source = ScheduleSource.of("v-min")
    assert source.build(2, 2, 2).n_microbatches == 2
    expected = (
        r"^schedule 'v-min' runs at least 2 micro-batches on 2 processes, but this step has 1 "
        r"\(fewer rows than that\): pass mini-batches of at least 2 rows$"
    )
    with pytest.raises(ValueError, match=expected):
        source.build(2, 1, 2)


def test_too_few_micro_batches_for_one_process_say_process_not_processes():
    """v-min on one process needs two micro-batches: both refusals count it as one process."""
    source = ScheduleSource.of("v-min")
    with pytest.raises(ValueError, match=r"at least 2 for 1 process, got chunks=1$"):
        source.check(2, 1, 1)
    with pytest.raises(ValueError, match=r"at least 2 micro-batches on 1 process, but"):
        source.build(1, 1, 2)


def test_too_few_micro_batches_of_ones_own_are_refused_asking_for_micro_batches_not_rows():
    """``step(microbatches=...)`` decides M itself: more rows would not help, so the refusal
    asks for micro-batches, at least the schedule's fewest, or exactly a fixed one's."""
    with pytest.raises(ValueError, match=r"has 1 \(microbatches= lists that many\): pass at "):
        ScheduleSource.of("v-min").build(2, 1, 2, given=True)
    fixed = ScheduleSource.of(gpipe(2, 3))
    expected = (
        r"^schedule 'gpipe' runs 3 micro-batches, but this step has 4 \(microbatches= lists "
        r"that many\): pass exactly 3 micro-batches$"
    )
    with pytest.raises(ValueError, match=expected):
        fixed.build(2, 4, 1, given=True)
    with pytest.raises(ValueError, match=r"has 2 \(fewer rows than chunks\): pass mini-batches"):
        fixed.build(2, 2, 1)
