"""Balancing: the partitioner is optimal (against brute force), and the profilers leave the
model as it was."""

import copy
import itertools
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from gpipe.planning.balancing import (
    balance_by_params,
    balance_by_size,
    balance_by_time,
    layer_times,
    partition,
)


def _best(costs, parts):
    """The smallest possible largest part, by trying every cut."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@given(
    costs=st.lists(st.integers(0, 20), min_size=1, max_size=9),
    parts=st.integers(1, 9),
)
def test_partition_is_optimal(costs, parts):
    if parts > len(costs):
        with pytest.raises(ValueError, match="non-empty partitions"):
            partition(costs, parts)
        return
    sizes = partition(costs, parts)
    assert len(sizes) == parts and all(s >= 1 for s in sizes) and sum(sizes) == len(costs)
    bounds = [0, *itertools.accumulate(sizes)]
    largest = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
    assert largest == _best(costs, parts)


def test_equal_costs_give_even_parts_and_ties_lean_even():
    assert partition([1] * 8, 4) == [2, 2, 2, 2]
    assert partition([0] * 5, 2) in ([3, 2], [2, 3])
    assert partition([5, 1, 1, 1, 1, 1], 2) == [1, 5]


def test_partition_rejects_bad_input():
    with pytest.raises(ValueError, match="parts must be a positive integer, got 0"):
        partition([1, 2], 0)
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 non-empty partitions"):
        partition([1, 2], 3)
    with pytest.raises(ValueError, match="costs must be non-negative"):
        partition([1, -2], 1)


def test_10000_layers_into_128_parts():
    costs = torch.rand(10_000, generator=torch.Generator().manual_seed(0)).tolist()
    start = time.perf_counter()
    sizes = partition(costs, 128)
    print(f"partition 10,000 layers into 128: {time.perf_counter() - start:.3f} s")
    assert sum(sizes) == 10_000 and len(sizes) == 128


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 2)
    )


def test_by_params_follows_parameter_counts():
    # 576, 128, 0, 4160 and 130 parameters: the big Linear alone against the rest
    assert balance_by_params(2, _model()) in ([2, 3], [3, 2])
    assert balance_by_params(4, _model()) in ([1, 2, 1, 1], [2, 1, 1, 1])


@pytest.mark.parametrize("balance", [balance_by_time, balance_by_size])
def test_profiling_leaves_the_model_untouched(balance):
    model = _model()
    before = copy.deepcopy(model.state_dict())
    sizes = balance(2, model, torch.randn(16, 8), device="cpu")
    assert len(sizes) == 2 and sum(sizes) == 5
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm stats included
    assert all(p.grad is None for p in model.parameters())


def test_profiling_leaves_the_random_state_untouched():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    sample = torch.randn(4, 8)
    state = torch.get_rng_state()
    balance_by_time(2, model, sample, timeout=0.05, device="cpu")
    balance_by_size(2, model, sample, device="cpu")
    assert torch.equal(state, torch.get_rng_state())


def test_a_model_on_the_meta_device_is_profiled_layer_by_layer():
    from gpipe.models.gpt import GPTConfig, build_gpt

    layers = build_gpt(GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=16), device="meta")
    tokens = torch.randint(0, 256, (2, 16))
    times = layer_times(layers, tokens, timeout=0.1, device="cpu")
    assert len(times) == 6 and all(t > 0 for t in times)
    assert sum(balance_by_time(3, layers, tokens, timeout=0.1, device="cpu")) == 6
    assert all(p.is_meta for p in layers.parameters())  # the model itself stays unallocated


def test_layer_times_rejects_a_bad_timeout():
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got 0"):
        layer_times(_model(), torch.randn(4, 8), timeout=0)
