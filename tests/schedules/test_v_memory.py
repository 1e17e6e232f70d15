"""V-Half and V-Min: valid at every size, each rank capped at its bound, the bound about a
half and a third of 1F1B's, and V-Min's fewest micro-batches named when refused."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpipe.planning.simulate import Costs, closed_form_bubble, closed_form_peak, simulate
from gpipe.schedules import Kind, build, traits, v_half, v_min, validate
from gpipe.schedules.v_memory import v_half_cap, v_min_cap, v_min_fewest


def _held(program) -> int:
    """Most chunk-sized micro-batches a rank holds: from each forward to its weight gradient."""
    live = peak = 0
    for a in program:
        if a.kind is Kind.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind is Kind.WEIGHT:
            live -= 1
    return peak


@given(st.sampled_from(["v-half", "v-min"]), st.integers(1, 8), st.integers(1, 32))
def test_each_rank_holds_its_cap_at_most_and_reaches_it(name, k, m):
    if not traits(name).runs(k, m):
        return
    schedule = validate(build(name, k, m))
    assert schedule.split_backward
    assert schedule.stage_to_rank == tuple(min(s, 2 * k - 1 - s) for s in range(2 * k))
    cap = v_half_cap(k) if name == "v-half" else v_min_cap(k)
    assert [_held(p) for p in schedule.programs] == [min(cap, 2 * m)] * k


def test_the_caps_are_about_a_half_and_a_third_of_1f1bs():
    """1F1B's first rank holds K micro-batches, 2K half-stage chunks."""
    assert [v_half_cap(k) for k in (1, 2, 4, 8, 32)] == [2, 3, 5, 9, 33]
    assert [v_min_cap(k) for k in (1, 2, 4, 5, 8, 32)] == [2, 2, 4, 4, 6, 22]
    assert v_half_cap(64) / 128 < 0.51 and v_min_cap(64) / 128 < 0.35


def test_v_min_with_too_few_micro_batches_names_its_fewest():
    assert [v_min_fewest(k) for k in (1, 2, 4, 8)] == [2, 2, 3, 4]
    with pytest.raises(
        ValueError, match="^v-min needs at least 3 micro-batches for 4 ranks .* got 2$"
    ):
        v_min(8, 2)
    with pytest.raises(ValueError, match="^v-min needs at least 2 micro-batches for 1 rank "):
        v_min(2, 1)
    with pytest.raises(ValueError, match="needs 2 stages, got 4 for 1 rank$"):
        v_half(4, 4, n_ranks=1)
    with pytest.raises(ValueError, match="needs an even number of stages, got 3$"):
        v_half(3, 4)
    assert traits("v-min").fewest_microbatches(4) == 3 and not traits("v-min").runs(4, 2)
    assert closed_form_peak("v-min", 4, 2) is None and closed_form_bubble("v-min", 4, 2) is None
    v_half(8, 1)  # v-half takes any number


def test_on_two_ranks_v_half_keeps_1f1bs_step_and_v_min_holds_one_micro_batch():
    """F = B = W per stage (1F1B's stages twice as long, its backward whole): at M = 8 V-Half
    ends when 1F1B does holding 3 of its 4 halves, V-Min 1.2 x later holding 2, the least a
    V can (both chunks of one micro-batch)."""
    one_f_one_b = simulate(build("1f1b", 2, 8), Costs(2, 4, activation_bytes=2))
    half = simulate(build("v-half", 2, 8), Costs(1, 1, 1, activation_bytes=1))
    least = simulate(build("v-min", 2, 8), Costs(1, 1, 1, activation_bytes=1))
    assert one_f_one_b.makespan == half.makespan == 54 and least.makespan == 65
    assert max(one_f_one_b.peak_rank_activation_bytes) == 4
    assert half.peak_rank_activation_bytes == (3, 3)
    assert least.peak_rank_activation_bytes == (2, 2)
    assert closed_form_bubble("v-half", 2, 8, 2, 2, 2, 2) == half.bubble == 6 / 54
    assert closed_form_bubble("v-min", 2, 8, 2, 2, 2, 2) == least.bubble == 17 / 65


def test_the_order_on_two_ranks():
    """B first, then a forward the cap allows (chunk 1 first), then W; rank 1 turns."""
    schedule = v_min(4, 3)
    assert " ".join(map(str, schedule.compute_only(0)[:8])) == "0F0 3F0 3B0 3W0 0F1 0B0 0W0 3F1"
    assert " ".join(map(str, schedule.compute_only(1)[:6])) == "1F0 2F0 2B0 1B0 2W0 1F1"


@given(
    st.sampled_from(["v-half", "v-min"]),
    st.integers(1, 2),
    st.integers(2, 40),
    st.sampled_from([0.5, 1.0, 3.0]),
)
def test_the_closed_form_bubble_is_the_simulators_on_one_and_two_ranks(name, k, m, f):
    schedule = build(name, k, m)
    costs = Costs(f / 2, f / 2, f / 2)  # a rank's F = B = W = f, cut into its two stages
    assert simulate(schedule, costs).bubble == pytest.approx(
        closed_form_bubble(name, k, m, 2, f, f, f), abs=1e-12
    )
