"""Split models through Pipeline over real processes (gloo): exact against the model."""

import pytest

from ..workers import run
from . import split_cases as cases


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("mode", ["always", "never"])
def test_a_split_language_model_trains_exactly(schedule, mode):
    results = run(cases.lm, 2, (["blocks.2"], schedule, mode))
    assert results[0] == results[1] == 3


def test_parts_and_three_stages():
    assert run(cases.lm, 2, (None, "1f1b", "except_last"))[0] == 3
    assert run(cases.lm, 3, (["blocks.1", "blocks.3"], "gpipe", "always"))[2] == 3


def test_each_rank_materializes_and_loads_only_its_stage():
    results = run(cases.meta_then_loaded, 2)
    assert "blocks.0.mix.weight" in results[0] and "blocks.0.mix.weight" not in results[1]
    assert "head.bias" in results[1] and "head.bias" not in results[0]
    assert "embed.weight" in results[0] and "head.weight" in results[1]  # a tie's aliases


def test_a_residual_network_cut_inside_its_stages():
    results = run(cases.resnet, 3)
    assert all(n > 0 for n in results.values())
