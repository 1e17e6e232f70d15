"""Token-balanced packing (``gpipe.data.pack``): every document once, in order, within its
row's limit and marked by its boundaries; balanced micro-batches never less even than
first-fit's; one clear error for each bad input."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpipe.data
from gpipe.data.packing import IGNORE_INDEX, _first_fit_rows, counts_of, pack, plan, spread

# long-tailed lengths: most short, a few up to max_tokens
_LENGTH = st.one_of(st.integers(1, 32), st.integers(1, 32), st.integers(1, 32), st.integers(1, 128))


def _documents(microbatch: tuple[dict, torch.Tensor]) -> list[list[int]]:
    """The documents of one micro-batch, read back off its ``cu_seqlens``, each checked to
    count its positions from 0 (padding, token 0, which no test document holds, left out)."""
    inputs, _ = microbatch
    ids, positions = inputs["input_ids"].flatten(), inputs["position_ids"].flatten()
    bounds = inputs["cu_seqlens"].tolist()
    docs = []
    for start, end in itertools.pairwise(bounds):
        if int(ids[start]) != 0:
            assert positions[start:end].tolist() == list(range(end - start))
            docs.append(ids[start:end].tolist())
    return docs


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(_LENGTH, min_size=4, max_size=60),
    chunks=st.integers(1, 4),
    balanced=st.booleans(),
)
def test_every_document_appears_once_in_order_within_rows_of_max_tokens(lengths, chunks, balanced):
    max_tokens = 128
    start = iter(range(10**6))
    sequences = [[next(start) + 1 for _ in range(n)] for n in lengths]  # every token unique
    # first-fit's own row count says whether an unbalanced pack must refuse: nothing public
    # gives it without packing
    if not balanced and len(_first_fit_rows(lengths, max_tokens)) < chunks:
        return  # too few rows to cut into chunks runs: refused, as another test shows
    packed = pack(sequences, max_tokens, chunks, balanced=balanced)
    assert len(packed) == chunks
    found = sorted(doc for mb in packed for doc in _documents(mb))
    assert found == sorted(sequences)
    for inputs, targets in packed:
        assert inputs["input_ids"].shape[1] <= max_tokens
        # a target is the next token of the same document, or ignored
        for r in range(targets.shape[0]):
            for t in range(targets.shape[1]):
                y = int(targets[r, t])
                if y != IGNORE_INDEX:
                    assert y == int(inputs["input_ids"][r, t + 1])
                    assert int(inputs["position_ids"][r, t + 1]) != 0


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(_LENGTH, min_size=16, max_size=120), chunks=st.integers(2, 8))
def test_balanced_micro_batches_are_never_less_even_than_first_fit(lengths, chunks):
    balanced = plan(lengths, 128, chunks)
    if len(_first_fit_rows(lengths, 128)) >= chunks:  # first-fit's rows, as above
        assert spread(balanced, lengths) <= spread(
            plan(lengths, 128, chunks, balanced=False), lengths
        )
    assert all(sum(lengths[i] for i in row) <= 128 for mb in balanced for row in mb)


def test_on_a_long_tail_balanced_packing_evens_what_first_fit_leaves_uneven():
    generator = torch.Generator().manual_seed(0)
    short = torch.randint(8, 128, (180,), generator=generator)
    long = torch.randint(256, 1025, (20,), generator=generator)
    lengths = torch.cat([short, long])[torch.randperm(200, generator=generator)].tolist()
    even = spread(plan(lengths, 1024, 8), lengths)
    uneven = spread(plan(lengths, 1024, 8, balanced=False), lengths)
    assert even <= 0.01 * sum(lengths) / 8 < uneven


def test_documents_are_marked_so_no_token_predicts_across_them():
    ((inputs, targets),) = pack([[1, 2, 3], [4, 5]], 8, 1)
    assert inputs["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert inputs["cu_seqlens"].tolist() == [0, 3, 5] and inputs["max_seqlen"] == 3
    assert targets.tolist() == [[2, 3, IGNORE_INDEX, 5, IGNORE_INDEX]]
    assert counts_of([(inputs, targets)]).tolist() == [3.0]
    assert gpipe.data.pack is pack


def test_padding_is_a_segment_of_its_own_and_is_never_a_target():
    ((inputs, targets),) = pack([[1, 2, 3, 4], [5, 6]], 4, 1)
    assert inputs["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    assert inputs["cu_seqlens"].tolist() == [0, 4, 6, 8]
    assert targets[1].tolist() == [6, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]


@pytest.mark.parametrize(
    ("sequences", "max_tokens", "chunks", "message"),
    [
        ([[1, 2, 3]], 2, 1, r"sequences\[0\] has 3 tokens, more than max_tokens=2"),
        ([], 4, 1, "pack needs at least one sequence, got none"),
        ([[1]], 4, 0, "chunks must be a positive integer, got 0"),
        ([[1], []], 4, 1, r"sequences\[1\] is empty"),
        ([[1], [2]], 4, 3, "2 sequences cannot fill chunks=3 micro-batches"),
        ([torch.ones(2, 2)], 4, 1, r"sequences\[0\] must be 1-D token ids, got shape \(2, 2\)"),
        ([[1]], 0, 1, "max_tokens must be a positive integer, got 0"),
    ],
)
def test_bad_input_is_refused_with_one_clear_error(sequences, max_tokens, chunks, message):
    with pytest.raises(ValueError, match=message):
        pack(sequences, max_tokens, chunks)
