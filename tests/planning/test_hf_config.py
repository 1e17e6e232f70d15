"""Hugging Face configs read for their shapes, family by family, as transformers builds them:
parameters, experts, attention windows, and what cannot make a shape refused in one line."""

import json

import pytest

from gpipe.planning.cluster_step import step_flops
from gpipe.planning.hf_config import from_hf_config


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


# Dense families as their published config.json files give them: the keys that shape them,
# tie_word_embeddings left to the family's default as the files leave it
GEMMA_2_2B = {
    "model_type": "gemma2",
    "num_hidden_layers": 26,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "vocab_size": 256000,
    "hidden_activation": "gelu_pytorch_tanh",
}
GEMMA_3_1B = {
    "model_type": "gemma3_text",
    "num_hidden_layers": 26,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "hidden_activation": "gelu_pytorch_tanh",
}
FALCON_7B = {
    "model_type": "falcon",
    "num_hidden_layers": 32,
    "hidden_size": 4544,
    "num_attention_heads": 71,
    "multi_query": True,
    "parallel_attn": True,
    "vocab_size": 65024,
}
LLAMA_4_TEXT = {
    "model_type": "llama4_text",
    "num_hidden_layers": 48,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 202048,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "num_local_experts": 16,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 1,
}
LLAMA_4_SCOUT = {"model_type": "llama4", "text_config": LLAMA_4_TEXT}
LLAMA_4_MAVERICK = {
    "model_type": "llama4",
    "text_config": {**LLAMA_4_TEXT, "num_local_experts": 128, "interleave_moe_layer_step": 2},
}


@pytest.mark.parametrize(
    ("config", "billions", "tied"),
    [
        (GEMMA_2_2B, 2.614, True),
        (GEMMA_3_1B, 1.000, True),
        (FALCON_7B, 6.921, True),
        ({**GEMMA_2_2B, "tie_word_embeddings": False}, 3.204, False),
    ],
    ids=["gemma-2-2b", "gemma-3-1b", "falcon-7b", "gemma-2 untied as its config says"],
)
def test_a_family_that_ties_by_default_counts_its_embedding_once(tmp_path, config, billions, tied):
    """Gemma's and Falcon's config files leave tie_word_embeddings out: their families tie
    by default, as transformers builds them; a config that says otherwise wins."""
    shape = _shape(tmp_path, config)
    assert shape.tied is tied
    assert shape.params() == pytest.approx(billions * 1e9, rel=1e-3)


