"""Hugging Face models (built from a config, random weights, nothing downloaded) split by
gpipe.split and trained through Pipeline: what each process of tests/splitting/test_transformers.py
runs. Each compares the pipelined step with the model's own forward and backward on the
whole batch, its own loss included (computed in float32 by the library, hence the
float32 tolerance)."""

import copy

import torch

import gpipe
from gpipe import Pipeline

from ..small_models import tiny_llama_config

CLOSE = {"rtol": 1e-5, "atol": 1e-7}
COMBINATIONS = [(s, m) for s in ("gpipe", "1f1b") for m in ("always", "never")]


def _own_loss(out):
    return out.loss


def gpt2_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4,
        n_embd=32,
        n_head=4,
        vocab_size=64,
        n_positions=32,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).double()


def bert_model():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        num_hidden_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config).double()


def llama_model(tie_word_embeddings: bool = True):
    """A Llama (tied embeddings unless told): cut by its own pipeline plan."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(
        max_position_embeddings=32,
        tie_word_embeddings=tie_word_embeddings,
        use_cache=False,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).double()


def text_batch(rows: int, length: int, seed: int, classes: int | None = None) -> dict:
    """Token ids with right padding that differs from row to row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    for r in range(rows):
        pad = (r * 3) % (length - 2)
        if pad:
            mask[r, -pad:] = 0
    if classes is None:
        labels = ids.masked_fill(mask == 0, -100)
    else:
        labels = torch.randint(0, classes, (rows,), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _check(pipe, split, reference, batch, counts) -> None:
    reference.zero_grad()
    want = reference(**batch).loss
    want.backward()
    pipe.zero_grad()
    got = pipe.step(batch, counts=counts)
    torch.testing.assert_close(got, want.detach().double(), **CLOSE)
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in pipe.named_parameters():
        want_grad = grads[split.original_name(name)]
        torch.testing.assert_close(p.grad, want_grad, **CLOSE)


def _train(build, example, batches, counts_of, combinations=COMBINATIONS) -> int:
    reference = build()
    cases = 0
    for how in ({"parts": 2}, {"at": [_cut_of(reference)]}):
        split = gpipe.split(copy.deepcopy(reference), (), example, **how)
        for schedule, mode in combinations:
            pipe = Pipeline(
                copy.deepcopy(split),
                chunks=3,
                schedule=schedule,
                checkpoint=mode,
                loss_fn=_own_loss,
            )
            for batch in batches:
                _check(pipe, split, reference, batch, counts_of(batch))
                cases += 1
    return cases


def _cut_of(model) -> str:
    if hasattr(model, "transformer"):
        return "transformer.h.1"
    return "model.layers.3" if hasattr(model, "model") else "bert.encoder.layer.2"


def gpt2() -> int:
    """GPT-2 with its tied embedding and head: loss averaged over the valid (shifted)
    tokens, so micro-batches weigh by their count of them."""
    batches = [text_batch(7, 10, seed=1), text_batch(5, 6, seed=2)]

    def counts(batch):
        return (batch["labels"][:, 1:] != -100).sum(1)

    return _train(gpt2_model, text_batch(4, 8, seed=0), batches, counts)


def llama() -> int:
    """Llama cut by its pipeline plan: each stage runs the model's own modules and code,
    the padding mask passed from stage to stage (the split machinery's schedules and modes
    are GPT-2's to cover: two of them here)."""
    batches = [text_batch(7, 10, seed=1), text_batch(5, 6, seed=2)]

    def counts(batch):
        return (batch["labels"][:, 1:] != -100).sum(1)

    combinations = [("gpipe", "always"), ("1f1b", "never")]
    return _train(llama_model, text_batch(4, 8, seed=0), batches, counts, combinations)


def bert() -> int:
    """A BERT-style encoder with a padding mask, classifying each row: a mean over rows."""
    batches = [text_batch(7, 10, seed=1, classes=3), text_batch(5, 6, seed=2, classes=3)]
    return _train(bert_model, text_batch(4, 8, seed=0, classes=3), batches, lambda batch: None)
