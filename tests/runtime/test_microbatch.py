"""Micro-batches: even splits along dim 0, and joining them back."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gpipe.runtime.microbatch import check_batch, gather, scatter, split_sizes


def test_uneven_split_is_as_even_as_possible():
    assert split_sizes(10, 4) == [3, 3, 2, 2]


def test_fewer_rows_than_chunks_gives_fewer_microbatches():
    assert split_sizes(3, 8) == [1, 1, 1]


@given(st.integers(1, 500), st.integers(1, 64))
def test_split_sizes_partition_the_rows(rows, chunks):
    sizes = split_sizes(rows, chunks)
    assert sum(sizes) == rows
    assert len(sizes) == min(rows, chunks)
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@given(st.integers(1, 40), st.integers(1, 12))
def test_scatter_then_gather_is_the_identity(rows, chunks):
    x = torch.arange(rows * 3.0).reshape(rows, 3)
    mask = torch.arange(rows) % 2 == 0
    parts = scatter((x, mask), chunks)
    assert len(parts) == min(rows, chunks)
    joined = gather(parts)
    assert torch.equal(joined[0], x) and torch.equal(joined[1], mask)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ([1, 2], TypeError, r"input must be a Tensor or a tuple of Tensors, got list\[int, int\]"),
        ("x", TypeError, "got str"),
        ((), TypeError, "got tuple"),
        (torch.tensor(1.0), ValueError, "0-d tensor"),
        ((torch.zeros(2, 1), torch.zeros(3, 1)), ValueError, r"batch size.*\[2, 3\]"),
        (torch.zeros(0, 4), ValueError, "empty batch"),
    ],
)
def test_bad_batches_are_named(value, error, message):
    with pytest.raises(error, match=message):
        check_batch(value)
