"""Schedules: the GPipe generator's clock cycles and the validator's verdicts."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpipe.schedules import (
    Action,
    Kind,
    ScheduleError,
    clock_cycles,
    execution_order,
    forward_only,
    get_schedule,
    gpipe,
    validate,
)

F, B = Kind.FORWARD, Kind.BACKWARD


def test_clock_cycles_match_the_paper():
    # at cycle k, stage j works on micro-batch k - j
    assert clock_cycles(3, 2) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1)],
        [(2, 1)],
    ]


@given(st.integers(1, 40), st.integers(1, 16))
def test_clock_cycles_cover_every_pair_once(m, n):
    cycles = clock_cycles(m, n)
    assert len(cycles) == m + n - 1
    pairs = [p for cycle in cycles for p in cycle]
    assert sorted(pairs) == sorted((i, j) for i in range(m) for j in range(n))
    for k, cycle in enumerate(cycles):
        assert all(i + j == k for i, j in cycle)


def test_gpipe_program_of_a_middle_stage():
    program = [str(a) for a in gpipe(3, 2).programs[1]]
    assert program == [
        "1RECV_F0",
        "1F0",
        "1SEND_F0",
        "1RECV_F1",
        "1F1",
        "1SEND_F1",
        "1RECV_B1",
        "1B1",
        "1SEND_B1",
        "1RECV_B0",
        "1B0",
        "1SEND_B0",
    ]


@given(st.integers(1, 12), st.integers(1, 24))
def test_gpipe_is_valid_for_any_size(n_stages, m):
    schedule = validate(gpipe(n_stages, m))
    for rank in range(n_stages):
        compute = schedule.compute_only(rank)
        assert [a.kind for a in compute] == [F] * m + [B] * m
        assert [a.microbatch for a in compute] == list(range(m)) + list(reversed(range(m)))
    order = execution_order(schedule)
    assert len(order) == sum(len(p) for p in schedule.programs)


@given(st.integers(1, 8), st.integers(1, 16))
def test_forward_only_is_valid_and_has_no_backward(n_stages, m):
    schedule = validate(forward_only(n_stages, m))
    assert all(
        a.kind in (Kind.FORWARD, Kind.SEND_F, Kind.RECV_F) for p in schedule.programs for a in p
    )


def _replace_program(schedule, rank, program):
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return dataclasses.replace(schedule, programs=tuple(programs))


def test_validator_rejects_backward_before_its_forward():
    good = gpipe(1, 2)
    bad = _replace_program(
        good, 0, [Action(0, B, 0), Action(0, F, 0), Action(0, F, 1), Action(0, B, 1)]
    )
    with pytest.raises(ScheduleError, match="deadlock.*0B0.*needs 0F0"):
        validate(bad)


def test_validator_rejects_an_unmatched_receive():
    good = gpipe(2, 1)
    program = list(good.programs[0])
    program.remove(Action(0, Kind.SEND_F, 0))
    with pytest.raises(ScheduleError, match="lacks actions: 0SEND_F0"):
        validate(_replace_program(good, 0, program))


def test_validator_rejects_a_receive_order_that_differs_from_the_send_order():
    good = gpipe(2, 2)
    program = list(good.programs[1])
    i, j = program.index(Action(1, Kind.RECV_F, 0)), program.index(Action(1, Kind.RECV_F, 1))
    program[i], program[j] = program[j], program[i]
    with pytest.raises(ScheduleError, match="order"):
        validate(_replace_program(good, 1, program))


def test_validator_rejects_a_cycle_between_ranks():
    # each rank waits for the other's gradient before sending its own activations
    good = gpipe(2, 1)
    rank0 = [Action(0, Kind.RECV_B, 0), Action(0, F, 0), Action(0, Kind.SEND_F, 0), Action(0, B, 0)]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(_replace_program(good, 0, rank0))


def test_validator_rejects_duplicates_and_foreign_stages():
    good = gpipe(2, 1)
    with pytest.raises(ScheduleError, match="twice"):
        validate(_replace_program(good, 0, [*good.programs[0], Action(0, F, 0)]))
    with pytest.raises(ScheduleError, match="held by rank 1"):
        validate(_replace_program(good, 0, [*good.programs[0], Action(1, F, 0)]))


def test_unknown_schedule_name_lists_the_known_ones():
    with pytest.raises(
        ValueError,
        match=r"one of \['1f1b', 'dualpipe-v', 'gpipe', 'interleaved', 'interleaved-zero-bubble', "
        r"'looped-bfs', 'v-half', 'v-min', 'zero-bubble', 'zero-bubble-v'\], got 'fast'",
    ):
        get_schedule("fast")


@pytest.mark.parametrize("args", [(0, 4), (2, 0), (2.5, 4)])
def test_generator_rejects_bad_sizes(args):
    with pytest.raises(ValueError, match="positive integer"):
        gpipe(*args)


def _peak_live(program, release: Kind) -> int:
    """Most micro-batches between their forward and ``release`` at any point of a program."""
    live = peak = 0
    for a in program:
        if a.kind is F:
            live += 1
            peak = max(peak, live)
        elif a.kind is release:
            live -= 1
    return peak


@given(k=st.integers(1, 12), m=st.integers(1, 40))
def test_1f1b_is_valid_and_holds_at_most_k_minus_s(k, m):
    schedule = validate(get_schedule("1f1b")(k, m))
    for s, program in enumerate(schedule.programs):
        assert _peak_live(program, B) == min(k - s, m)


@given(k=st.integers(1, 12), m=st.integers(1, 40))
def test_zero_bubble_is_valid_and_holds_no_more_than_1f1b_at_its_peak(k, m):
    schedule = validate(get_schedule("zero-bubble")(k, m))
    assert schedule.split_backward
    for program in schedule.programs:
        assert _peak_live(program, Kind.WEIGHT) <= min(k, m)
        order = [a for a in program if a.is_compute]
        for i in range(m):  # every W after its B
            s = order[0].stage
            assert order.index(Action(s, Kind.WEIGHT, i)) > order.index(Action(s, B, i))


def test_zero_bubble_defers_w_on_later_stages():
    schedule = get_schedule("zero-bubble")(3, 5)
    assert " ".join(str(a) for a in schedule.compute_only(2)[:8]) == (
        "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3"
    )
    assert " ".join(str(a) for a in schedule.compute_only(0)[:6]) == "0F0 0F1 0F2 0B0 0W0 0F3"


def test_a_w_before_its_b_deadlocks():
    good = get_schedule("zero-bubble")(1, 2)
    program = list(good.programs[0])
    w = program.index(Action(0, Kind.WEIGHT, 0))
    program.insert(0, program.pop(w))
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(dataclasses.replace(good, programs=(tuple(program),)))


def test_a_v_balance_must_be_two_stages_per_process():
    import torch
    from torch import nn

    from gpipe.engine.placement import check_stages_per_rank
    from gpipe.planning.memory import plan, profile

    layers = nn.Sequential(*(nn.Linear(2, 2) for _ in range(6)))
    prof = profile(layers, torch.zeros(2, 2))
    for schedule in ("zero-bubble-v", "dualpipe-v", "v-half", "v-min"):
        with pytest.raises(ValueError, match="2K = 4 entries for 2 processes, got 6"):
            check_stages_per_rank(6, 2, schedule)
        with pytest.raises(ValueError, match="2K = 4 entries for 2 processes, got 6"):
            plan(prof, [1] * 6, batch_size=4, chunks=4, schedule=schedule, n_ranks=2)
        check_stages_per_rank(4, 2, schedule)
