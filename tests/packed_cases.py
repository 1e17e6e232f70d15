"""What each process runs for packed sequences through a split Hugging Face Llama, in
tests/data/test_packed_split.py: documents packed several to a row by ``gpipe.data.pack``, their
``position_ids`` restarting per document, train exactly like the same documents each alone.

Transformers builds the document mask from ``position_ids`` that restart (its
``find_packed_sequence_indices``) when no ``attention_mask`` is given; under ``torch.export``
it always builds it, so the traced graph keeps documents apart for every micro-batch. The
mask and the rotary tables are made on the first stage, from ``position_ids``, and reach the
later stages in the payload or as skips; ``position_ids`` themselves go no further."""

import copy

import torch
import torch.nn.functional as F

import gpipe
from gpipe import Pipeline
from gpipe.data import counts_of, pack

from .small_models import tiny_llama_config

EXACT = {"rtol": 1e-12, "atol": 1e-13}
SCHEDULES = ("gpipe", "1f1b", "zero-bubble")  # those of one stage per process
LENGTHS = (5, 9, 3, 11, 6, 4, 8)  # packed into rows of 16: rows of one, two and three documents
VOCAB = 64


def llama(attention: str = "sdpa"):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(
        vocab_size=VOCAB,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation=attention,
    )
    return LlamaForCausalLM(config).double()


def documents() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in LENGTHS]


def model_inputs(inputs: dict) -> dict:
    """What the split model takes of a packed micro-batch: the model reads no ``cu_seqlens``."""
    return {"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"]}


def summed(out, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), reduction="sum")


def token_mean(out, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def unpacked(model, docs: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """The documents each alone through the unsplit model, their losses summed; gradients
    accumulate in ``model``."""
    model.zero_grad()
    total = sum(
        F.cross_entropy(model(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum")
        for d in docs
    )
    loss = total / scale
    loss.backward()
    return loss.detach()


def block_causal(inputs: dict) -> torch.Tensor:
    """The (rows, 1, T, T) mask of who may attend to whom: earlier tokens of the same
    document, as ``cu_seqlens`` bounds them."""
    rows, width = inputs["input_ids"].shape
    segment = torch.zeros(rows * width, dtype=torch.long)
    segment[inputs["cu_seqlens"][1:-1].long()] = 1
    segment = segment.cumsum(0).view(rows, width)
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return (same & causal)[:, None]


def _where_metadata_goes(split, microbatch: dict) -> None:
    """``position_ids`` are the first stage's input and no later stage's; what the first
    stage sends on is the document mask it built from them, block-diagonal and causal."""
    first, *later = [stage.plan for stage in split.stages()]
    assert first.inputs == ("input_ids", "position_ids"), first.inputs
    for plan in later:
        assert not plan.inputs and "position_ids" not in plan.receives, plan
    sent = split.stages()[0](model_inputs(microbatch))
    masks = [v for v in sent if isinstance(v, torch.Tensor) and v.dtype == torch.bool]
    assert len(masks) == 1, [getattr(v, "shape", v) for v in sent]
    document = block_causal(microbatch)
    keep = (microbatch["input_ids"] != 0)[:, None, :, None]  # real tokens (ids 1..63) ask
    assert torch.equal(masks[0] & keep, document & keep)
    assert not any(
        isinstance(v, torch.Tensor) and v.dtype == torch.long and v.dim() == 2 for v in sent
    ), "position_ids were sent on"


def _check(pipe: Pipeline, split, reference, want: torch.Tensor, microbatches, counts=None):
    """The pipeline's loss and gradients against ``want`` and the reference's gradients."""
    pipe.zero_grad()
    loss = pipe.step(microbatches=microbatches, counts=counts)
    torch.testing.assert_close(loss, want, **EXACT)
    grads = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[split.original_name(name)].grad, **EXACT)


def _packed_whole(reference, microbatches) -> torch.Tensor:
    """The packed micro-batches through the unsplit model (which finds the documents in the
    ``position_ids`` too), losses summed; gradients accumulate in ``reference``."""
    reference.zero_grad()
    loss = sum(summed(reference(**x), y) for x, y in microbatches)
    loss.backward()
    return loss.detach()


def equivalence() -> int:
    """SDPA attention: every schedule of one stage per process, checkpoint never and always,
    losses summed, and a mean per token weighed by ``counts_of`` under 1F1B, against the
    documents each alone. Eager attention takes its softmax in float32, over rows as long
    as the micro-batch's, so packed and alone round differently there (4e-10 of the loss):
    under GPipe it is exact against the unsplit model on the same packed micro-batches, and
    within float32's rounding of the documents alone."""
    docs = documents()
    packed = pack(docs, max_tokens=16, chunks=2)
    microbatches = [(model_inputs(x), y) for x, y in packed]
    example = model_inputs(packed[0][0])
    reference = llama("sdpa")
    # traced here (what each stage sends is the tracer's choice, checked below); the eager
    # model further down is cut by its own pipeline plan, the position_ids passed along
    split = gpipe.split(copy.deepcopy(reference), (), example, parts=2, plan=None)
    _where_metadata_goes(split, packed[0][0])
    cases = 0
    for schedule in SCHEDULES:
        for mode in ("never", "always"):
            pipe = Pipeline(
                copy.deepcopy(split),
                schedule=schedule,
                checkpoint=mode,
                loss_fn=summed,
                loss_reduction="sum",
            )
            _check(pipe, split, reference, unpacked(reference, docs), microbatches)
            cases += 1
    counts = counts_of(packed)
    pipe = Pipeline(copy.deepcopy(split), schedule="1f1b", loss_fn=token_mean)
    want = unpacked(reference, docs, float(counts.sum()))
    _check(pipe, split, reference, want, microbatches, counts=counts)

    eager = llama("eager")
    split = gpipe.split(copy.deepcopy(eager), (), example, parts=2)
    pipe = Pipeline(split, schedule="gpipe", loss_fn=summed, loss_reduction="sum")
    alone = unpacked(eager, docs)
    _check(pipe, split, eager, _packed_whole(eager, microbatches), microbatches)
    torch.testing.assert_close(alone, _packed_whole(eager, microbatches), rtol=1e-8, atol=0)
    return cases + 2


def gpt_equivalence() -> int:
    """The built-in GPT on packed rows in two stages (embedding and a block, a block and the
    head), documents passed between them as an int32 per token beside the hidden states:
    the loss and every gradient of the same documents each alone, under GPipe and 1F1B,
    re-materialized or not."""
    from gpipe.models.gpt import GPTConfig, build_gpt

    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=VOCAB)
    reference = build_gpt(config).double()
    docs = documents()
    microbatches = [(model_inputs(x), y) for x, y in pack(docs, max_tokens=16, chunks=2)]
    reference.zero_grad()
    alone = sum(F.cross_entropy(reference(d[None])[0, :-1], d[1:], reduction="sum") for d in docs)
    alone.backward()
    grads = dict(reference.named_parameters())
    cases = 0
    for schedule in ("gpipe", "1f1b"):
        for mode in ("never", "always"):
            pipe = Pipeline(
                copy.deepcopy(reference),
                [2, 2],
                schedule=schedule,
                checkpoint=mode,
                loss_fn=lambda out, y: F.cross_entropy(
                    out.flatten(0, 1), y.flatten(), reduction="sum"
                ),
                loss_reduction="sum",
            )
            pipe.zero_grad()
            torch.testing.assert_close(
                pipe.step(microbatches=microbatches), alone.detach(), **EXACT
            )
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(p.grad, grads[name].grad, **EXACT)
            cases += 1
    return cases
