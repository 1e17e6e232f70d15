"""``gpipe.training.hf.generation_cut``: a traced GPT-2 (as `gpipe train` cuts a Hugging Face
model that declares no pipeline plan) is cut again for generation where the run's places are
between decoder layers, and refused in one line, on every rank alike, where they are not or
where the two cuts compute otherwise."""

import pytest

from ..workers import run
from . import generation_cut_cases as cases

transformers = pytest.importorskip("transformers", reason="the test extra installs it")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    config.save_pretrained(folder)
    return str(folder / "config.json")


@pytest.fixture(scope="module")
def nanochat(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("nanochat")
    config = transformers.NanoChatConfig(
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=32,
        vocab_size=64,
        max_position_embeddings=16,
    )
    config.save_pretrained(folder)
    return str(folder / "config.json")


def test_a_run_cut_between_decoder_layers_is_cut_again_and_generates(gpt2):
    results = run(cases.cut, 2, (gpt2, ["transformer.h.1"]), threads=1)
    for found in results.values():
        assert found["stage"] == "PlanStage"
        assert [len(tokens) for tokens in found["generates"]] == [3, 3]
    assert results[0]["generates"] == results[1]["generates"]


def test_a_run_cut_inside_a_decoder_layer_is_refused_in_one_line(gpt2):
    results = run(cases.cut, 2, (gpt2, ["transformer.h.1.mlp"]), threads=1)
    assert results[0] == results[1]
    refused = results[0]["refused"]
    assert len(refused.splitlines()) == 1
    assert refused.startswith(
        "generate() needs stages that keep a KV cache, and the run traced its Hugging Face "
        "model (traced stages keep none); it cannot be cut again by its modules' layout: "
    )
    assert "['transformer.h.1.mlp'] are not decoder layers a stage can begin at" in refused


def test_a_layout_whose_stages_compute_otherwise_is_refused_in_one_line(nanochat):
    """NanoChat's final norm holds no weights, and the stages of the layout read from its
    modules compute otherwise than the model (``gpipe.split`` refuses them where the weights
    are real): on meta nothing shows it, and the probe's logits through the two cuts differ."""
    results = run(cases.cut, 2, (nanochat, ["model.layers.1"]), threads=1)
    assert results[0] == results[1]
    assert results[0]["refused"].endswith(
        "layout: the stages of that layout do not compute what the traced stages do"
    )
