"""Hugging Face models cut by their own pipeline plan (``gpipe.split(plan="hf")``): each
stage keeps the model's real modules and runs its own code, and the stages together compute
what the unsplit model does (float64: the loss and every gradient)."""

import copy
import os

import pytest
import torch

import gpipe
from gpipe.splitting import PlanError, PlanStage
from gpipe.splitting.hf_layout import check_read_plan

pytest.importorskip("transformers", reason="the test extra installs transformers")

from . import hf_families as families

# Families the suite checks on every run: dense and mixture-of-experts, tied and untied
# heads, sliding windows, the plans that name dropouts or other module names. The whole
# sweep, every family the installed transformers declares a plan for, runs with
# GPIPE_EVERY_PLAN_FAMILY=1 (and python -m tests.splitting.hf_families prints the table
# docs/split.md keeps).
EVERY = os.environ.get("GPIPE_EVERY_PLAN_FAMILY") == "1"
CHECKED = (
    families.families()
    if EVERY
    else [
        "llama",
        "qwen2",
        "qwen3",
        "phi3",
        "mistral",
        "gemma2",
        "olmo2",
        "gpt_neox",
        "gptj",
        "phi",
        "mixtral",
        "deepseek_v3",
    ]
)


# their plans do not cover their modules: refused by plan="hf", traced under "auto"
REFUSED = {"deepseek_v4", "hy_v4", "hrm_text", "phi4_multimodal"}


@pytest.mark.parametrize("kind", CHECKED)
def test_a_family_cut_by_its_plan_equals_the_unsplit_model(kind):
    try:
        if kind in REFUSED:
            with pytest.raises(PlanError, match="pipeline plan"):
                families.check_family(kind)
            return
        at = families.check_family(kind)
    except families.Unbuildable as exc:  # only in the whole sweep: a family our tiny config misses
        pytest.skip(str(exc))
    assert len(at) == 1


@pytest.mark.parametrize("parts", [3, 4])
def test_more_stages_each_with_its_own_layers(parts):
    families.check_family("llama", parts=parts, tie_word_embeddings=True)


def test_stages_hold_the_models_own_modules_under_their_names():
    model = families.build("llama", tie_word_embeddings=True)
    stages = gpipe.split(model, parts=2)  # a model that declares a plan is cut by it
    assert all(isinstance(stage, PlanStage) for stage in stages)
    first, last = stages
    assert first.model.layers[0] is model.model.layers[0]
    assert last.model.layers[3] is model.model.layers[3]
    assert last.model.norm is model.model.norm
    assert "model.embed_tokens.weight" in first.state_dict()
    assert "model.layers.3.mlp.up_proj.weight" not in first.state_dict()
    assert "lm_head.weight" in last.state_dict() and "model.norm.weight" in last.state_dict()
    # the tied head is the embedding: one parameter, held by both stages
    assert last.lm_head.weight is first.model.embed_tokens.weight
    assert stages.split_names("lm_head.weight") == [
        "0.model.embed_tokens.weight",
        "1.lm_head.weight",
    ]
    assert stages.original_name("1.lm_head.weight") == "model.embed_tokens.weight"
    assert stages.original_state_dict().keys() == model.state_dict().keys()
    assert stages.at == ["model.layers.2"]


