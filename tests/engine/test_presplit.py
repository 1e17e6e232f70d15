"""Micro-batches the user splits: what ``step(microbatches=...)`` refuses, in one line each
naming the micro-batch (their exactness across processes: test_distributed_schedules)."""

import pytest
import torch

from gpipe.engine.presplit import given_microbatches, presplit


def _pair(rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(rows, length, dtype=torch.long), torch.zeros(rows, length, dtype=torch.long)


def test_micro_batches_of_their_own_lengths_and_rows_are_taken_in_order():
    given = presplit([_pair(2, 7), _pair(1, 31), _pair(3, 12)])
    assert given.sizes == [2, 1, 3] and given.rows == 6
    assert [x.shape[1] for x in given.inputs] == [7, 31, 12]
    assert presplit([(torch.ones(2, 3), None)]).targets is None


@pytest.mark.parametrize(
    ("microbatches", "message"),
    [
        ([], r"microbatches must be a non-empty list of \(inputs, targets\) pairs, got \[\]"),
        (torch.ones(2), "microbatches must be a non-empty list .* got Tensor"),
        ([_pair(2, 3), torch.ones(2)], r"microbatches\[1\] must be an \(inputs, targets\) pair"),
        ([_pair(2, 3), _pair(0, 3)], r"microbatches\[1\] inputs has an empty batch"),
        (
            [({"ids": torch.ones(2, 3)}, None), ({"tokens": torch.ones(2, 3)}, None)],
            r"microbatches\[1\] inputs changed structure .* leaf \['ids'\]: a tensor in "
            "micro-batch 0, absent now",
        ),
        ([_pair(2, 3), (torch.ones(2, 3), None)], r"microbatches\[1\] has no targets but"),
        ([(torch.ones(2, 3), torch.ones(3))], r"microbatches\[0\]: targets have 3 rows but"),
    ],
)
def test_bad_micro_batches_are_refused_naming_the_one(microbatches, message):
    with pytest.raises(ValueError, match=message):
        presplit(microbatches)


def test_inputs_and_micro_batches_together_are_refused():
    x, y = _pair(2, 3)
    with pytest.raises(ValueError, match="give inputs and targets, or microbatches="):
        given_microbatches(x, None, [(x, y)])
    assert given_microbatches(x, y, None) is None
