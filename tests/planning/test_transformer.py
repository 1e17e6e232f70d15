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


# Mixtures of experts as their Hugging Face configs give them (the keys that shape them),
# beside the total and active parameters their model cards publish, in billions
MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
QWEN2_57B_A14B = {
    "model_type": "qwen2_moe",
    "num_hidden_layers": 28,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "moe_intermediate_size": 2560,
    "shared_expert_intermediate_size": 20480,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 151936,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
OLMOE_1B_7B = {
    "model_type": "olmoe",
    "num_hidden_layers": 16,
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 50304,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "num_experts": 64,
    "num_experts_per_tok": 8,
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
}


def _shape(tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return from_hf_config(path)


@pytest.mark.parametrize(
    ("config", "total", "active"),
    [
        (MIXTRAL_8X7B, 46.7, 12.9),
        (QWEN3_30B_A3B, 30.5, 3.3),
        (QWEN2_57B_A14B, 57.4, 14.2),
        (OLMOE_1B_7B, 6.9, 1.3),
        (DEEPSEEK_V3, 671, 37),
    ],
    ids=["mixtral-8x7b", "qwen3-30b-a3b", "qwen2-57b-a14b", "olmoe-1b-7b", "deepseek-v3"],
)
def test_a_mixture_of_experts_counts_every_expert_held_and_the_routed_ones_run(
    tmp_path, config, total, active
):
    shape = _shape(tmp_path, config)
    assert shape.is_moe and shape.gated
    assert shape.dense_blocks == tuple(range(config.get("first_k_dense_replace", 0)))
    assert shape.params() == pytest.approx(total * 1e9, rel=0.01)
    assert shape.active_params() == pytest.approx(active * 1e9, rel=0.03)


def test_a_token_through_all_experts_costs_a_dense_mlp_as_wide_as_them(tmp_path):
    """With every expert taken by every token, the FLOPs are a dense MLP's of their summed
    width, plus the router's one product."""
    moe = _shape(tmp_path, {**OLMOE_1B_7B, "num_experts_per_tok": 64})
    dense = _shape(tmp_path, {**OLMOE_1B_7B, "num_experts": 0, "intermediate_size": 64 * 1024})
    router = 2.0 * 2048 * 64
    s = 4096
    assert moe.blocks_flops(s) == pytest.approx(dense.blocks_flops(s) + 16 * router, rel=1e-12)
    # a step's model FLOPs: the router's forward and backward more, in each of 16 blocks
    tokens = 8 * s
    more = step_flops(moe, tokens, s, "none")[1] - step_flops(dense, tokens, s, "none")[1]
    assert more == pytest.approx(tokens * 3 * 16 * router, rel=1e-9)


@pytest.mark.parametrize(
    ("keys", "dense"),
    [
        ({"first_k_dense_replace": 3}, (0, 1, 2)),  # DeepSeek, GLM-4.5
        ({"decoder_sparse_step": 2}, (0, 2, 4, 6)),  # Qwen-MoE: every second block has experts
        ({"mlp_only_layers": [5, 7]}, (5, 7)),
        ({"moe_layers": [0, 1, 2, 3]}, (4, 5, 6, 7)),
    ],
)
def test_the_blocks_that_keep_a_dense_mlp_are_read_from_each_familys_keys(tmp_path, keys, dense):
    config = {**OLMOE_1B_7B, "num_hidden_layers": 8, "moe_intermediate_size": 512, **keys}
    shape = _shape(tmp_path, config)
    assert shape.dense_blocks == dense
    assert shape.moe_blocks == 8 - len(dense)
    mixed = shape.params() - 2 * shape.embedding_params()
    assert mixed == len(dense) * shape.layer_params() + shape.moe_blocks * shape.layer_params(True)


def test_shared_experts_are_counted_as_deepseek_and_qwen_name_them(tmp_path):
    qwen = _shape(tmp_path, QWEN2_57B_A14B)
    assert qwen.shared_ffn == 20480
    glm = _shape(tmp_path, {**OLMOE_1B_7B, "moe_intermediate_size": 512, "n_shared_experts": 2})
    assert glm.shared_ffn == 1024
    no_shared = _shape(tmp_path, {**OLMOE_1B_7B, "moe_intermediate_size": 512})
    for count in (glm.layer_params, glm.active_layer_params):  # held, and run by every token
        other = getattr(no_shared, count.__name__)
        assert count(True) - other(True) == glm.mlp_params(1024)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**MIXTRAL_8X7B, "num_experts_per_tok": None}, "experts_per_token must be"),
        ({**MIXTRAL_8X7B, "num_experts_per_tok": 9}, "between 1 and its 8 experts, got .*=9"),
    ],
    ids=["no top-k", "top-k above the experts"],
)
def test_what_a_mixture_of_experts_config_cannot_give_is_one_line(tmp_path, config, message):
    with pytest.raises(ValueError, match="--model hf:.*: .*" + message) as caught:
        _shape(tmp_path, config)
    assert "\n" not in str(caught.value)


def test_latent_attention_projects_through_its_latents(tmp_path):
    """DeepSeek-V3's attention: queries through a latent of 1,536, keys and values through one
    of 512 (and a shared rotary key of 64), up to 128 heads of 192 (queries, keys) and 128
    (values); its products and its FLOPs over the sequence follow those widths."""
    shape = _shape(tmp_path, DEEPSEEK_V3)
    h, heads = 7168, 128
    assert shape.latent and (shape.head_dim, shape.v_width) == (192, heads * 128)
    assert shape.attention_products() == [
        (h, 1536, None),
        (1536, heads * 192, "out"),
        (h, 512 + 64, None),
        (512, heads * (128 + 128), "out"),
        (heads * 128, h, "in"),
    ]
    # Q K^T over 192 numbers a head, the weighted values over 128
    assert shape.attention_flops(4096) == 2 * 4096 * heads * (192 + 128)
    without_q_latent = _shape(tmp_path, {**DEEPSEEK_V3, "q_lora_rank": None})
    assert without_q_latent.attention_products()[0] == (h, heads * 192, "out")
