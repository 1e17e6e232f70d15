"""A Hugging Face Llama split by its own tensor plan (``base_model_tp_plan`` and its head's)
inside the stages of its pipeline plan: the loss and every gradient of the unsplit model."""

import pytest

pytest.importorskip("transformers", reason="the test extra installs transformers")

from ..workers import run
from . import hf_tensor_cases as cases


def _split_names(results: dict) -> tuple[list[str], list[str]]:
    """Which parameters each stage's tensor ranks hold split (alike on both ranks)."""
    first, last = results[0]["split"], results[2]["split"]
    assert results[1]["split"] == first and results[3]["split"] == last
    assert all(r["cases"] == len(cases.COMBINATIONS) for r in results.values())
    return first, last


def test_llama_at_t2_k2_equals_the_unsplit_model_in_float64():
    """gpipe and 1f1b, checkpoint never and always: loss and every gathered gradient within
    rtol 1e-10; the attention and MLP maps of each stage's layers, and the head, are split."""
    first, last = _split_names(run(cases.exactness, 4, (False,), threads=1))
    assert "model.layers.0.self_attn.k_proj.weight" in first
    assert "model.embed_tokens.weight" not in first  # the config's plan does not name it
    assert "model.layers.3.mlp.down_proj.weight" in last and "lm_head.weight" in last
    assert len(first) == len(last) - 1 == 2 * 7


def test_a_head_tied_to_the_embedding_stays_whole_and_exact():
    """The tied head's weight is the embedding's, which the plan leaves whole: so is the head."""
    first, last = _split_names(run(cases.exactness, 4, (True,), threads=1))
    assert "lm_head.weight" not in last
    assert len(first) == len(last) == 2 * 7