def test_weights_load_by_the_names_a_saved_model_has(tmp_path):
    model = families.build("llama", tie_word_embeddings=True)
    model.save_pretrained(tmp_path)  # the tied head is not written
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in saved
    fresh = families.build("llama", tie_word_embeddings=True)
    torch.nn.init.zeros_(fresh.model.embed_tokens.weight)
    stages = gpipe.split(fresh, at=["model.layers.1"])
    assert stages.load_original_state_dict(saved) == [0, 1]
    torch.testing.assert_close(stages[1].lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


def test_a_padding_mask_and_positions_reach_every_stage():
    model = families.build("qwen2").eval()
    ids = torch.randint(3, 96, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    with torch.no_grad():
        expected = model(**inputs, use_cache=False).logits
        got = families.run_stages(gpipe.split(model, parts=3), inputs).logits
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_cut_by_measured_time():
    model = families.build("llama")
    stages = gpipe.split(model, parts=2, balance="time")
    assert len(stages) == 2 and stages.at[0].startswith("model.layers.")


def test_a_model_on_meta_is_cut_without_examples():
    with torch.device("meta"):
        model = families.build("mistral", dtype=torch.float32)
    stages = gpipe.split(model, parts=4)
    assert stages.at == ["model.layers.1", "model.layers.2", "model.layers.3"]


def test_bad_cuts_are_one_line_each():
    model = families.build("llama")
    with pytest.raises(PlanError, match=r"parts=5 but LlamaForCausalLM has 4 decoder layers"):
        gpipe.split(model, parts=5)
    with pytest.raises(PlanError, match=r"model.layers.1 to model.layers.3"):
        gpipe.split(model, at=["layers.2"])
    with pytest.raises(PlanError, match="in order"):
        gpipe.split(model, at=["model.layers.3", "model.layers.1"])
    with pytest.raises(ValueError, match="plan must be 'hf', None or 'auto'"):
        gpipe.split(model, parts=2, plan="vllm")


# Families that declare no plan, read from their modules: layers that return their hidden
# states (GPT-2, which also adds position embeddings on every stage; StableLM) or a tuple
# (BLOOM, MPT)
READ = ["gpt2", "gpt_bigcode", "stablelm", "bloom", "mpt"]


@pytest.mark.parametrize("kind", READ)
def test_a_family_without_a_plan_cut_by_its_modules_equals_the_unsplit_model(kind):
    assert not families.tiny_config(kind).base_model_pp_plan
    assert len(families.check_family(kind, parts=3)) == 2


def test_a_plan_read_on_meta_is_the_one_read_on_a_device():
    model = families.build("gpt2")
    with torch.device("meta"):
        on_meta = families.build("gpt2")
    stages = gpipe.split(model, parts=2, plan="hf")
    meta_stages = gpipe.split(on_meta, parts=2, plan="hf")
    assert stages.at == meta_stages.at == ["transformer.h.2"]
    assert stages[0].layout == meta_stages[0].layout
    assert stages[0].layout.before == ("wte", "wpe") and stages[0].layout.after == ("ln_f",)


def test_a_model_whose_plan_cannot_be_read():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(PlanError, match=r"children hold 0 lists of layers \(\[\]\)"):
        gpipe.split(families.build("opt"), parts=2, plan="hf")  # its layers lie deeper
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32))
    model.transformer.register_module("proj", torch.nn.Linear(16, 16))  # run by no one
    with pytest.raises(PlanError, match=r"does not run the modules read as one \(\[.*'proj'\]\)"):
        gpipe.split(model, parts=2, plan="hf")
    with pytest.raises(ValueError, match=r"none were given \(.*does not run the modules"):
        gpipe.split(model, parts=2)  # "auto" traces a model that declares no plan, if it can


def test_auto_reads_the_plan_of_a_model_given_nothing_to_trace_on():
    model = families.build("gpt2")
    assert all(isinstance(stage, PlanStage) for stage in gpipe.split(model, parts=2))
    traced = gpipe.split(model, (torch.randint(3, 96, (2, 8)),), parts=2)
    assert not any(isinstance(stage, PlanStage) for stage in traced)
    with pytest.raises(ValueError, match=r"none were given \(only a Hugging Face causal LM"):
        gpipe.split(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), parts=2)


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("dory", r"once each in that order"),  # its layers run again, in loops
        ("nanochat", r"do not compute what the model does"),  # its last norm has no weights
        ("openai-gpt", r"fail where the model runs \(shape"),
    ],
)
def test_a_read_plan_whose_stages_differ_from_the_model_is_refused(kind, why):
    with pytest.raises(PlanError, match=f"declares no pipeline plan, and .*{why}"):
        gpipe.split(families.build(kind), parts=2, plan="hf")


def test_the_stages_of_a_read_plan_are_checked_against_the_model_they_came_from():
    torch.manual_seed(0)
    model, other = families.build("gpt2"), families.build("gpt2")
    stages = gpipe.split(other, parts=2, plan="hf")
    check_read_plan(other, list(stages))
    with pytest.raises(PlanError, match="do not compute what the model does"):
        check_read_plan(model, list(stages))


def test_the_plan_or_tracing_compute_the_same():
    model = families.build("llama", use_cache=False)  # no cache object in the traced output
    ids = torch.randint(3, 96, (2, 8))
    traced = gpipe.split(copy.deepcopy(model), (ids,), at=["model.layers.2"], plan=None)
    planned = gpipe.split(model, (ids,), at=["model.layers.2"])
    assert not isinstance(traced[0], PlanStage)
    with torch.no_grad():
        torch.testing.assert_close(
            families.run_stages(planned, ids).logits, families.run_stages(traced, ids).logits
        )
