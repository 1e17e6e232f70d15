"""A Hugging Face ``config.json`` read as the shapes of a decoder-only transformer.

Nothing is built and transformers is not imported: the JSON is read, and each family's
conventions (GPT-2, Llama, Mistral, Qwen, Gemma and the like; mixtures of experts such as
Mixtral, Qwen-MoE, OLMoE, GPT-OSS, Llama 4 and DeepSeek-V3 with its latent attention; sliding
and chunked attention windows) are followed as transformers' own config classes and models
read them, defaults included. What does not make a shape is refused in one line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gpipe.planning.transformer import TransformerShape, check_count

__all__ = ["from_hf_config"]

# Families whose MLP is gated (SwiGLU/GeGLU: three matrices, gate and up side by side).
_GATED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "olmo", "olmo2"}
_GATED |= {"phi3", "cohere", "internlm2", "granite", "yi", "baichuan", "exaone"}
_GATED |= {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "gpt_oss", "granitemoe"}
_GATED |= {"gemma3_text", "llama4", "llama4_text"}  # Gemma 3's GeGLU names no gated act
_GATED_ACTS = {"silu", "swish", "swiglu", "geglu"}
# Families whose config class ties the output matrix to the embedding unless the config says
# otherwise (transformers' defaults of tie_word_embeddings; the others default to untied).
_TIED = {"gpt2", "bloom", "opt", "gpt_neo", "gpt_bigcode", "gpt-sw3", "openai-gpt", "xglm"}
_TIED |= {"gemma", "gemma2", "gemma3", "gemma3_text", "falcon", "mpt", "starcoder2"}
_TIED |= {"cohere", "cohere2", "smollm3", "ernie4_5", "ernie4_5_moe", "jetmoe", "minicpm3"}
# Families with one always-run shared expert as wide as the routed ones, which their
# configs do not name (Llama 4's MoE blocks).
_ONE_SHARED_EXPERT = {"llama4", "llama4_text"}
# Encoders and encoder-decoders: their configs give a width, depth and heads too, but not
# the decoder the planner prices.
_NOT_DECODERS = {"bert", "roberta", "xlm-roberta", "deberta", "deberta-v2", "distilbert"}
_NOT_DECODERS |= {"albert", "electra", "mpnet", "modernbert", "t5", "mt5", "umt5", "bart"}
_NOT_DECODERS |= {"mbart", "pegasus", "marian", "whisper", "longt5", "switch_transformers"}
# Sliding windows as transformers' config classes default them where a config.json leaves
# ``sliding_window`` out (other families: none); Qwen's slide only under use_sliding_window.
_WINDOW = {"mistral": 4096, "ministral": 4096, "gemma2": 4096, "gemma3": 4096}
_WINDOW |= {"gemma3_text": 4096, "cohere2": 4096, "gpt_oss": 128}
_QWEN_WINDOWS = {"qwen2": 4096, "qwen3": 4096, "qwen2_moe": 4096, "qwen3_moe": 4096}
# Families whose every block slides, whatever layer_types says (their modeling reads none)
_ALL_SLIDE = {"mistral", "mixtral", "phi3", "phimoe", "starcoder2", "qwen3_moe"}
# Families whose blocks slide but every n-th (from 1), n fixed or the config's
# sliding_window_pattern, when they list no layer_types
_FULL_EVERY = {"gemma2": 2, "gpt_oss": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}
_FIXED_PATTERN = {"gemma2", "gpt_oss"}
_LLAMA_4 = {"llama4", "llama4_text"}
# Families whose config classes do not read use_sliding_window: they slide whatever it says
_FLAG_IGNORED = {"mistral", "ministral", "mixtral", "phi3", "phimoe", "starcoder2"}
_FLAG_IGNORED |= set(_FULL_EVERY)


def _first(config: dict[str, Any], *keys: str) -> Any:
    return next((config[k] for k in keys if config.get(k) is not None), None)


def from_hf_config(path: str | Path) -> TransformerShape:
    """The shapes in a Hugging Face ``config.json`` (or a folder holding one), of a dense
    decoder or a mixture of experts, with grouped or latent attention; what does not make a
    shape is refused, in one line."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model hf:{path}: cannot read a config.json ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model hf:{path}: expected a JSON object")
    text = config.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"--model hf:{path}: text_config must be a JSON object, got {text!r}")
    config = {**config, **text}
    _check_decoder(config, path)
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head")
    vocab = _first(config, "vocab_size")
    sizes = (("layers", layers), ("width", hidden), ("heads", heads), ("vocab", vocab))
    missing = [n for n, v in sizes if v is None]
    if missing:
        raise ValueError(f"--model hf:{path}: the config gives no {', '.join(missing)}")
    try:
        return _shape_of(config, file, (layers, hidden, heads, vocab))
    except (ValueError, TypeError) as exc:  # a field of the wrong kind, named where it is read
        raise ValueError(f"--model hf:{path}: {exc}") from None


