"""Every schedule across real processes gives the loss and gradients of un-pipelined
training: K = 1..4, several micro-batch splits, all checkpoint modes."""

import pytest

from . import distributed_cases
from . import schedule_cases as cases
from .models import BALANCES, UNET_BALANCES, unet
from .workers import run


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("k", sorted(BALANCES))
def test_schedule_matches_unpipelined(schedule, k):
    results = run(cases.equivalence, k, (k, schedule), threads=1)
    assert all(n == 22 for n in results.values())


@pytest.mark.parametrize("k", sorted(BALANCES))
def test_interleaved_matches_unpipelined(k):
    results = run(cases.interleaved, k, (k,), threads=1)
    assert all(r["cases"] == 9 for r in results.values())
    assert [results[r]["stages"] for r in range(k)] == [[r, r + k] for r in range(k)]
    if k == 2:  # rank 0 holds layers 0-1 and 4-5 of the full Sequential, under their names
        assert results[0]["names"] == ["0.weight", "0.bias", "5.weight", "5.bias"]


@pytest.mark.parametrize("k", sorted(UNET_BALANCES))
def test_skips_across_stages_match_unpipelined_under_every_schedule(k):
    """Skips go straight from the stashing process to the popping one and back, under every
    schedule and checkpoint mode; every parameter of the model is compared on some rank."""
    results = run(cases.skips, k, (k,), threads=1)
    assert all(r["cases"] == 3 * 9 + 2 * 3 + 4 * 2 for r in results.values())
    compared = set().union(*(r["names"] for r in results.values()))
    assert compared == {name for name, _ in unet().named_parameters()}


@pytest.mark.parametrize("k", [2, 3])
def test_separate_envelopes_take_tensors_in_each_peers_send_order(k):
    """NCCL ignores tags: the CUDA path must receive tensors in the order each peer sent
    them, even where skips make that order differ from the order they are used."""
    results = run(cases.separate_envelopes, k, (k,), threads=1)
    assert all(n == 9 for n in results.values())


def test_layers_recomputed_selectively_under_every_schedule():
    results = run(distributed_cases.layer_checkpoint, 2, threads=1)
    assert results == {0: 8, 1: 8}
