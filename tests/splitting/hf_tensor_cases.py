"""What each of 4 processes runs in tests/splitting/test_hf_tensor_plan.py: a Llama cut by its
pipeline plan, its stages split by its own tensor plan (T = 2 x K = 2), against one step of the
unsplit model in float64."""

import copy

import torch
from torch.distributed.tensor import DTensor
from torch.nn.functional import cross_entropy

import gpipe
from gpipe import Pipeline

from .hf_cases import llama_model

EXACT = {"rtol": 1e-10, "atol": 1e-12}
COMBINATIONS = [(s, m) for s in ("gpipe", "1f1b") for m in ("never", "always")]


def next_token_loss(out, ids: torch.Tensor) -> torch.Tensor:
    """In the model's dtype (the model's own loss, with labels, is float32)."""
    logits = out.logits if hasattr(out, "logits") else out
    return cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def exactness(tied: bool = False) -> dict:
    """Every combination's loss and gathered gradients against the unsplit model's; returns
    how many combinations were checked and which of this rank's parameters were split."""
    reference = llama_model(tie_word_embeddings=tied)
    ids = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    want = next_token_loss(reference(input_ids=ids), ids)
    want.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    split = gpipe.split(copy.deepcopy(reference), parts=2, plan="hf")
    cases, split_names = 0, []
    for schedule, mode in COMBINATIONS:
        pipe = Pipeline(
            copy.deepcopy(split),
            chunks=2,
            schedule=schedule,
            checkpoint=mode,
            tensor_parallel=2,
            loss_fn=next_token_loss,
        )
        got = pipe.step(ids, ids)
        if pipe.is_last:
            torch.testing.assert_close(got, want.detach(), **EXACT)
        split_names = []
        for name, p in pipe.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            original = split.original_name(name)
            torch.testing.assert_close(grad, grads[original], **EXACT, msg=original)
            if isinstance(p, DTensor):
                split_names.append(original)
        cases += 1
    return {"cases": cases, "split": split_names}


def families_exactness(kinds: list[str]) -> dict[str, list[str]]:
    """Each family of ``kinds`` cut by its pipeline plan and its stages split by its own
    tensor plan, one 1F1B step of its tiny model against the unsplit model's in float64;
    returns, per family, which of this rank's parameters are split."""
    from .hf_families import build

    found = {}
    for kind in kinds:
        torch.manual_seed(0)
        reference = build(kind)
        ids = torch.randint(3, reference.config.vocab_size, (4, 8), generator=torch.Generator())
        want = next_token_loss(reference(input_ids=ids), ids)
        want.backward()
        grads = {n: p.grad for n, p in reference.named_parameters()}
        split = gpipe.split(copy.deepcopy(reference), parts=2, plan="hf")
        pipe = Pipeline(
            split, chunks=2, schedule="1f1b", tensor_parallel=2, loss_fn=next_token_loss
        )
        got = pipe.step(ids, ids)
        if pipe.is_last:
            torch.testing.assert_close(got, want.detach(), **EXACT)
        found[kind] = []
        for name, p in pipe.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            original = split.original_name(name)
            torch.testing.assert_close(grad, grads[original], **EXACT, msg=f"{kind} {original}")
            if isinstance(p, DTensor):
                found[kind].append(original)
    return found
