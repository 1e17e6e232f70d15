"""A Hugging Face folder's weights by the names ``from_pretrained`` gives them: GPT-NeoX saves
its ``lm_head`` as ``embed_out``, and ``LazyWeights`` reads it back into ``lm_head``; a tensor
transformers would convert as it loads cannot be read alone, and is refused by name."""

import pytest
import torch

from gpipe.training.hf.models import LazyWeights, build_hf_meta, write_initial_weights

transformers = pytest.importorskip("transformers", reason="--model hf: needs transformers")


def _tiny_neox() -> "transformers.GPTNeoXConfig":
    return transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip


def test_save_pretrained_names_are_read_back_as_the_modules_names(tmp_path):
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(_tiny_neox())
    model.save_pretrained(tmp_path)
    assert "embed_out.weight" in LazyWeights(tmp_path)  # as saved, without a model
    meta = build_hf_meta(tmp_path / "config.json")
    weights = LazyWeights(tmp_path, meta)
    state = model.state_dict()
    assert "lm_head.weight" in state and "embed_out.weight" not in weights
    assert set(weights) == set(meta.state_dict())
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name


def test_a_model_of_no_transformers_class_reads_the_saved_names(tmp_path):
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(_tiny_neox()).save_pretrained(tmp_path)
    weights = LazyWeights(tmp_path, torch.nn.Linear(2, 2))
    assert "embed_out.weight" in weights and "lm_head.weight" not in weights


def test_tensors_transformers_converts_as_it_loads_are_refused_by_name(tmp_path):
    """Mixtral saves one tensor per expert, which transformers stacks as it loads: no one
    saved tensor is a module's, so none can be read alone."""
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
        num_experts_per_tok=1, max_position_embeddings=32,
    )  # fmt: skip
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path)
    meta = build_hf_meta(tmp_path / "config.json")
    with pytest.raises(
        ValueError, match=r"its tensor model\.layers\.0\.\S+\.experts\.0\.w1\.weight"
    ):
        LazyWeights(tmp_path, meta)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_mixture_of_experts_drawn_from_its_config_reads_back_whole(tmp_path, tied):
    """`gpipe train --model hf:` from a config draws the weights once, into the run folder,
    under the model's own names, each shared tensor once (a tied head is its embedding):
    ``save_pretrained`` would write Mixtral's stacked experts one by one, the layout refused
    above."""
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
        num_experts_per_tok=1, max_position_embeddings=32, tie_word_embeddings=tied,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "config")
    folder = write_initial_weights(tmp_path / "config", tmp_path / "initial", seed=3)
    meta = build_hf_meta(folder / "config.json")
    weights = LazyWeights(folder, meta)
    assert set(weights) == set(meta.state_dict()) - ({"lm_head.weight"} if tied else set())
    torch.manual_seed(3)
    drawn = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = drawn.state_dict()
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name
