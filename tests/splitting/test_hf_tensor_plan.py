"""A Hugging Face Llama split by its own tensor plan (``base_model_tp_plan`` and its head's)
inside the stages of its pipeline plan: the loss and every gradient of the unsplit model."""

import re

import pytest
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel

from gpipe import Pipeline
from gpipe.splitting.hf_tensor_plan import held_plan

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


def _llama_stages(**overrides):
    import gpipe

    from .hf_cases import llama_model

    model = llama_model(tie_word_embeddings=False)
    for key, value in overrides.items():
        setattr(model.config, key, value)
    return gpipe.split(model, parts=2, plan="hf")


def test_the_other_styles_of_transformers_plans_split_exactly():
    """Qwen3's per-head norms (``replicated_with_grad_allreduce``: whole, their gradients summed
    over the tensor ranks), Phi3's fused maps split by columns and gathered, then split by rows
    again after them (``rowwise_split_input``) and GPT-NeoX's embedding split by vocabulary
    (``embedding_rowwise``): the loss and every gathered gradient equal the unsplit model's
    in float64."""
    kinds = ["qwen3", "phi3", "gpt_neox"]
    results = run(cases.families_exactness, 4, (kinds,), threads=1)
    first, last = results[0], results[2]
    assert "model.layers.0.self_attn.q_norm.weight" not in first["qwen3"]
    assert "model.layers.0.self_attn.q_proj.weight" in first["qwen3"]
    assert "model.layers.3.self_attn.o_proj.weight" in last["phi3"]
    assert "model.layers.3.self_attn.qkv_proj.weight" in last["phi3"]
    assert "gpt_neox.embed_in.weight" in first["gpt_neox"]


def test_stacked_experts_split_over_the_tensor_ranks_exactly():
    """Mixtures of experts whose experts are stacked tensors (``moe_tp_experts`` with its
    ``packed_colwise`` gate-and-up map and ``rowwise`` down map): each rank holds its slice
    of every expert, and the loss and every gathered gradient equal the unsplit model's in
    float64. (Mixtral's router returns its weights in float32, whose sums over the ranks
    round otherwise: within 1e-7, checked by hand.)"""
    kinds = ["qwen3_moe", "flex_olmo"]  # by hand also Qwen2-MoE, Laguna and Mellum
    results = run(cases.families_exactness, 4, (kinds,), threads=1)
    for kind in kinds:
        for rank, layer in ((0, 0), (2, 3)):
            for name in ("gate_up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{name}" in results[rank][kind], kind


def test_each_stage_declares_the_plan_of_the_modules_it_holds():
    first, last = _llama_stages()
    q, down = "model.layers.*.self_attn.q_proj", "model.layers.*.mlp.down_proj"
    assert first.tp_plan[q] == "colwise" and first.tp_plan[down] == "rowwise"
    assert "lm_head" not in first.tp_plan  # the last stage holds the head
    head = last.tp_plan["lm_head"]
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)


@pytest.mark.parametrize(
    ("size", "refusal"),
    [
        (3, "tensor_parallel=3 does not divide the 4 heads of 0.model.layers.0.self_attn.q_proj"),
        # 4 query heads but 2 key/value heads
        (4, "tensor_parallel=4 does not divide the 2 heads of 0.model.layers.0.self_attn.k_proj"),
    ],
)
def test_a_size_that_splits_a_head_is_refused_in_one_line(size, refusal):
    with pytest.raises(ValueError, match=re.escape(refusal)) as caught:
        Pipeline(_llama_stages(), tensor_parallel=size)
    assert "\n" not in str(caught.value)


def test_a_style_without_translation_is_refused_only_when_asked_for():
    plan = {"layers.*.mlp.gate_proj": "packed_colwise"}
    first, _ = _llama_stages(base_model_tp_plan=plan)  # cut as before
    refusal = (
        "LlamaForCausalLM's tensor plan splits 'model.layers.*.mlp.gate_proj' as "
        "'packed_colwise', which gpipe does not translate (it takes ['colwise', "
    )
    with pytest.raises(ValueError, match=re.escape(refusal)) as caught:
        _ = first.tp_plan
    assert "\n" not in str(caught.value)


def test_a_pattern_that_also_matches_a_stand_in_becomes_the_modules_held():
    names = ["m.layers.0", "m.layers.0.fc", "m.layers.1", "m.norm"]
    plan = {"m.layers.*": "sequence", "m.layers.*.fc": "colwise", "m.norm": "sequence"}
    held = held_plan(plan, names, elsewhere={"m.layers.1", "m.norm"})
    assert held == {"m.layers.0": "sequence", "m.layers.*.fc": "colwise"}
