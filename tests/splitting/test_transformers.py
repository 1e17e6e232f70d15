"""Models we did not write: Hugging Face's GPT-2 and BERT, split and trained pipelined."""

import copy
import functools

import pytest
import torch

import gpipe
from gpipe.splitting import SplitModel

pytest.importorskip("transformers", reason="the test extra installs transformers")

from ..workers import run
from . import hf_cases as cases


def test_gpt2_split_and_trained_through_pipeline_equals_its_own_step():
    results = run(cases.gpt2, 2)
    assert results[0] == results[1] == 16


def test_llama_cut_by_its_plan_and_trained_through_pipeline_equals_its_own_step():
    results = run(cases.llama, 2)
    assert results[0] == results[1] == 8


def test_bert_split_and_trained_through_pipeline_equals_its_own_step():
    results = run(cases.bert, 2)
    assert results[0] == results[1] == 16


@functools.cache
def _gpt2_with_dropout_split() -> tuple[torch.nn.Module, SplitModel]:
    """The cases' GPT-2 with attention dropout 0.5, and a copy of it traced in training and
    split in two: one trace (seconds of CPU) for the test of its names, which dropout does
    not change, and the test of its dropout, which only sets the modes of both."""
    from transformers import GPT2LMHeadModel

    reference = cases.gpt2_model()
    reference.config.attn_pdrop = 0.5
    model = GPT2LMHeadModel(reference.config).double()
    model.load_state_dict(reference.state_dict())
    split = gpipe.split(copy.deepcopy(model), (), cases.text_batch(4, 8, seed=0), parts=2)
    return model, split


def test_gpt2_names_and_tied_head():
    model, split = _gpt2_with_dropout_split()
    # the head is the embedding: both stages hold it, under the embedding's name
    assert split.split_names("lm_head.weight") == [
        "0.transformer.wte.weight",
        "1.transformer.wte.weight",
    ]
    assert sorted(split.original_state_dict()) == sorted(model.state_dict())


def test_gpt2_on_meta_loaded_by_original_names():
    from transformers import GPT2LMHeadModel

    reference = cases.gpt2_model()
    with torch.device("meta"):
        model = GPT2LMHeadModel(reference.config).double()
    batch = cases.text_batch(4, 8, seed=0)
    split = gpipe.split(model, (), {k: v.to("meta") for k, v in batch.items()}, parts=2)
    split.to_empty(device="cpu")
    split.load_original_state_dict(reference.state_dict())
    got, want = split(batch), reference(**batch)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)


def test_a_model_that_keeps_a_cache_and_checkpoints_its_layers_is_traced_without_them():
    """GPT-2's config keeps a key/value cache by default, and the model then returns it beside
    its logits, an object torch.export refused; layers that checkpoint themselves with
    ``use_reentrant=True`` (as scripts for older transformers set) hid their places from the
    tracer, refused as cut points that "leave 1 stage(s) with nothing to compute". split
    traces the model as the pipeline trains it, cache and the layers' checkpointing off (it
    re-materializes stages itself), and leaves the model as it was."""
    from transformers import GPT2LMHeadModel

    reference = cases.gpt2_model()
    config = copy.deepcopy(reference.config)
    config.use_cache = True
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).double()
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5's name
    (enable or model.gradient_checkpointing_enable)({"use_reentrant": True})
    batch = cases.text_batch(4, 8, seed=0)
    split = gpipe.split(model, (), {k: v.to("meta") for k, v in batch.items()}, parts=2)
    assert model.config.use_cache is True
    assert all(block.gradient_checkpointing for block in model.transformer.h)
    split.to_empty(device="cpu")
    split.load_original_state_dict(reference.state_dict())
    torch.testing.assert_close(split(batch).logits, reference(**batch).logits, rtol=0, atol=0)


def test_gpt2s_attention_dropout_is_off_in_evaluation():
    """Traced in training, the attention's dropout is a rate in its graph, not a flag: in
    evaluation the split model runs it at 0, as GPT-2 does (its outputs varied from call to
    call)."""
    model, split = _gpt2_with_dropout_split()
    batch = cases.text_batch(4, 8, seed=0)
    split.eval()
    model.eval()
    with torch.no_grad():
        got = [split(batch).logits for _ in range(2)]
        want = model(**batch).logits
    torch.testing.assert_close(got[0], want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want, rtol=1e-12, atol=1e-12)
