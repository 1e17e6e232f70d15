"""A Hugging Face folder's weights by the names ``from_pretrained`` gives them: GPT-NeoX saves
its ``lm_head`` as ``embed_out``, and ``LazyWeights`` reads it back into ``lm_head``; experts
saved one by one are read stacked, as transformers stacks them; a tensor another conversion
makes is refused by name."""

import pytest
import torch

from gpipe.errors import ConfigError
from gpipe.training.hf.models import LazyWeights, build_hf_meta, write_initial_weights

transformers = pytest.importorskip("transformers", reason="--model hf: needs transformers")


def _tiny_neox() -> "transformers.GPTNeoXConfig":
    return transformers.GPTNeoXConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )


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


def _tiny_mixtral(**options) -> "transformers.MixtralConfig":
    return transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=3,
        num_experts_per_tok=1,
        max_position_embeddings=32,
        **options,
    )


def test_experts_saved_one_by_one_are_read_stacked_as_from_pretrained_stacks_them(tmp_path):
    """Mixtral saves one tensor per expert and map (w1, w2, w3), as the Hub's checkpoints
    are; transformers stacks them as it loads, w1 and w3 joined into one gate-and-up tensor:
    read so, each of the model's tensors equals the model's own, spread over shards too."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(_tiny_mixtral())
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in LazyWeights(tmp_path)  # saved
    meta = build_hf_meta(tmp_path / "config.json")
    weights = LazyWeights(tmp_path, meta)
    state = model.state_dict()
    assert set(weights) == set(meta.state_dict())
    assert weights["model.layers.1.mlp.experts.gate_up_proj"].shape == (3, 64, 16)
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name


def test_a_tensor_made_by_another_conversion_is_refused_by_name(tmp_path):
    """LaraMini's fused projection is split as it loads: no operation gpipe reads."""
    from ..splitting.hf_families import build

    build("lara_mini", dtype=torch.float32).save_pretrained(tmp_path)
    meta = build_hf_meta(tmp_path / "config.json")
    with pytest.raises(
        ValueError,
        match=r"its tensor model\.layers\.0\.\S+ is saved in a layout "
        r"that transformers converts .*\(Split into",
    ):
        LazyWeights(tmp_path, meta)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_mixture_of_experts_drawn_from_its_config_reads_back_whole(tmp_path, tied):
    """`gpipe train --model hf:` from a config draws the weights once, into the run folder,
    under the model's own names, each shared tensor once (a tied head is its embedding):
    ``save_pretrained`` would write Mixtral's stacked experts one by one, to be stacked again
    as each rank reads them."""
    config = _tiny_mixtral(tie_word_embeddings=tied)
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


def test_a_config_its_class_cannot_build_is_refused_in_one_line(tmp_path):
    """A pad_token_id beyond the vocabulary: the class's own AssertionError was a traceback
    of ``gpipe plan`` (and of the run drawing its first weights)."""
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        pad_token_id=100,
    )
    config.save_pretrained(tmp_path)
    with pytest.raises(
        ConfigError,
        match=rf"^--model hf:{tmp_path}: its config does not build a model \(AssertionError: ",
    ):
        build_hf_meta(tmp_path)
