"""Micro-batches that cost differently in the simulator (``Costs.microbatch_scale``, ``gpipe
simulate --microbatch-tokens``): every schedule scales each micro-batch's compute, equal
factors change nothing, and uneven micro-batches widen the bubble."""

import dataclasses

import pytest

from gpipe.cli import main
from gpipe.planning.simulate import Costs, compare, scenario, simulate
from gpipe.schedules import SCHEDULES, Kind, build

UNIT = Costs(forward=1.0, backward=1.0, weight=1.0)


@pytest.mark.parametrize("name", SCHEDULES)
def test_factors_of_one_change_no_schedule_and_factors_of_two_double_its_time(name):
    schedule, costs = scenario(name, 2, 4, UNIT)
    plain = simulate(schedule, costs)
    ones = simulate(schedule, costs.with_tokens([7, 7, 7, 7]))
    assert ones.compute_times == plain.compute_times
    doubled = simulate(schedule, dataclasses.replace(costs, microbatch_scale=[2.0] * 4))
    assert doubled.makespan == pytest.approx(2 * plain.makespan)


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_micro_batch_costs_its_share_on_every_schedule(name):
    factor = [1.0, 0.5, 2.0, 0.25]
    schedule, costs = scenario(name, 2, 4, dataclasses.replace(UNIT, microbatch_scale=factor))
    forward, backward, weight = (
        costs.per_stage(f, schedule.n_stages) for f in ("forward", "backward", "weight")
    )
    for _, action, start, end in simulate(schedule, costs, "always").events:
        s = action.stage
        cost = {
            Kind.FORWARD: forward[s],
            Kind.RECOMPUTE: forward[s],
            Kind.BACKWARD: backward[s] + (0.0 if schedule.split_backward else weight[s]),
            Kind.WEIGHT: weight[s],
        }[action.kind]
        assert end - start == pytest.approx(cost * factor[action.microbatch])


def test_uneven_micro_batches_widen_the_bubble_and_have_no_closed_form():
    even = compare(["gpipe"], 2, 8, UNIT.with_tokens([100] * 8))[0]
    uneven = compare(["gpipe"], 2, 8, UNIT.with_tokens([400, 30, 30, 30, 30, 30, 30, 220]))[0]
    assert uneven["bubble"] > even["bubble"] == pytest.approx(1 / 9)
    assert uneven["closed_form_bubble"] is None and even["closed_form_bubble"] is not None


def test_a_scale_of_the_wrong_length_or_value_is_refused():
    with pytest.raises(ValueError, match="microbatch_scale has 3 factors, but the schedule has 4"):
        simulate(build("gpipe", 2, 4), UNIT.with_tokens([1, 2, 3]))
    with pytest.raises(ValueError, match=r"microbatch_scale\[1\] must be a finite number >= 0"):
        Costs(forward=1.0, backward=1.0, microbatch_scale=[1.0, -1.0])
    with pytest.raises(ValueError, match="positive token counts"):
        UNIT.with_tokens([10, 0])
    assert "microbatch_scale" not in UNIT.to_dict()
    assert Costs(**UNIT.with_tokens([1, 3]).to_dict()).microbatch_scale == (0.5, 1.5)


def test_cli_takes_each_micro_batchs_tokens(capsys):
    args = ["simulate", "--stages", "2", "--schedule", "gpipe"]
    assert main([*args, "--microbatch-tokens", "400,30,30,30,30,30,30,220"]) == 0
    out = capsys.readouterr().out
    assert "8 micro-batches of 400,30,30,30,30,30,30,220 tokens" in out
    assert "33.3%" in out
    assert main([*args, "--chunks", "3", "--microbatch-tokens", "1,2"]) == 2
    assert "--chunks 3 but --microbatch-tokens lists 2" in capsys.readouterr().err
    assert main([*args, "--microbatch-tokens", "1,x"]) == 2
    assert "comma list of positive token counts" in capsys.readouterr().err
