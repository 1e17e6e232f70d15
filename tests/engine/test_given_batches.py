"""``GPipe(...)(microbatches=[...])``: the user's own micro-batches, each of its own rows and
length, give the outputs and gradients of the un-pipelined model on the same micro-batches
(float64, every checkpoint mode), and bad ones are refused naming the micro-batch."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpipe import GPipe

from ..presplit_cases import microbatches, summed, token_model

EXACT = {"rtol": 1e-12, "atol": 1e-14}


def _pipe(model: nn.Sequential, checkpoint: str) -> GPipe:
    return GPipe(model, [3, 3, 2], devices=["cpu"] * 3, chunks=2, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_micro_batches_of_lengths_7_31_12_64_equal_the_model_on_the_same(checkpoint):
    given = microbatches()
    reference = token_model()
    pipe = _pipe(token_model(), checkpoint)
    outputs = pipe(microbatches=[x for x, _ in given])
    assert [o.shape for o in outputs] == [(x.shape[0], x.shape[1], 23) for x, _ in given]
    expected = [reference(x) for x, _ in given]
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, **EXACT)
    sum(summed(o, y) for o, (_, y) in zip(outputs, given, strict=True)).backward()
    sum(summed(o, y) for o, (_, y) in zip(expected, given, strict=True)).backward()
    for p, q in zip(pipe.parameters(), reference.parameters(), strict=True):  # layer order
        torch.testing.assert_close(p.grad, q.grad, **EXACT)


def _float_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4))).double()


def test_input_gradients_come_back_to_each_micro_batch_and_no_grad_runs_forward_only():
    model = _float_model()
    pipe = GPipe(copy.deepcopy(model), [2, 2], devices=["cpu"] * 2, chunks=4)
    shapes = [(2, 7, 4), (1, 31, 4), (3, 12, 4)]
    xs = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    refs = [x.detach().clone().requires_grad_() for x in xs]
    sum((o**2).sum() for o in pipe(microbatches=xs)).backward()
    sum((model(x) ** 2).sum() for x in refs).backward()
    for x, r in zip(xs, refs, strict=True):
        torch.testing.assert_close(x.grad, r.grad, **EXACT)
    with torch.no_grad():
        outputs = pipe(microbatches=[x.detach() for x in xs])
    for o, r in zip(outputs, refs, strict=True):
        torch.testing.assert_close(o, model(r).detach(), **EXACT)
        assert not o.requires_grad


def test_tuple_micro_batches_come_back_as_tuples():
    class Pair(nn.Module):
        def forward(self, pair):
            a, b = pair
            return a * 2, b + 1

    pipe = GPipe(nn.Sequential(Pair(), Pair()), [1, 1], devices=["cpu"] * 2)
    out = pipe(microbatches=[(torch.ones(2, 3), torch.ones(2)), (torch.ones(1, 5), torch.ones(1))])
    assert [tuple(t.shape for t in o) for o in out] == [((2, 3), (2,)), ((1, 5), (1,))]
    assert F.mse_loss(out[1][0], torch.full((1, 5), 4.0)) == 0


@pytest.mark.parametrize(
    ("microbatches", "message"),
    [
        ([], r"microbatches must be a non-empty list of micro-batches .* got \[\]"),
        ([torch.ones(2, 4), torch.ones(0, 4)], r"microbatches\[1\] has an empty batch"),
        (
            [torch.ones(2, 4), (torch.ones(2, 4), torch.ones(2))],
            r"microbatches\[1\] differs in structure from microbatches\[0\]: a tuple of 2 "
            r"tensors \(2-d float32, 1-d float32\), against a tensor \(2-d float32\)",
        ),
        (
            [torch.ones(2, 4), torch.ones(2, 4, dtype=torch.float64)],
            r"microbatches\[1\] differs in structure .* \(2-d float64\), against a tensor",
        ),
        ([torch.ones(2, 4), "x"], r"microbatches\[1\] must be a Tensor or a tuple of Tensors"),
    ],
)
def test_bad_micro_batches_are_refused_naming_the_one(microbatches, message):
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], devices=["cpu"] * 2)
    with pytest.raises((ValueError, TypeError), match=message):
        pipe(microbatches=microbatches)
    with pytest.raises(ValueError, match=r"give input or microbatches=\[...\], not both"):
        pipe(torch.ones(2, 4), microbatches=[torch.ones(2, 4)])
