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


def test_the_last_stage_keeps_only_each_micro_batchs_logprobs():
    kept = TokenLogprobs([torch.tensor([[1, 2]])])
    kept[0] = {"logits": torch.zeros(1, 2, 4)}
    torch.testing.assert_close(kept[0], torch.full((1, 2), -torch.log(torch.tensor(4.0))))
    assert logits_of((torch.ones(1), None)).shape == (1,)
    with pytest.raises(TypeError, match="the last stage's outputs hold no logits"):
        logits_of([1])


def test_forward_only_logprobs_through_two_processes_equal_the_models_own():
    results = run(logprobs_cases.agree, 2, threads=1)
    assert results == {0: 0, 1: 2}  # both schedules put the last stage on rank 1
