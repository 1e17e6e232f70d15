"""``gpipe.training.hf.generation_cut``: a traced GPT-2 (as `gpipe train` cuts a Hugging Face
model that declares no pipeline plan) is cut again for generation where the run's places are
between decoder layers, and stays traced, refused in one line, where they are not."""

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


def test_a_run_cut_between_decoder_layers_is_cut_again_and_generates(gpt2):
    results = run(cases.cut, 2, (gpt2, ["transformer.h.1"]), threads=1)
    for found in results.values():
        assert found["new"] and found["stage"] == "PlanStage"
        assert [len(tokens) for tokens in found["generates"]] == [3, 3]
    assert results[0]["generates"] == results[1]["generates"]


def test_a_run_cut_inside_a_decoder_layer_stays_traced_and_refused(gpt2):
    results = run(cases.cut, 2, (gpt2, ["transformer.h.1.mlp"]), threads=1)
    for found in results.values():
        assert not found["new"] and found["stage"] == "SplitStage"
        assert "needs layers that keep a KV cache" in found["generates"]
