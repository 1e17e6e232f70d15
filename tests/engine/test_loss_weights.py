"""Each micro-batch's loss weight: its share of the rows, or of the counts the user gives,
one per row or one per token."""

import pytest
import torch

from gpipe.engine.loss_weights import loss_weights


def _weights(sizes, counts=None):
    return loss_weights(
        sizes, "mean", rows_all=sum(sizes), counts=counts, replicas=None, stage=0, device="cpu"
    )


def test_counts_per_token_weigh_as_their_rows_sums():
    targets = torch.tensor([[1, 2, -100], [3, -100, -100], [4, 5, 6], [7, 8, 9]])
    per_token = targets != -100
    assert _weights([1, 3], per_token) == _weights([1, 3], per_token.sum(dim=1))
    assert _weights([1, 3], per_token) == pytest.approx([2 / 9, 7 / 9])
    assert _weights([1, 3]) == [0.25, 0.75]


def test_counts_of_another_shape_are_refused_naming_both_kinds():
    with pytest.raises(ValueError, match=r"one count per row of the mini-batch \(4\), or one "):
        _weights([2, 2], torch.ones(3, 5))


@pytest.mark.parametrize(
    ("counts", "words"),
    [
        ([[1.0, 1.0], [1.0], [1.0, 1.0, 1.0], [1.0]], "counts must be one tensor, one count per"),
        (torch.tensor([1.0, -2.0, 1.0, 1.0]), "must not be negative, got -2 for row 1"),
        (
            torch.ones(4, 5).index_put_((torch.tensor(1), torch.tensor(2)), torch.tensor(-1.0)),
            "must not be negative, got -1 for row 1, token 2",
        ),
    ],
)
def test_bad_counts_are_refused_naming_where(counts, words):
    with pytest.raises(ValueError, match=words):
        _weights([2, 2], counts)
