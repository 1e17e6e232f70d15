"""Payloads that are not tensors: what each process of tests/comm/test_payload.py runs.

Layers take and return dicts, dataclasses and NamedTuples with plain leaves (ints, floats,
strings, None) beside the tensors; the pipelined step must equal the plain model's.
"""

import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from gpipe import Pipeline
from gpipe.runtime.microbatch import split_sizes

D = 5
SCHEDULES = [("gpipe", [2, 2]), ("1f1b", [2, 2]), ("zero-bubble", [2, 2])]
INTERLEAVED = ("interleaved", [1, 1, 1, 1])
SPLITS = [(8, 4), (7, 3), (3, 4)]  # even, uneven, fewer rows than chunks


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor
    mask: torch.Tensor
    steps: int
    tag: str


class Out(NamedTuple):
    y: torch.Tensor
    note: None
    scale: float


class Embed(nn.Module):
    """dict -> Hidden: keeps the mask (no gradient) and plain values alongside."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, batch: dict) -> Hidden:
        h = torch.tanh(self.linear(batch["x"])) * batch["scale"]
        return Hidden(h=h, mask=batch["mask"], steps=len(batch["tag"]), tag=batch["tag"])


class Mix(nn.Module):
    """Hidden -> Hidden, using every field."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, hidden: Hidden) -> Hidden:
        h = hidden.h
        for _ in range(hidden.steps):
            h = torch.tanh(self.linear(h)) * hidden.mask + h
        return Hidden(h=h, mask=hidden.mask, steps=hidden.steps, tag=hidden.tag + "!")


class Project(nn.Module):
    """Hidden -> Out, a NamedTuple with a None and a float."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, hidden: Hidden) -> Out:
        assert hidden.tag == "ab!", hidden.tag
        return Out(y=self.linear(hidden.h), note=None, scale=0.5)


class Head(nn.Module):
    """Out -> dict; with labels in the input it also computes the loss itself."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, 3)

    def forward(self, out: Out) -> dict:
        assert out.note is None
        return {"pred": self.linear(out.y) * out.scale, "rows": out.y.size(0)}


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Embed(), Mix(), Project(), Head()).double()


def inputs(rows: int, seed: int = 1) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, dtype=torch.float64, generator=g)
    mask = (torch.rand(rows, D, generator=g) > 0.3).double()
    y = torch.randn(rows, 3, dtype=torch.float64, generator=g)
    return {"x": x, "mask": mask, "scale": 2.0, "tag": "ab"}, y


def loss_fn(out: dict, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out["pred"], y)


EXACT = {"rtol": 1e-12, "atol": 1e-14}


def _check(pipe: Pipeline, rows: int) -> None:
    reference = model()
    batch, y = inputs(rows)
    out = reference(batch)
    ref_loss = loss_fn(out, y)
    ref_loss.backward()
    result = pipe.step(batch, y, return_outputs=True)
    torch.testing.assert_close(result.loss, ref_loss.detach(), **EXACT)
    grads = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, **EXACT)
    if pipe.is_last:
        torch.testing.assert_close(result.outputs["pred"], out["pred"].detach(), **EXACT)
        sizes = split_sizes(rows, pipe.chunks)  # a plain leaf: kept if equal, else listed
        assert result.outputs["rows"] == (sizes[0] if len(set(sizes)) == 1 else sizes)
    inferred = pipe(batch)
    if pipe.is_last:
        torch.testing.assert_close(inferred["pred"], out["pred"].detach(), **EXACT)


def every_schedule() -> int:
    """Each schedule and re-materialization mode, even and uneven micro-batches."""
    cases = 0
    for schedule, balance in [*SCHEDULES, INTERLEAVED]:
        for mode in ("never", "always", "except_last"):
            # interleaved needs a multiple of the ranks in micro-batches
            splits = [(8, 4), (7, 4), (2, 4)] if schedule == "interleaved" else SPLITS
            for rows, chunks in splits:
                pipe = Pipeline(
                    model(),
                    balance,
                    chunks=chunks,
                    checkpoint=mode,
                    schedule=schedule,
                    loss_fn=loss_fn,
                )
                _check(pipe, rows)
                cases += 1
    return cases


# -- a model that computes its own loss, averaged over valid tokens -------------------------

IGNORE = -100
VOCAB = 7


class TokenModel(nn.Module):
    """dict(ids, labels) -> dict(loss, logits): the mean over labels that are not IGNORE."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.out = nn.Linear(D, VOCAB)

    def forward(self, batch: dict) -> dict:
        logits = self.out(torch.tanh(self.embed(batch["ids"])))
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE
        )
        return {"loss": loss, "logits": logits}


def token_model() -> nn.Sequential:
    torch.manual_seed(0)
    body = TokenModel().double()
    return nn.Sequential(Passthrough(body.embed), Finish(body.out))


class Passthrough(nn.Module):
    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.embed = embed

    def forward(self, batch: dict) -> dict:
        return {"h": torch.tanh(self.embed(batch["ids"])), "labels": batch["labels"]}


class Finish(nn.Module):
    def __init__(self, out: nn.Linear):
        super().__init__()
        self.out = out

    def forward(self, batch: dict) -> dict:
        logits = self.out(batch["h"])
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE
        )
        return {"loss": loss, "logits": logits}


def token_batch(rows: int = 6, length: int = 5) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    labels = ids.roll(-1, 1)
    # padding differs from row to row: row r has r % length ignored positions at its end
    for r in range(rows):
        pad = r % length
        if pad:
            labels[r, -pad:] = IGNORE
    return {"ids": ids, "labels": labels}


def token_counts() -> dict:
    """Losses averaged over tokens: weighting by rows is off, by counts= exact."""
    batch = token_batch()
    reference = token_model()
    ref_loss = reference(batch)["loss"]
    ref_loss.backward()
    counts = (batch["labels"] != IGNORE).sum(1)
    found = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = Pipeline(
            token_model(), [1, 1], chunks=3, schedule=schedule, loss_fn=lambda out: out["loss"]
        )
        loss = pipe.step(batch, counts=counts)
        torch.testing.assert_close(loss, ref_loss.detach(), **EXACT)
        grads = dict(reference.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, **EXACT)
        torch.testing.assert_close(pipe.evaluate(batch, counts=counts), ref_loss.detach())
        by_rows = Pipeline(
            token_model(), [1, 1], chunks=3, schedule=schedule, loss_fn=lambda out: out["loss"]
        )
        found[schedule] = abs(float(by_rows.step(batch)) - float(ref_loss))
    return found


# -- structure that changes within a step ---------------------------------------------------


class Fickle(nn.Module):
    """Returns an extra key when its micro-batch has an odd number of rows."""

    def forward(self, x: torch.Tensor) -> dict:
        out = {"h": x * 2}
        if x.size(0) % 2:
            out["odd"] = x
        return out


class Take(nn.Module):
    def forward(self, batch: dict) -> torch.Tensor:
        return batch["h"]


def changing_structure() -> str:
    pipe = Pipeline(
        nn.Sequential(Fickle(), Take()),
        [1, 1],
        chunks=2,
        loss_fn=torch.nn.functional.mse_loss,
        timeout=10,
    )
    x = torch.randn(5, 2, requires_grad=True)
    try:
        pipe.step(x, torch.zeros(5, 2))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
