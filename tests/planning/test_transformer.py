"""A model's shapes and FLOPs: Megatron-LM's equation 3 for the GPT, and Hugging Face
configs read for their shapes."""

import json

import pytest

from gpipe.planning.cluster_step import step_flops
from gpipe.planning.transformer import from_hf_config, gpt_shape


@pytest.mark.parametrize("layers, hidden, heads", [(24, 2304, 24), (128, 25600, 160)])
def test_the_gpt_counts_megatrons_equation_3(layers, hidden, heads):
    b, s, v = 512, 2048, 51200
    shape = gpt_shape(layers, hidden, heads, v)
    equation_3 = (
        96 * b * s * layers * hidden**2 * (1 + s / (6 * hidden) + v / (16 * layers * hidden))
    )
    hardware, model = step_flops(shape, b * s, s, "full")
    assert hardware == pytest.approx(equation_3, rel=1e-12)
    assert model == pytest.approx(equation_3 * 3 / 4 + 6 * b * s * hidden * v / 4, rel=1e-12)
    assert step_flops(shape, b * s, s, "none") == (model, model)


def test_a_llama_config_gives_gqa_and_a_gated_mlp(tmp_path):
    config = {
        "model_type": "llama",
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "hidden_act": "silu",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = from_hf_config(tmp_path)
    assert (shape.gated, shape.kv_heads, shape.head_dim, shape.max_seq_len) == (True, 8, 128, 8192)
    assert shape.params() == pytest.approx(70.55e9, rel=0.01)  # Llama 3 70B


def test_a_gpt2_config_is_not_gated(tmp_path):
    config = {
        "model_type": "gpt2",
        "n_layer": 12,
        "n_embd": 768,
        "n_head": 12,
        "vocab_size": 50257,
        "n_positions": 1024,
        "activation_function": "gelu_new",
    }
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(config))
    shape = from_hf_config(path)
    assert (shape.gated, shape.ffn, shape.tied, shape.max_seq_len) == (False, 3072, True, 1024)
    assert shape.params() == pytest.approx(124.4e6, rel=0.01)


def test_a_mixture_of_experts_is_refused_in_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8}))
    with pytest.raises(ValueError, match="a mixture of 8 experts"):
        from_hf_config(path)
