"""A parameter that layers of different stages share (a tied embedding and projection)."""

import torch

from gpipe import GPipe, launch
from gpipe.parallel.ties import find_ties, untie

from .. import distributed_cases as cases
from .. import two_per_rank_cases as two_per_rank
from ..small_models import tied, token_loss, tokens

EXACT = {"rtol": 1e-12, "atol": 1e-14}


def test_ties_are_found_across_stages_only():
    model = tied()
    assert find_ties(model, [4]) == []  # one stage: one object serves every layer
    (tie,) = find_ties(model, [1, 2, 1])
    assert tie.stages == (0, 2)
    assert tie.name(0) == "0.weight" and tie.name(2) == "3.weight"
    untie(model, [tie])
    assert model[3].weight is not model[0].weight
    assert torch.equal(model[3].weight, model[0].weight)


def test_gpipe_sums_a_tied_weight_over_its_copies():
    reference = tied()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    model = GPipe(tied(), [1, 2, 1], devices=["cpu"] * 3, chunks=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        ids, targets = tokens(7, seed=step)
        for o in (ref_opt, opt):
            o.zero_grad()
        token_loss(reference(ids), targets).backward()
        token_loss(model(ids), targets).backward()
        ref_grad = reference[0].weight.grad
        torch.testing.assert_close(model[0].weight.grad, ref_grad, **EXACT)
        torch.testing.assert_close(model[3].weight.grad, ref_grad, **EXACT)
        ref_opt.step()
        opt.step()
    assert model[0].weight is not model[3].weight
    assert torch.equal(model[0].weight, model[3].weight)
    torch.testing.assert_close(model[0].weight, reference[0].weight, **EXACT)


def test_a_tie_within_one_partition_stays_one_parameter():
    model = GPipe(tied(), [4], devices=["cpu"], chunks=2)
    assert model[0].weight is model[3].weight and model.ties == []


def test_pipeline_sums_a_tied_weight_across_processes():
    for schedule in ("gpipe", "1f1b"):
        results = launch(cases.tied_weights, 2, ([2, 2], schedule))
        assert results[0]["ties"] == [(0, 1)]


def test_pipeline_tie_over_three_stages_with_one_between():
    results = launch(cases.tied_weights, 3, ([1, 2, 1],))
    assert results[2]["ties"] == [(0, 2)]


def test_ties_over_different_ranks_share_one_group():
    """The last stage holds copies of two ties, the others one each: one group for every tie
    (a group per tie would be named differently on its members, and they would wait)."""
    results = launch(cases.two_ties, 3)
    assert results[0]["ties"] == [(0, 2), (1, 2)]


def test_two_stages_per_process_sum_a_tie_of_the_first_and_last_stage():
    """Interleaved and the other looped schedules, and the V schedules, where the first and
    the last stage share process 0, which sums the copies itself."""
    results = launch(two_per_rank.ties, 2)
    assert all(ties == [(0, 3)] for ties in results[0].values())
