"""Split models trained through Pipeline: what each process of
tests/splitting/test_split_pipeline.py runs. Every rank builds and splits the same model; each
keeps its own stage."""

import torch
from torch import nn

import gpipe
from gpipe import Pipeline

from .split_models import TinyLM, images, tiny_lm, tiny_resnet, token_batch

EXACT = {"rtol": 1e-12, "atol": 1e-14}


def _model_loss(out):
    return out["loss"]


def _valid(batch: dict) -> torch.Tensor:
    return (batch["labels"] != -100).sum(1)


def _compare(pipe: Pipeline, split, reference: nn.Module, batch: dict) -> None:
    reference.zero_grad()
    want = reference(**batch)["loss"]
    want.backward()
    pipe.zero_grad()
    loss = pipe.step(batch, counts=_valid(batch))
    torch.testing.assert_close(loss, want.detach(), **EXACT)
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[split.original_name(name)], **EXACT)


def lm(at: list[str] | None, schedule: str, mode: str) -> int:
    """The model's own loss (a mean over valid tokens) and every gradient, exact; shapes
    that change from step to step, uneven micro-batches, fewer rows than micro-batches."""
    reference = tiny_lm()
    if at is None:
        split = gpipe.split(tiny_lm(), (), token_batch(), parts=2)
    else:
        split = gpipe.split(tiny_lm(), (), token_batch(), at=at)
    pipe = Pipeline(split, chunks=3, schedule=schedule, checkpoint=mode, loss_fn=_model_loss)
    steps = 0
    for rows, length in [(7, 6), (5, 4), (2, 5)]:
        _compare(pipe, split, reference, token_batch(rows, length, seed=rows))
        steps += 1
    return steps


def meta_then_loaded() -> list[str]:
    """Built and split on the meta device; each rank allocates its own stage and loads it
    from the original model's state dict."""
    reference = tiny_lm()
    with torch.device("meta"):
        model = TinyLM().double()
    batch = token_batch()
    split = gpipe.split(model, (), {k: v.to("meta") for k, v in batch.items()}, at=["blocks.2"])
    pipe = Pipeline(split, chunks=3, loss_fn=_model_loss)
    loaded = split.load_original_state_dict(reference.state_dict(), module=pipe)
    assert loaded == list(pipe.stages), (loaded, pipe.stages)
    _compare(pipe, split, reference, batch)
    return sorted(split.original_state_dict(module=pipe))


def resnet() -> int:
    """A residual network cut inside its residual stages, three processes."""
    reference = tiny_resnet()
    split = gpipe.split(tiny_resnet(), (images()[0],), at=["layer1.1", "layer2.0"])
    loss_fn = nn.functional.cross_entropy
    pipe = Pipeline(split, chunks=4, checkpoint="always", loss_fn=loss_fn)
    for rows in (8, 5):
        x, y = images(rows, seed=rows)
        reference.zero_grad()
        want = loss_fn(reference(x), y)
        want.backward()
        pipe.zero_grad()
        torch.testing.assert_close(pipe.step(x, y), want.detach(), **EXACT)
        grads = {n: p.grad for n, p in reference.named_parameters()}
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[split.original_name(name)], **EXACT)
    return len(list(pipe.parameters()))
