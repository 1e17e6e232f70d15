"""Partitions: balance checks, layer names, and K-independent initialization."""

import pytest
import torch
from torch import nn

from gpipe.errors import BalanceError
from gpipe.runtime.partitions import (
    as_sequential,
    check_balance,
    even_balance,
    materialize,
    split_sequential,
)


@pytest.mark.parametrize(
    ("balance", "message"),
    [
        ([2, 2], r"module: 5, sum of balance: 4"),
        ([3, 0, 2], "positive integers"),
        ([6, -1], "positive integers"),
        ([2.5, 2.5], "positive integers"),
        ([], "at least one"),
        (None, "balance is required"),
        ("23", "list of ints"),
    ],
)
def test_bad_balance_is_explained(balance, message):
    with pytest.raises(BalanceError, match=message):
        check_balance(5, balance)


def test_even_balance():
    assert even_balance(10, 4) == [3, 3, 2, 2]
    with pytest.raises(BalanceError, match="cannot cut 2 layers into 3"):
        even_balance(2, 3)


def test_partitions_keep_the_layer_names():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    parts = split_sequential(model, [2, 3])
    assert [list(dict(p.named_children())) for p in parts] == [["0", "1"], ["2", "3", "4"]]


def test_shared_layers_and_non_sequential_modules_are_refused():
    layer = nn.Linear(2, 2)
    message = "duplicate children.*layer .2. is layer .0."
    with pytest.raises(ValueError, match=message):
        as_sequential(nn.Sequential(layer, nn.ReLU(), layer))
    with pytest.raises(TypeError, match="must be nn.Sequential"):
        as_sequential(nn.Linear(2, 2))
    # two layers holding one module: refused; holding one parameter: a tie (gpipe.parallel.ties)
    wrap = [nn.Sequential(layer), nn.Sequential(layer)]
    with pytest.raises(ValueError, match="duplicate parameters in distinct children.*'1.0'"):
        as_sequential(nn.Sequential(*wrap))
    other = nn.Linear(2, 2)
    other.weight = layer.weight
    assert len(as_sequential(nn.Sequential(layer, other))) == 2


def _meta_layers():
    with torch.device("meta"):
        return [nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)]


def test_meta_layers_initialize_by_index_not_by_position_in_a_stage():
    alone = materialize(_meta_layers()[2], 2, torch.device("cpu"), seed=7)
    layers = _meta_layers()
    for i, layer in enumerate(layers):
        materialize(layer, i, torch.device("cpu"), seed=7)
    assert torch.equal(alone.weight, layers[2].weight)
    assert not torch.equal(layers[0].weight[:2], layers[2].weight)
    other_seed = materialize(_meta_layers()[2], 2, torch.device("cpu"), seed=8)
    assert not torch.equal(alone.weight, other_seed.weight)


def test_materialize_leaves_the_global_random_state_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    materialize(_meta_layers()[0], 0, torch.device("cpu"), seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_real_layers_are_kept_as_they_are():
    layer = nn.Linear(3, 3)
    before = layer.weight.clone()
    assert torch.equal(materialize(layer, 0, torch.device("cpu"), seed=0).weight, before)
