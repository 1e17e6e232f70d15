"""Sequence-pipelined schedules: valid at every size, each micro-batch's sub-sequences forward
in order and backward in reverse on every stage, and 1F1B's first stage holding
(K - 1 + S) units, which is (K - 1 + S) / S micro-batches."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpipe.schedules import (
    Kind,
    add_recompute,
    gpipe,
    one_f_one_b,
    validate,
    zero_bubble_h1,
)
from gpipe.schedules.seq_chunked import SEQ_CHUNKED, seq_chunked


def _held(program, kinds=(Kind.BACKWARD,)) -> int:
    live = peak = 0
    for a in program:
        if a.kind is Kind.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind in kinds:
            live -= 1
    return peak


@given(
    st.sampled_from(sorted(SEQ_CHUNKED)), st.integers(1, 6), st.integers(1, 8), st.integers(1, 5)
)
def test_every_size_is_valid_and_keeps_each_micro_batchs_order(name, k, m, s):
    schedule = validate(seq_chunked(name, k, m, s))
    validate(add_recompute(schedule, frozenset(range(0, m * s, 2))))
    assert schedule.n_microbatches == m * s and schedule.seq_chunks == s
    assert schedule.split_backward == (name == "zero-bubble")
    for program in schedule.programs:
        for kind, step in ((Kind.FORWARD, 1), (Kind.BACKWARD, -1)):
            units = [a.microbatch for a in program if a.kind is kind]
            assert sorted(units) == list(range(m * s))
            for i in range(m):  # sub-sequences forward in order, backward in reverse
                mine = [u % s for u in units if u // s == i]
                assert mine == list(range(s))[::step]
        # a micro-batch's first backward comes after its last sub-sequence's forward
        seen = set()
        for a in program:
            if a.kind is Kind.FORWARD:
                seen.add(a.microbatch)
            elif a.kind is Kind.BACKWARD:
                assert a.microbatch // s * s + s - 1 in seen


@pytest.mark.parametrize(("k", "s"), [(2, 2), (2, 4), (4, 4), (8, 4)])
def test_1f1bs_first_stage_holds_k_minus_1_plus_s_units(k, s):
    m = 2 * k
    held = _held(seq_chunked("1f1b", k, m, s).programs[0])
    assert held == k - 1 + s
    assert _held(one_f_one_b(k, m).programs[0]) == k  # whole micro-batches, S times larger


@pytest.mark.parametrize(
    ("name", "whole"), [("gpipe", gpipe), ("1f1b", one_f_one_b), ("zero-bubble", zero_bubble_h1)]
)
def test_one_sub_sequence_is_the_schedule_itself(name, whole):
    for k, m in ((1, 1), (3, 5), (4, 2)):
        assert seq_chunked(name, k, m, 1).programs == whole(k, m).programs


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("interleaved", 2, 4, 2), r"seq_chunks runs with the schedules \['1f1b', 'gpipe', "),
        (("1f1b", 2, 4, 0), "seq_chunks must be a positive integer, got 0"),
    ],
)
def test_what_it_cannot_build_is_refused(args, words):
    with pytest.raises(ValueError, match=words):
        seq_chunked(*args)