def _check_decoder(config: dict[str, Any], path: str | Path) -> None:
    """Refuse, in one line, an encoder or encoder-decoder's config: read as a decoder's, its
    shapes would be priced as a model it is not."""
    kind = str(config.get("model_type", "")).lower()
    if config.get("is_encoder_decoder") or kind in _NOT_DECODERS:
        what = "an encoder-decoder" if config.get("is_encoder_decoder") else "an encoder"
        raise ValueError(
            f"--model hf:{path}: model_type {kind or '(none)'} is {what}; --cluster plans "
            "decoder-only causal LMs (GPT-2, Llama, Mistral, Qwen, Gemma and the like)"
        )


def _shape_of(
    config: dict[str, Any], file: Path, sizes: tuple[Any, Any, Any, Any]
) -> TransformerShape:
    """``from_hf_config``'s shape, out of the config's fields (the sizes already found)."""
    layers, hidden, heads, vocab = sizes
    for key, value in zip(("layers", "width", "heads", "vocab"), sizes, strict=True):
        check_count("the config", key, value, least=1)
    kind = str(config.get("model_type", "")).lower()
    act = str(_first(config, "hidden_act", "activation_function", "hidden_activation") or "")
    kv = _first(config, "num_key_value_heads", "n_head_kv", "num_kv_heads")
    if kv is None and config.get("multi_query"):
        kv = 1
    dropouts = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "dropout")
    ffn = _first(config, "intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim")
    ffn = 4 * hidden if ffn is None else ffn  # a width of 0 is refused, not defaulted
    dense_ffn = _first(config, "intermediate_size_mlp")  # Llama 4: dense blocks' MLP, not experts'
    head_dim = _first(config, "head_dim")
    head_dim = hidden // heads if head_dim is None else head_dim
    latent = _latent_attention(config)
    return TransformerShape(
        name=str(config.get("_name_or_path") or kind or file.parent.name or "hf model"),
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=latent.pop("kv_heads", None) or (heads if kv is None else kv),
        head_dim=latent.pop("head_dim", None) or head_dim,
        **latent,
        ffn=ffn if dense_ffn is None else dense_ffn,
        vocab=vocab,
        gated=kind in _GATED or act.lower() in _GATED_ACTS,
        tied=bool(config.get("tie_word_embeddings", kind in _TIED)),
        dropout=any(_probability(config, k) > 0 for k in dropouts),
        max_seq_len=_first(config, "max_position_embeddings", "n_positions", "seq_length"),
        **_experts(config, layers, ffn),
        **_windows(config, layers),
    )


def _probability(config: dict[str, Any], key: str) -> float:
    """A config's dropout probability ``key`` (0 if not given)."""
    value = config.get(key)
    if value is None:
        return 0.0
    try:  # a number, or one written as a string
        p = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        p = math.nan
    if not 0 <= p <= 1:
        raise ValueError(f"{key} must be a probability, got {value!r}")
    return p


