"""``schedule="auto"``'s choice: the fastest configuration the planner fits, as the search
ranks them, announced with the runner-up; it follows the costs (many micro-batches where rows
cost, few where each call does); bad settings in one line. Across processes:
tests/engine/test_distributed_schedules.py."""

import pytest
import torch

from gpipe.models.gpt import GPTConfig, build_gpt
from gpipe.planning.auto import VIRTUAL_STAGES, check_auto, choose
from gpipe.planning.memory import profile
from gpipe.planning.suggest import LayerCosts, candidates, search
from gpipe.runtime.recompute import Layers
from gpipe.schedules import traits

GPT = GPTConfig(n_layer=6, d_model=64, n_head=2, vocab_size=500, seq_len=32)
ROWS = 16


@pytest.fixture(scope="module")
def gpt():
    return build_gpt(GPT, device="meta"), torch.zeros(ROWS, GPT.seq_len, dtype=torch.int64)


def _costs(n: int, fixed: float, per_row: float) -> LayerCosts:
    return LayerCosts((fixed,) * n, (per_row,) * n, "s", "given")


def test_the_choice_is_the_searchs_fastest_and_the_runner_up_another_schedule(gpt):
    layers, tokens = gpt
    costs = _costs(len(layers), 1e-4, 1e-3)
    choice = choose(layers, tokens, n_ranks=2, device_bytes=2**40, costs=costs)
    found = search(
        profile(layers, tokens[: ROWS // 2].to("meta")),
        costs,
        batch_size=ROWS,
        device_bytes=2**40,
        stages=[2],
        checkpoints=["except_last"],
        virtual_stages=VIRTUAL_STAGES,
    )
    assert choice.chosen == found.ranked[0]
    assert choice.searched == found.searched
    up = choice.runner_up
    assert up is not None and up.step_time >= choice.chosen.step_time
    assert (up.schedule, up.virtual_stages) != (choice.schedule, choice.chosen.virtual_stages)
    assert len(choice.balance) == 2 * traits(choice.schedule).stages_per_rank(
        choice.chosen.virtual_stages
    )
    line = choice.announcement()
    assert "\n" not in line and line.startswith(f"schedule auto: {choice.schedule}")
    assert f"runner-up {up.schedule}" in line and f"bubble {choice.chosen.bubble:.1%}" in line


def test_rows_that_cost_ask_for_many_micro_batches_calls_that_cost_for_few(gpt):
    layers, tokens = gpt
    by_rows = choose(
        layers,
        tokens,
        n_ranks=2,
        device_bytes=2**40,
        checkpoint="never",
        costs=_costs(len(layers), 0.0, 1e-3),
    )
    assert by_rows.chunks == ROWS  # the bubble shrinks as M grows, and nothing else costs
    # recomputing all but the last micro-batch costs a forward each: fewer of them pay
    recomputed = choose(
        layers, tokens, n_ranks=2, device_bytes=2**40, costs=_costs(len(layers), 0.0, 1e-3)
    )
    assert recomputed.chunks < ROWS
    assert traits(by_rows.schedule).split_backward  # a zero-bubble schedule fills it best
    by_calls = choose(
        layers,
        tokens,
        n_ranks=2,
        device_bytes=2**40,
        checkpoint="never",
        costs=_costs(len(layers), 1e-3, 0.0),
    )
    assert by_calls.chunks == min(m for m in (1, 2, 4) if traits(by_calls.schedule).runs(2, m, 2))


def test_a_budget_too_small_and_no_schedule_at_all_are_named(gpt):
    layers, tokens = gpt
    costs = _costs(len(layers), 0.0, 1e-3)
    with pytest.raises(ValueError, match=r"nothing fits in 1.00 KiB per process; the least"):
        choose(layers, tokens, n_ranks=2, device_bytes=1024, costs=costs)
    with pytest.raises(ValueError, match=r"no schedule for 8 layers on 2 processes .* in 32"):
        choose(layers, tokens, n_ranks=2, device_bytes=2**40, chunks=32, costs=costs)
    with pytest.raises(ValueError, match="searches with checkpoint 'always', 'except_last' or"):
        choose(layers, tokens, n_ranks=2, device_bytes=2**40, checkpoint="some", costs=costs)


def test_auto_leaves_the_cut_to_the_search():
    assert check_auto("1f1b", [1, 2], "never") is False
    assert check_auto("auto", None, "never") is True
    with pytest.raises(ValueError, match="chooses the balance too: leave balance=None"):
        check_auto("auto", [4, 4], "never")
    with pytest.raises(ValueError, match="searches with checkpoint 'always', 'except_last'"):
        check_auto("auto", None, Layers(every=2))


def test_the_grid_takes_several_stages_per_process():
    grid = candidates(8, 8, stages=[2], chunks=[4], checkpoints=["never"], virtual_stages=(2, 3))
    per_rank = {(name, v) for _, _, name, _, v in grid}
    assert {("interleaved", 2), ("interleaved", 3), ("looped-bfs", 3)} <= per_rank
    assert {v for name, v in per_rank if name in ("zero-bubble-v", "dualpipe-v")} == {2}
    assert {v for name, v in per_rank if name == "1f1b"} == {1}


def test_a_budget_only_v_min_fits_chooses_v_min(gpt):
    """The capped V schedules are candidates like any other: where only the least memory
    fits, auto takes it."""
    layers, tokens = gpt
    costs = _costs(len(layers), 0.0, 1e-3)
    found = search(
        profile(layers, tokens[: ROWS // 2].to("meta")),
        costs,
        batch_size=ROWS,
        device_bytes=2**40,
        stages=[2],
        chunks=[8],
        checkpoints=["never"],
        virtual_stages=VIRTUAL_STAGES,
    )
    least = {}
    for c in found.ranked:
        least[c.schedule] = min(least.get(c.schedule, c.peak_bytes), c.peak_bytes)
    assert {"v-half", "v-min"} <= least.keys()
    others = min(peak for name, peak in least.items() if name != "v-min")
    assert least["v-min"] < others
    choice = choose(
        layers,
        tokens,
        n_ranks=2,
        device_bytes=(least["v-min"] + others) / 2,
        chunks=8,
        checkpoint="never",
        costs=costs,
    )
    assert choice.schedule == "v-min" and choice.runner_up is None
