"""Sequence-pipelined schedules: valid at every size, each micro-batch's sub-sequences forward
in order and backward in reverse on every stage, 1F1B's first stage holding (K - 1 + S)
units, which is (K - 1 + S) / S micro-batches, and a rank of zero-bubble-v's V at most
2K - 2 + 2S chunk-sized ones."""

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
    zero_bubble_v,
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
    n_stages = 2 * k if name == "zero-bubble-v" else k  # a V holds two stages a rank
    schedule = validate(seq_chunked(name, n_stages, m, s))
    validate(add_recompute(schedule, frozenset(range(0, m * s, 2))))
    assert schedule.n_microbatches == m * s and schedule.seq_chunks == s
    assert schedule.n_ranks == k and schedule.name == name
    assert schedule.split_backward == name.startswith("zero-bubble")
    for program in schedule.programs:
        for kind, step in ((Kind.FORWARD, 1), (Kind.BACKWARD, -1)):
            for stage in {a.stage for a in program}:
                units = [a.microbatch for a in program if a.kind is kind and a.stage == stage]
                assert sorted(units) == list(range(m * s))
                for i in range(m):  # sub-sequences forward in order, backward in reverse
                    mine = [u % s for u in units if u // s == i]
                    assert mine == list(range(s))[::step]
        # on each stage, a micro-batch's first backward comes after its last sub-sequence's
        # forward
        seen = set()
        for a in program:
            if a.kind is Kind.FORWARD:
                seen.add((a.stage, a.microbatch))
            elif a.kind is Kind.BACKWARD:
                assert (a.stage, a.microbatch // s * s + s - 1) in seen


@pytest.mark.parametrize(("k", "s"), [(2, 2), (2, 4), (4, 4), (8, 4)])
def test_1f1bs_first_stage_holds_k_minus_1_plus_s_units(k, s):
    m = 2 * k
    held = _held(seq_chunked("1f1b", k, m, s).programs[0])
    assert held == k - 1 + s
    assert _held(one_f_one_b(k, m).programs[0]) == k  # whole micro-batches, S times larger


@pytest.mark.parametrize(("k", "m", "s"), [(2, 8, 2), (2, 8, 4), (4, 8, 4), (3, 5, 3)])
def test_on_a_v_each_rank_holds_2k_minus_2_plus_2s_units_at_most(k, m, s):
    """zero-bubble-v's 2K chunk-sized micro-batches at S = 1; each rank reaches the cap
    wherever there are micro-batches enough to fill it."""
    schedule = seq_chunked("zero-bubble-v", 2 * k, m, s)
    held = [_held(program, (Kind.WEIGHT,)) for program in schedule.programs]
    assert max(held) <= 2 * k - 2 + 2 * s
    assert held[0] == min(2 * k - 2 + 2 * s, 2 * m * s)


@pytest.mark.parametrize(
    ("name", "whole", "per_rank"),
    [
        ("gpipe", gpipe, 1),
        ("1f1b", one_f_one_b, 1),
        ("zero-bubble", zero_bubble_h1, 1),
        ("zero-bubble-v", zero_bubble_v, 2),
    ],
)
def test_one_sub_sequence_is_the_schedule_itself(name, whole, per_rank):
    for k, m in ((1, 1), (3, 5), (4, 2)):
        stages = k * per_rank
        assert seq_chunked(name, stages, m, 1).programs == whole(stages, m).programs


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("interleaved", 2, 4, 2), r"seq_chunks runs with the schedules \['1f1b', 'gpipe', "),
        (("zero-bubble-v", 3, 4, 2), "zero-bubble-v places two stages per rank in a V"),
        (("1f1b", 2, 4, 0), "seq_chunks must be a positive integer, got 0"),
    ],
)
def test_what_it_cannot_build_is_refused(args, words):
    with pytest.raises(ValueError, match=words):
        seq_chunked(*args)
