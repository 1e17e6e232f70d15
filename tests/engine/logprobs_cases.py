"""What each process runs for forward-only log-probabilities (``forward_logprobs``), in
tests/engine/test_logprobs.py: against the whole model's ``log_softmax(...).gather(...)`` in
float64, for the micro-batches of 7, 31, 12 and 64 tokens of presplit_cases and for a
mini-batch split into chunks, under a schedule of one stage per process and one of two."""

import torch

from gpipe import Pipeline
from gpipe.engine.forward_only import forward_logprobs

from ..presplit_cases import VOCAB, microbatches, token_model

EXACT = {"rtol": 1e-12, "atol": 1e-14}


def _expected(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        found = token_model()(x).log_softmax(-1).gather(-1, y.clamp(min=0).unsqueeze(-1))
    return torch.where(y == -100, 0.0, found.squeeze(-1))


def agree() -> int:
    """Every check on this rank; returns how many ran (the last stage's rank compares)."""
    given = microbatches()
    generator = torch.Generator().manual_seed(2)
    x = torch.randint(VOCAB, (5, 9), generator=generator)
    y = torch.randint(VOCAB, (5, 9), generator=generator)
    y[:, -1] = -100  # a document's end: no target
    checked = 0
    for schedule, balance in (("1f1b", [4, 4]), ("interleaved", [2, 2, 2, 2])):
        pipe = Pipeline(token_model(), balance, chunks=2, schedule=schedule, checkpoint="always")
        per_mb = forward_logprobs(pipe.runner, microbatches=given, training=pipe.training)
        whole = pipe.forward_only(x, y)
        assert not any(p.grad is not None for p in pipe.parameters())
        if not pipe.is_last:
            assert per_mb is None and whole is None
            continue
        assert [t.shape for t in per_mb] == [mx.shape for mx, _ in given]
        for got, (mx, my) in zip(per_mb, given, strict=True):
            torch.testing.assert_close(got, _expected(mx, my), **EXACT)
        torch.testing.assert_close(whole, _expected(x, y), **EXACT)
        assert whole.dtype == torch.float64 and (whole[:, -1] == 0).all()
        checked += 1
    return checked


def refusals() -> list[str]:
    """Targets the last stage refuses, then good ones: each refusal is a one-line ValueError
    on every rank, and the good call after it reads none of the refused call's messages (the
    last stage read them one call late, silently wrong). Returns this rank's messages."""
    pipe = Pipeline(token_model(), [4, 4], chunks=2, schedule="1f1b", timeout=30)
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(VOCAB, (4, 6), generator=generator)
    y = torch.randint(VOCAB, (4, 6), generator=generator)
    bad = [
        {"inputs": x, "targets": y[:, :5]},  # one token short
        {"inputs": x, "targets": y[:3]},  # a row short
        {"inputs": x, "targets": y + VOCAB},  # outside the vocabulary
        {"inputs": x, "targets": y.double()},  # not token ids
        {"microbatches": [(x[:2], y[:2]), (x[2:], y[2:, :5])]},
        {"microbatches": [(x[:2], {"y": y[:2]}), (x[2:], {"y": y[2:]})]},
    ]
    said = []
    for kwargs in bad:
        other = torch.randint(VOCAB, (4, 6), generator=generator)  # what a late read gets
        try:
            pipe.forward_only(**kwargs)
        except ValueError as exc:
            said.append(str(exc))
        else:
            said.append("no error")
        found = pipe.forward_only(other, y)
        if pipe.is_last:
            torch.testing.assert_close(found, _expected(other, y), **EXACT)
    return said
