"""Advice on M: each schedule's own bubble, the fewest micro-batches that bring it under 10 %,
and the one line `gpipe plan` prints below the paper's M >= 4K (`gpipe train`'s: cli/test_train)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe.cli import main
from gpipe.planning.advice import (
    MOST_CHUNKS,
    TARGET_BUBBLE,
    bubble,
    chunks_advice,
    chunks_for_bubble,
)
from gpipe.planning.simulate import Costs, closed_form_bubble, scenario, simulate
from gpipe.schedules import SCHEDULES, traits

UNIT = Costs(forward=1.0, backward=1.0, weight=1.0)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize(("stages", "chunks"), [(2, 2), (4, 4), (4, 8), (3, 12)])
def test_the_bubble_is_the_simulators_with_the_runs_checkpoint_mode(
    schedule, checkpoint, stages, chunks
):
    if not traits(schedule).runs(stages, chunks, 2):
        with pytest.raises(ValueError, match="micro-batches"):
            bubble(schedule, stages, chunks, virtual_stages=2, checkpoint=checkpoint)
        return
    got = bubble(schedule, stages, chunks, virtual_stages=2, checkpoint=checkpoint)
    simulated = simulate(*scenario(schedule, stages, chunks, UNIT, 2), checkpoint).bubble
    assert got == pytest.approx(simulated, abs=1e-12)
    v = traits(schedule).stages_per_rank(2)
    closed = closed_form_bubble(schedule, stages, chunks, v, 1.0, 1.0, 1.0)
    if checkpoint == "never" and closed is not None:
        assert got == closed


def test_recomputation_dilutes_the_bubble():
    never = bubble("gpipe", 4, 8)
    assert never == pytest.approx(3 / 11)
    assert bubble("gpipe", 4, 8, checkpoint="always") < never


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(list(SCHEDULES)),
    st.integers(2, 8),
    st.sampled_from(["never", "except_last", "always"]),
)
def test_chunks_for_bubble_is_the_fewest_under_the_target(schedule, stages, checkpoint):
    m = chunks_for_bubble(schedule, stages, virtual_stages=2, checkpoint=checkpoint)
    options = {"virtual_stages": 2, "checkpoint": checkpoint}
    if m is None:  # a memory cap keeps processes waiting: none up to the most advised
        assert schedule == "v-min"
        assert bubble(schedule, stages, MOST_CHUNKS, **options) >= TARGET_BUBBLE
        return
    assert bubble(schedule, stages, m, **options) < TARGET_BUBBLE
    step = stages if traits(schedule).microbatches_per_round else 1
    assert m % step == 0
    if m > step and traits(schedule).runs(stages, m - step, 2):
        assert bubble(schedule, stages, m - step, **options) >= TARGET_BUBBLE


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_no_fewer_micro_batches_reach_the_target(schedule, checkpoint):
    """Against a plain scan from one micro-batch up: the bisection's answer is the first."""
    for stages in (2, 3, 5):
        options = {"virtual_stages": 2, "checkpoint": checkpoint}
        step = stages if traits(schedule).microbatches_per_round else 1
        m = step
        while not traits(schedule).runs(stages, m, 2):
            m += step
        if schedule == "v-min":  # its cap keeps processes waiting: the bubble stays above
            assert bubble(schedule, stages, MOST_CHUNKS, **options) >= TARGET_BUBBLE
            assert chunks_for_bubble(schedule, stages, **options) is None
            continue
        while bubble(schedule, stages, m, **options) >= TARGET_BUBBLE:
            m += step
        found = chunks_for_bubble(schedule, stages, **options)
        if schedule == "v-half":  # its bubble shrinks with small ups and downs
            assert bubble(schedule, stages, found, **options) < TARGET_BUBBLE
            assert bubble(schedule, stages, found - 1, **options) >= TARGET_BUBBLE
            assert m <= found <= m + 2
            continue
        assert found == m


@pytest.mark.parametrize("stages", [2, 4, 8, 16])
def test_gpipe_needs_nine_micro_batches_per_extra_stage_and_one(stages):
    # (K-1)/(M+K-1) < 0.1  <=>  M > 9(K-1)
    assert chunks_for_bubble("gpipe", stages) == 9 * (stages - 1) + 1


def test_v_min_is_told_that_no_number_of_micro_batches_brings_its_bubble_under():
    line = chunks_advice("v-min", 2, 4)
    assert line is not None and line.endswith(
        f"; no --chunks up to {MOST_CHUNKS} brings it under {TARGET_BUBBLE:.0%}"
    )


def test_no_advice_at_or_above_the_rule_of_thumb_or_on_one_process():
    assert chunks_advice("gpipe", 4, 16) is None
    assert chunks_advice("gpipe", 4, 40) is None
    assert chunks_advice("gpipe", 1, 1) is None


def test_the_advice_is_one_line_with_the_bubble_and_the_chunks_that_fix_it():
    line = chunks_advice("gpipe", 4, 8, checkpoint="never", batch_size=32)
    assert "\n" not in line
    assert "--chunks 8 is below 4 x --stages 4" in line
    assert "gpipe's predicted bubble is 27.3%" in line
    assert "--chunks 28 would bring it under 10% (9.7%)" in line
    short = chunks_advice("1f1b", 4, 8, checkpoint="never", batch_size=16)
    assert "--chunks 28 (and --batch-size 28) would" in short
    # two replicas share the global batch: each needs a row per micro-batch
    shared = chunks_advice("gpipe", 4, 8, checkpoint="never", batch_size=32, data_parallel=2)
    assert "--chunks 28 (and --batch-size 56) would" in shared


def test_a_schedule_already_under_the_target_is_told_so():
    line = chunks_advice("zero-bubble", 4, 8, checkpoint="always")
    assert "zero-bubble's predicted bubble is 8.6%, already under 10%" in line


def _plan(capsys, *more):
    args = ["plan", "--d-model", "64", "--n-head", "2", "--vocab-size", "100", "--seq-len", "16",
            "--n-layer", "6", "--batch-size", "32", "--device-memory", "1GiB", *more]  # fmt: skip
    assert main(args) == 0
    return capsys.readouterr().out


def test_plan_says_when_chunks_are_below_four_per_stage(capsys):
    out = _plan(capsys, "--stages", "4", "--chunks", "8", "--schedule", "interleaved",
                "--virtual-stages", "2", "--checkpoint", "never")  # fmt: skip
    (line,) = [x for x in out.splitlines() if x.startswith("note:")]
    assert "interleaved's predicted bubble is 15.8%; --chunks 16 would bring it under" in line
    assert "note:" not in _plan(capsys, "--stages", "4", "--chunks", "16")
