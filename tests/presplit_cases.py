"""What each process runs for micro-batches the user splits (``step(microbatches=...)``), in
tests/engine/test_distributed_schedules.py: sequences of 7, 31, 12 and 64 tokens, each micro-batch
its own length and rows, through every schedule, against the whole model on the same ones."""

import torch
import torch.nn.functional as F
from torch import nn

from gpipe import Pipeline
from gpipe.schedules import SCHEDULES, traits

EXACT = {"rtol": 1e-12, "atol": 1e-14}
VOCAB, WIDTH = 23, 16
LENGTHS_ROWS = [(7, 2), (31, 1), (12, 3), (64, 1)]  # tokens and rows of each micro-batch


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def token_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Embedding(VOCAB, WIDTH), *(Block() for _ in range(6)), nn.Linear(WIDTH, VOCAB)]
    return nn.Sequential(*layers).double()


def summed(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), reduction="sum")


def token_mean(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())


def microbatches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(VOCAB, (rows, length), generator=generator),
            torch.randint(VOCAB, (rows, length), generator=generator),
        )
        for length, rows in LENGTHS_ROWS
    ]


def _check(pipe: Pipeline, reference: nn.Sequential, given: list, counts=None) -> None:
    """The pipeline's loss and gradients against the reference's, already computed."""
    loss = pipe.step(microbatches=given, counts=counts)
    total = sum(summed(reference(x), y) for x, y in given)
    if counts is not None:
        total = total / sum(y.numel() for _, y in given)
    total.backward()
    torch.testing.assert_close(loss, total.detach(), **EXACT)
    names = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, names[name].grad, **EXACT)
    torch.testing.assert_close(pipe.evaluate(microbatches=given, counts=counts), loss, **EXACT)


def equivalence(k: int) -> int:
    """Every schedule, checkpoint never and always, losses summed; and token means weighed by
    token counts (``counts``: each row's tokens) under one schedule."""
    given = microbatches()
    cases = 0
    for schedule in SCHEDULES:
        balance = [2] * 2 * k if traits(schedule).several_stages_per_rank else [8 // k] * k
        chunks = traits(schedule).fewest_microbatches(k)  # the steps give their own, 4
        for mode in ("never", "always"):
            pipe = Pipeline(
                token_model(),
                balance,
                chunks=chunks,
                checkpoint=mode,
                schedule=schedule,
                loss_fn=summed,
                loss_reduction="sum",
            )
            _check(pipe, token_model(), given)
            cases += 1
    pipe = Pipeline(token_model(), [8 // k] * k, schedule="1f1b", loss_fn=token_mean)
    counts = torch.tensor([float(length) for length, rows in LENGTHS_ROWS for _ in range(rows)])
    _check(pipe, token_model(), given, counts=counts)
    return cases + 1


def outputs_and_refusals(k: int) -> dict:
    """``return_outputs=True`` on micro-batches of 7, 31, 12 and 64 tokens, under 1F1B (the
    last stage on the last process) and V-Half (on the first): the list of each one's
    outputs, in order, equal to the whole model's, from ``step`` and ``evaluate``; and V-Min
    given fewer micro-batches than it runs, refused on every process in words that ask for
    micro-batches."""
    given = microbatches()
    reference = token_model()
    expected = [reference(x).detach() for x, _ in given]
    found: dict = {}
    for schedule, balance in (("1f1b", [8 // k] * k), ("v-half", [2] * 2 * k)):
        pipe = Pipeline(token_model(), balance, schedule=schedule, loss_fn=token_mean)
        for method in (pipe.step, pipe.evaluate):
            result = method(microbatches=given, return_outputs=True)
            if pipe.is_last:
                assert isinstance(result.outputs, list) and len(result.losses) == len(given)
                for out, ref in zip(result.outputs, expected, strict=True):
                    torch.testing.assert_close(out, ref, **EXACT)
            found[schedule, method.__name__] = pipe.is_last
    pipe = Pipeline(token_model(), [2] * 2 * k, chunks=2, schedule="v-min", loss_fn=token_mean)
    try:
        pipe.step(microbatches=given[:1])
    except Exception as exc:  # every rank refuses, before any waits on another
        found["refused"] = f"{type(exc).__name__}: {exc}"
    return found