def test_gemma_3_is_gated_as_text_only_and_inside_its_multimodal_config(tmp_path):
    """Gemma 3's MLP is GeGLU (gelu_pytorch_tanh names no gate): three matrices."""
    alone = _shape(tmp_path, GEMMA_3_1B)
    assert alone.gated and alone.layer_params() == 1152 * 256 * (4 + 2 * 1 + 4) + 3 * 1152 * 6912
    text = {**GEMMA_3_1B, "num_hidden_layers": 34, "hidden_size": 2560, "intermediate_size": 10240}
    text |= {"num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 262208}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 1152, "num_hidden_layers": 27}
    multimodal = {"model_type": "gemma3", "text_config": text, "vision_config": vision}
    shape = _shape(tmp_path, multimodal)
    assert shape.gated and shape.tied and shape.hidden == 2560
    assert shape.params() == pytest.approx(3.88e9, rel=0.01)  # Gemma 3 4B less its vision tower


@pytest.mark.parametrize(
    ("config", "total", "active", "dense"),
    [(LLAMA_4_SCOUT, 107.8, 17.2, ()), (LLAMA_4_MAVERICK, 400.7, 17.2, tuple(range(0, 48, 2)))],
    ids=["scout", "maverick"],
)
def test_llama_4_has_a_shared_expert_and_wider_dense_blocks(tmp_path, config, total, active, dense):
    """Llama 4 (published: Scout 109 B with its vision tower, Maverick 400 B, 17 B active):
    each block with experts runs one shared expert beside its routed one, and Maverick's
    dense blocks (every other, from the first) have an MLP of intermediate_size_mlp."""
    shape = _shape(tmp_path, config)
    assert (shape.expert_ffn, shape.shared_ffn, shape.ffn) == (8192, 8192, 16384)
    assert shape.dense_blocks == dense
    assert shape.params() == pytest.approx(total * 1e9, rel=1e-3)
    assert shape.active_params() == pytest.approx(active * 1e9, rel=1e-2)


def test_opts_mlp_width_is_its_ffn_dim(tmp_path):
    config = {"model_type": "opt", "num_hidden_layers": 4, "hidden_size": 1024}
    config |= {"num_attention_heads": 16, "vocab_size": 50272, "ffn_dim": 2048}
    shape = _shape(tmp_path, config)
    assert (shape.ffn, shape.gated, shape.tied) == (2048, False, True)


@pytest.mark.parametrize(
    ("config", "what"),
    [
        (
            {"model_type": "bert", "num_hidden_layers": 12, "hidden_size": 768}
            | {"num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 30522},
            "model_type bert is an encoder;",
        ),
        (
            {"model_type": "t5", "num_layers": 6, "d_model": 512, "num_heads": 8}
            | {"vocab_size": 32128, "is_encoder_decoder": True},
            "model_type t5 is an encoder-decoder;",
        ),
        (
            {**GEMMA_2_2B, "model_type": "my_seq2seq", "is_encoder_decoder": True},
            "model_type my_seq2seq is an encoder-decoder;",
        ),
    ],
    ids=["bert", "t5", "is_encoder_decoder"],
)
def test_an_encoder_is_refused_in_one_line(tmp_path, config, what):
    with pytest.raises(ValueError, match=f"--model hf:.*: {what} .* decoder-only") as caught:
        _shape(tmp_path, config)
    assert "\n" not in str(caught.value)


def _tiny(config: dict) -> dict:
    """``config`` shrunk to a model transformers builds in a moment, its structure kept."""
    small = {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 96}
    small |= {"num_attention_heads": 4, "intermediate_size": 128, "moe_intermediate_size": 32}
    small |= {"shared_expert_intermediate_size": 48, "intermediate_size_mlp": 160}
    small |= {"num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "head_dim": 32}
    small |= {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8}
    small |= {"qk_rope_head_dim": 8, "v_head_dim": 12, "first_k_dense_replace": 1}
    small |= {"num_experts_per_tok": 2}
    kv = {"num_key_value_heads": 2} if config.get("num_key_value_heads", 1) != 1 else {}
    return {**config, **{k: v for k, v in small.items() if k in config}, **kv}


@pytest.mark.parametrize(
    "config",
    [GEMMA_2_2B, GEMMA_3_1B, FALCON_7B, LLAMA_4_TEXT, MIXTRAL_8X7B, QWEN2_57B_A14B, DEEPSEEK_V3],
    ids=["gemma2", "gemma3_text", "falcon", "llama4_text", "mixtral", "qwen2_moe", "deepseek_v3"],
)
def test_the_count_is_the_matrices_transformers_builds(tmp_path, config):
    """Each family's shape, read from a small config of its structure, counts the matrices
    of the model transformers builds from it: each tied one once, and no vectors (norms,
    biases, Qwen-MoE's gate of its shared expert)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    tiny = _tiny(config)
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() > 1 and min(p.shape) > 1)
    assert from_hf_config(tmp_path).params() == matrices


# Attention windows: each family's config keys as transformers reads them, and the FLOPs of
# a window (Megatron's square scaled by the band's share of the causal triangle)
MISTRAL_7B = {
    "model_type": "mistral",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "hidden_act": "silu",
    "sliding_window": 4096,
}
_SMALL = {"num_hidden_layers": 8, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 96}
_SMALL |= {"intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16}


def _small(kind: str, **keys) -> dict:
    return {"model_type": kind, **_SMALL, **keys}


S, F = 512, None  # a window, and full attention


@pytest.mark.parametrize(
    ("config", "windows"),
    [
        (_small("mistral", sliding_window=S), (S,) * 8),
        (_small("mistral"), (4096,) * 8),  # left out: transformers' default
        (_small("mistral", sliding_window=None), ()),
        # Mistral's config does not read use_sliding_window (Qwen's do): it slides
        (_small("mistral", sliding_window=S, use_sliding_window=False), (S,) * 8),
        (_small("smollm3", sliding_window=S, use_sliding_window=False), ()),
        (_small("mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=S), (S,) * 8),
        (_small("mixtral", num_local_experts=4, num_experts_per_tok=2), ()),
        (_small("phi3", sliding_window=S), (S,) * 8),
        (_small("gemma2", sliding_window=S), (S, F) * 4),
        (_small("gemma3_text", sliding_window=S, sliding_window_pattern=4), (S, S, S, F) * 2),
        (_small("gemma3_text", sliding_window=S), (S,) * 5 + (F, S, S)),
        (
            _small("gemma3_text", sliding_window=S, layer_types=["full_attention"] * 8),
            (),
        ),
        (_small("cohere2", sliding_window=S), (S, S, S, F) * 2),
        (_small("gpt_oss", num_local_experts=4, num_experts_per_tok=2), (128, F) * 4),
        (
            _small(
                "gpt_oss",
                num_local_experts=4,
                num_experts_per_tok=2,
                layer_types=["full_attention"] * 2 + ["sliding_attention"] * 6,
            ),
            (F, F) + (128,) * 6,
        ),
        (_small("qwen2", sliding_window=S), ()),  # use_sliding_window defaults to false
        (
            _small("qwen2", sliding_window=S, use_sliding_window=True, max_window_layers=5),
            (F,) * 5 + (S,) * 3,
        ),
        (_small("qwen3", use_sliding_window=True, max_window_layers=6), (F,) * 6 + (4096,) * 2),
        (
            _small("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
            | {"use_sliding_window": True, "sliding_window": S, "max_window_layers": 5},
            (S, F, S, F, S, F, F, F),
        ),
        (
            _small("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
            | {"use_sliding_window": True, "sliding_window": S},
            (S,) * 8,
        ),
        (
            _small("llama4_text", num_local_experts=4, num_experts_per_tok=1),
            (8192,) * 3 + (F,) + (8192,) * 3 + (F,),
        ),
        (
            _small("llama4_text", num_local_experts=4, num_experts_per_tok=1)
            | {"attention_chunk_size": S, "no_rope_layers": [1, 0] * 4},
            (S, F) * 4,
        ),
        (
            _small(
                "llama4_text", num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=None
            ),
            (),
        ),
    ],
)
def test_each_blocks_window_is_the_one_transformers_gives_it(tmp_path, config, windows):
    """The windows read from a config: the family's default where it leaves a key out,
    none where null or use_sliding_window is false; and where transformers is installed,
    the window its config gives each block (layer_types where the family's attention reads
    them, else sliding_window for every block; Llama 4's chunks)."""
    shape = _shape(tmp_path, config)
    assert shape.windows == windows
    assert shape.chunked == (config["model_type"] == "llama4_text" and bool(windows))
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert shape.windows == (_hf_windows(hf) if any(_hf_windows(hf)) else ())


def _hf_windows(hf) -> tuple:
    """Each block's window as transformers' modeling picks it from its config."""
    n = hf.num_hidden_layers
    if hf.model_type == "llama4_text":
        kinds = hf.layer_types
        return tuple(hf.attention_chunk_size if k == "chunked_attention" else None for k in kinds)
    reads_types = hf.model_type not in ("mistral", "mixtral", "phi3", "qwen3_moe")
    kinds = getattr(hf, "layer_types", None) if reads_types else None
    window = hf.sliding_window or None
    if kinds is None:
        return (window,) * n
    return tuple(window if k == "sliding_attention" else None for k in kinds)


def test_a_sliding_window_counts_its_band_of_the_causal_triangle(tmp_path):
    """Mistral 7B at 32,768 tokens over a window of 4,096: a query's ``2 w - w^2 / s`` keys
    (7,680, the band ``s w - w^2 / 2`` scaled to the square as full layers are) instead of
    32,768, so 0.234375 of the full attention's FLOPs."""
    s = 32768
    windowed = _shape(tmp_path, MISTRAL_7B)
    full = _shape(tmp_path, {**MISTRAL_7B, "sliding_window": None})
    q_v = 2 * 4096
    assert windowed.attention_flops(s, 4096) == 2 * 7680 * q_v
    assert windowed.attention_flops(s, 4096) / full.attention_flops(s) == 0.234375
    saved = 32 * 2 * (s - 7680) * q_v
    assert windowed.blocks_flops(s) == pytest.approx(full.blocks_flops(s) - saved, rel=1e-12)
    assert windowed.blocks_attention_flops(s) == pytest.approx(32 * 2 * 7680 * q_v, rel=1e-12)
    hardware, model = step_flops(windowed, 8 * s, s, "selective")
    assert model == pytest.approx(step_flops(full, 8 * s, s, "none")[0] - 3 * 8 * s * saved)
    assert hardware - model == pytest.approx(8 * s * 32 * 2 * 7680 * q_v)


def test_gemma_2_counts_a_window_on_every_other_block(tmp_path):
    """Gemma 2 2B (4,096 on its 13 even blocks) at 8,192 tokens: each of those counts
    ``2 w - w^2 / s`` = 6,144 keys a query, the other 13 the whole 8,192."""
    s = 8192
    shape = _shape(tmp_path, GEMMA_2_2B)
    assert shape.windows == (4096, None) * 13
    per_key = 2 * (8 * 256 + 8 * 256)
    expected = 13 * per_key * 6144 + 13 * per_key * s
    assert shape.blocks_attention_flops(s) == pytest.approx(expected, rel=1e-12)


def test_llama_4_counts_its_chunks(tmp_path):
    """Chunks of 8,192 at 20,000 tokens: two whole chunks and one of 3,616, ``w^2 / 2``
    pairs each, scaled to the square (twice the pairs over s keys a query)."""
    shape = _shape(tmp_path, LLAMA_4_SCOUT)
    assert shape.chunked and shape.windows.count(None) == 12
    pairs = (2 * 8192**2 + 3616**2) / 2
    assert shape.causal_pairs(20000, 8192) == pairs
    q_v = 2 * 40 * 128
    assert shape.attention_flops(20000, 8192) == pytest.approx(2 * q_v * 2 * pairs / 20000)


@pytest.mark.parametrize("s", [2048, 4096])
def test_a_window_as_long_as_the_sequence_costs_exactly_full_attention(tmp_path, s):
    windowed = _shape(tmp_path, MISTRAL_7B)
    full = _shape(tmp_path, {**MISTRAL_7B, "sliding_window": None})
    assert windowed.blocks_flops(s) == full.blocks_flops(s)
    assert step_flops(windowed, 4 * s, s, "selective") == step_flops(full, 4 * s, s, "selective")


@pytest.mark.parametrize(("key", "value"), [("sliding_window", -1), ("sliding_window", "4k")])
def test_a_bad_window_is_refused_in_one_line(tmp_path, key, value):
    with pytest.raises(ValueError, match=f"{key} must be a positive integer, got"):
        _shape(tmp_path, {**MISTRAL_7B, key: value})
