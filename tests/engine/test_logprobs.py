"""Forward-only log-probabilities: ``token_logprobs`` is ``log_softmax(...).gather(...)``
with ignored targets at 0, and ``forward_logprobs`` through two processes equals the whole
model's, for micro-batches of their own lengths and for a mini-batch split into chunks."""

import pytest
import torch

from gpipe.engine.logprobs import TokenLogprobs, logits_of, token_logprobs

from ..workers import run
from . import logprobs_cases


def test_token_logprobs_are_the_log_softmax_at_each_target_and_0_where_ignored():
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    targets = torch.tensor([[1, 4, -100], [0, -100, 2]])
    found = token_logprobs(logits, targets)
    assert found.dtype == torch.float64 and found[0, 2] == 0 and found[1, 1] == 0
    assert found[1, 2] == logits[1, 2].log_softmax(-1)[2]
    assert token_logprobs(logits.half(), targets).dtype == torch.float32
    with pytest.raises(ValueError, match=r"logits of shape \(2, 3, 5\) do not fit targets"):
        token_logprobs(logits, targets[:, :2])
    with pytest.raises(ValueError, match="targets must be token ids .* got torch.float64"):
        token_logprobs(logits, targets.double())  # not truncated to ids


def test_the_last_stage_keeps_only_each_micro_batchs_logprobs():
    kept = TokenLogprobs([torch.tensor([[1, 2]])])
    kept[0] = {"logits": torch.zeros(1, 2, 4)}
    torch.testing.assert_close(kept[0], torch.full((1, 2), -torch.log(torch.tensor(4.0))))
    assert logits_of((torch.ones(1), None)).shape == (1,)
    with pytest.raises(TypeError, match="the last stage's outputs hold no logits"):
        logits_of([1])


def test_the_last_stage_keeps_the_first_refusal_and_takes_every_later_micro_batch():
    kept = TokenLogprobs([torch.tensor([[1, 9]]), torch.tensor([[1]])], names=["a", "b"])
    kept[0] = torch.zeros(1, 2, 4)
    kept[1] = torch.zeros(1, 2, 4)  # one token short, but the first refusal stays
    assert kept.refused == (
        "a: token id 9 is outside the vocabulary of 4 logits (and is not ignore_index=-100)"
    )
    assert kept[0].numel() == 0 and kept[1].numel() == 0


def test_forward_only_logprobs_through_two_processes_equal_the_models_own():
    results = run(logprobs_cases.agree, 2, threads=1)
    assert results == {0: 0, 1: 2}  # both schedules put the last stage on rank 1


def test_refused_targets_are_an_error_on_every_rank_and_leave_nothing_behind():
    """Bad targets raised on the last stage alone, mid-forward: the first rank returned
    None, and every later call on the last stage read the refused call's activations."""
    results = run(logprobs_cases.refusals, 2, threads=1)
    last = [
        "targets (micro-batch 0): logits of shape (2, 6, 23) do not fit targets of shape (2, 5)",
        "targets have 3 rows but inputs have 4",
        "targets (micro-batch 0): token id ",  # is outside the vocabulary of 23 logits
        "targets (micro-batch 0): targets must be token ids (an integer tensor)",
        "microbatches[1] targets: logits of shape (2, 6, 23) do not fit targets of shape (2, 5)",
        "microbatches[0] targets must be a tensor of token ids, got dict",
    ]
    for got, want in zip(results[1], last, strict=True):
        assert got.startswith(want) and "\n" not in got, got
    for got, want in zip(results[0], last, strict=True):  # the first rank's, of the same
        assert want in got and "\n" not in got, got