def _latent_attention(config: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention's fields as DeepSeek-V2/V3 and Kimi-K2 name them (none
    for other attention); a query or key head's width is its part without and its part
    with rotary positions."""
    if not config.get("kv_lora_rank"):
        return {}
    rope = _first(config, "qk_rope_head_dim") or 0
    nope = _first(config, "qk_nope_head_dim") or 0
    return {
        "head_dim": nope + rope,
        "kv_heads": config.get("num_attention_heads"),
        "q_lora_rank": _first(config, "q_lora_rank") or 0,
        "kv_lora_rank": config["kv_lora_rank"],
        "qk_rope_dim": rope,
        "v_head_dim": _first(config, "v_head_dim") or nope + rope,
    }


def _experts(config: dict[str, Any], layers: int, ffn: int) -> dict[str, Any]:
    """A mixture of experts' fields of ``TransformerShape`` as the families' configs name
    them (none for a dense model): the routed experts and how many a token takes, their
    width (``moe_intermediate_size``, else ``intermediate_size``), the shared experts'
    (Qwen-MoE's one of its own width, DeepSeek-style ``n_shared_experts`` of the experts',
    Llama 4's one unnamed), and the blocks that keep a dense MLP (the first
    ``first_k_dense_replace``, those off ``decoder_sparse_step``,
    ``interleave_moe_layer_step`` or ``moe_layer_freq``, those in ``mlp_only_layers``, or
    those not in ``moe_layers``)."""
    experts = _first(
        config, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"
    )
    if not experts:
        return {}
    width = _first(config, "moe_intermediate_size") or ffn
    shared = _first(config, "shared_expert_intermediate_size")
    if shared is None:  # DeepSeek's: a count of experts as wide as the routed ones
        names = ("n_shared_experts", "moe_num_shared_experts", "num_shared_experts")
        count = next((k for k in names if config.get(k) is not None), None)
        if count is not None:
            check_count("the config", count, config[count], least=0)
            check_count("the config", "expert_ffn", width, least=1)
        default = int(str(config.get("model_type", "")).lower() in _ONE_SHARED_EXPERT)
        shared = width * (default if count is None else config[count])
    first_dense = _first(config, "first_k_dense_replace") or 0
    # Qwen-MoE's and Llama 4's step count from 1 (block step - 1 is the first with experts),
    # DeepSeek's moe_layer_freq from 0
    from_one = ("decoder_sparse_step", "interleave_moe_layer_step")
    step = _first(config, *from_one, "moe_layer_freq") or 1
    only_mlp = set(_indices(config, "mlp_only_layers", layers) or ())
    listed = _indices(config, "moe_layers", layers)

    def dense(i: int) -> bool:
        if listed is not None:
            return i not in listed
        off_step = (i + 1) % step != 0 if any(k in config for k in from_one) else i % step != 0
        return i < first_dense or i in only_mlp or (step > 1 and off_step)

    return {
        "experts": experts,
        "experts_per_token": _first(
            config, "num_experts_per_tok", "experts_per_token", "moe_topk", "moe_k"
        ),
        "expert_ffn": width,
        "shared_ffn": shared,
        "dense_blocks": tuple(i for i in range(layers) if dense(i)),
    }


def _windows(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """Each block's attention window as transformers decides it (none where every block
    attends to the whole prefix): Llama 4's chunks of ``attention_chunk_size`` (8192 unless
    null) but in its NoPE blocks (0 in ``no_rope_layers``: every fourth by default); else
    ``sliding_window`` (the family's default if left out; none if null or 0, or if
    ``use_sliding_window`` is false where the family reads it, as Qwen's are unless it is
    true) on the blocks ``layer_types`` says slide, or by the family's rule."""
    kind = str(config.get("model_type", "")).lower()
    if kind in _LLAMA_4:
        chunk = config.get("attention_chunk_size", 8192)
        flags = _llama_4_chunked(config, layers)
        return _window_fields(chunk, flags, "attention_chunk_size", chunked=True)
    default = _WINDOW.get(kind) or _QWEN_WINDOWS.get(kind)
    window = config.get("sliding_window", default)
    if kind not in _FLAG_IGNORED and not config.get(
        "use_sliding_window", kind not in _QWEN_WINDOWS
    ):
        window = None
    if not window:
        return {}
    types = config.get("layer_types")
    if kind in _ALL_SLIDE:
        flags = [True] * layers
    elif types is not None:
        flags = [t == "sliding_attention" for t in _layer_types(types, layers)]
    else:
        flags = [_slides(config, kind, i) for i in range(layers)]
    return _window_fields(window, flags, "sliding_window")


def _slides(config: dict[str, Any], kind: str, i: int) -> bool:
    """Whether block ``i`` slides by its family's rule, where the config lists no
    layer_types: Qwen2/3's above the first ``max_window_layers``, Qwen-MoE's every other
    below them, Gemma's, Cohere 2's and GPT-OSS's all but every n-th, the others' all."""
    top = config.get("max_window_layers", 28)
    if kind in ("qwen2", "qwen3"):
        return bool(i >= top)
    if kind == "qwen2_moe":
        return bool((i + 1) % 2 and i < top)
    if kind in _FULL_EVERY:
        pattern = None if kind in _FIXED_PATTERN else config.get("sliding_window_pattern")
        n = pattern or _FULL_EVERY[kind]
        check_count("the config", "sliding_window_pattern", n, least=1)
        return bool((i + 1) % n)
    return True


def _llama_4_chunked(config: dict[str, Any], layers: int) -> list[bool]:
    """Llama 4's blocks that attend in chunks: those ``layer_types`` names so, else those
    with rotary positions (1 in ``no_rope_layers``; by default all but every
    ``no_rope_layer_interval``-th)."""
    types = config.get("layer_types")
    if types is not None:
        return [t == "chunked_attention" for t in _layer_types(types, layers)]
    flags = config.get("no_rope_layers")
    if not flags:  # transformers' default, also for an empty list
        interval = config.get("no_rope_layer_interval", 4)
        check_count("the config", "no_rope_layer_interval", interval, least=1)
        return [(i + 1) % interval != 0 for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers:
        raise ValueError(f"no_rope_layers must be a list of {layers} flags, got {flags!r}")
    return [bool(f) for f in flags]


def _layer_types(types: Any, layers: int) -> list[str]:
    """A config's ``layer_types``: one attention kind per block."""
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"layer_types must be a list of {layers} attention kinds, got {types!r}")
    return [str(t) for t in types]


def _window_fields(
    window: Any, flags: list[bool], key: str, chunked: bool = False
) -> dict[str, Any]:
    """``TransformerShape``'s windows: ``window`` on the blocks flagged (none at all if no
    block has one)."""
    if not window or not any(flags):
        return {}
    check_count("the config", key, window, least=1)
    return {"windows": tuple(window if f else None for f in flags), "chunked": chunked}


def _indices(config: dict[str, Any], key: str, layers: int) -> list[int] | None:
    """A config's list of block indices (``moe_layers``, ``mlp_only_layers``), if given."""
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise ValueError(f"{key} must be a list of block indices, got {value!r}")
    outside = [i for i in value if not 0 <= i < layers]
    if outside:
        raise ValueError(
            f"{key} names blocks {outside}, but the model has {layers} (0 to {layers - 1})"
        )
    return value
