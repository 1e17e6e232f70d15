"""A decoder-only transformer as a cluster plan sees it: its shapes, parameters and FLOPs.

Nothing is built: the shapes come from the built-in GPT's flags or from a Hugging Face
``config.json`` (GPT-2, Llama, Mistral, Qwen and the like, and mixtures of experts such as
Mixtral, Qwen-MoE, OLMoE, GPT-OSS and DeepSeek-V3 with its latent attention), read as JSON.
FLOPs are counted as Megatron-LM counts them (Narayanan et al. 2021, arXiv:2104.04473,
appendix): the matrix products of each layer, attention over the whole ``s x s`` square (no
causal halving), and the logits, with a backward of twice the forward. In a mixture of
experts a token runs through the router, the shared experts and the ``experts_per_token``
experts it is routed to, so its FLOPs count those (the active parameters) while the memory
holds every expert.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TransformerShape", "from_hf_config", "gpt_shape"]

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


@dataclass(frozen=True)
class TransformerShape:
    """The shapes that decide a step's cost: ``layers`` blocks of width ``hidden`` with
    ``heads`` query heads of ``head_dim`` and ``kv_heads`` key/value heads (GQA when fewer),
    an MLP of width ``ffn`` (``gated``: SwiGLU's three matrices), and ``vocab`` logits.
    ``dropout`` says whether the layers keep dropout masks (Megatron's GPT does).

    Multi-head latent attention (DeepSeek-V2/V3, ``kv_lora_rank`` > 0) projects the
    block's input down to a latent of ``kv_lora_rank`` (keys and values) and of
    ``q_lora_rank`` (queries, when given), plus a shared rotary key of ``qk_rope_dim``, and up
    again per head: queries and keys of ``head_dim`` (rotary part included), values of
    ``v_head_dim``.

    A mixture of experts (``experts`` > 0) replaces the MLP of its blocks, all but the
    ``dense_blocks`` (indices; those keep the MLP of width ``ffn``), with a router over
    ``experts`` MLPs of width ``expert_ffn``, of which each token runs
    ``experts_per_token``, beside always-run shared experts of width ``shared_ffn`` in all."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    gated: bool = False
    tied: bool = False
    dropout: bool = False
    max_seq_len: int | None = None
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    dense_blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
            _check_count(self.name, key, getattr(self, key), least=1)
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{self.name}: {self.heads} attention heads do not group over "
                f"{self.kv_heads} key/value heads"
            )
        latent = ("q_lora_rank", "kv_lora_rank", "qk_rope_dim", "v_head_dim")
        for key in (*latent, "experts", "experts_per_token", "expert_ffn", "shared_ffn"):
            _check_count(self.name, key, getattr(self, key), least=0)
        if self.max_seq_len is not None:
            _check_count(self.name, "max_seq_len", self.max_seq_len, least=1)
        if self.experts and not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(
                f"{self.name}: each token must go to between 1 and its {self.experts} experts, "
                f"got experts_per_token={self.experts_per_token}"
            )
        if self.experts and self.expert_ffn < 1:
            raise ValueError(f"{self.name}: expert_ffn must be a positive integer for experts")
        if any(not 0 <= i < self.layers for i in self.dense_blocks):
            raise ValueError(
                f"{self.name}: dense_blocks must be block indices below {self.layers}, "
                f"got {self.dense_blocks}"
            )

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` (from 0) holds experts rather than a dense MLP."""
        return self.is_moe and index not in self.dense_blocks

    @property
    def moe_blocks(self) -> int:
        return self.layers - len(set(self.dense_blocks)) if self.is_moe else 0

    def tensor_split_widths(self) -> tuple[int, ...]:
        """The MLP widths a tensor-parallel group splits, each divisible by its size."""
        widths = [self.ffn] if self.moe_blocks < self.layers else []
        widths += [w for w in (self.expert_ffn, self.shared_ffn) if self.is_moe and w]
        return tuple(widths)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def latent(self) -> bool:
        """Whether attention is multi-head latent attention."""
        return self.kv_lora_rank > 0

    @property
    def v_width(self) -> int:
        """The attention core's output width: the heads' values side by side."""
        return self.heads * (self.v_head_dim or self.head_dim)

    def attention_products(self) -> list[tuple[int, int, str | None]]:
        """The attention's matrix products as (in width, out width, which of them a
        tensor-parallel group splits: ``"out"`` by heads, ``"in"``, or None): QKV and the
        output map; latent attention's down maps run whole on every GPU of T (they are
        narrow), its up maps and output map split by heads."""
        h = self.hidden
        if not self.latent:
            return [(h, self.q_width + 2 * self.kv_width, "out"), (self.q_width, h, "in")]
        nope = self.head_dim - self.qk_rope_dim
        if self.q_lora_rank:
            queries = [(h, self.q_lora_rank, None), (self.q_lora_rank, self.q_width, "out")]
        else:
            queries = [(h, self.q_width, "out")]
        keys_values = [
            (h, self.kv_lora_rank + self.qk_rope_dim, None),
            (self.kv_lora_rank, self.heads * nope + self.v_width, "out"),
        ]
        return [*queries, *keys_values, (self.v_width, h, "in")]

    def attention_kept_widths(self) -> tuple[int, int]:
        """Numbers a token keeps for the backward of attention: split over T (queries,
        keys, values and the core's output) and whole on every GPU (latent attention's
        latents)."""
        if not self.latent:
            return 2 * self.q_width + 2 * self.kv_width, 0
        split = 2 * self.q_width + 2 * self.v_width
        return split, self.q_lora_rank + self.kv_lora_rank + self.qk_rope_dim

    def mlp_params(self, width: int) -> int:
        """The matrices of one MLP of ``width`` (gated: three)."""
        return (3 if self.gated else 2) * self.hidden * width

    def layer_params(self, moe: bool = False) -> int:
        """One block's matrix parameters, a dense block's or (``moe``) one with experts: the
        router, every expert and the shared ones (norms and biases are left out: under 0.1 %)."""
        attention = sum(i * o for i, o, _ in self.attention_products())
        if not moe:
            return attention + self.mlp_params(self.ffn)
        experts = self.experts * self.mlp_params(self.expert_ffn)
        return attention + self.hidden * self.experts + experts + self.mlp_params(self.shared_ffn)

    def active_layer_params(self, moe: bool = False) -> int:
        """Of ``layer_params``, those one token runs through: of the experts, only
        ``experts_per_token``."""
        if not moe:
            return self.layer_params()
        idle = (self.experts - self.experts_per_token) * self.mlp_params(self.expert_ffn)
        return self.layer_params(moe=True) - idle

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def _embeddings(self) -> int:
        """The embedding and, untied, the output matrix."""
        return self.embedding_params() * (1 if self.tied else 2)

    def params(self) -> int:
        """Every parameter: the blocks, the embedding and (untied) the output matrix."""
        dense, moe = self.layers - self.moe_blocks, self.moe_blocks
        return dense * self.layer_params() + moe * self.layer_params(True) + self._embeddings()

    def active_params(self) -> int:
        """The parameters one token runs through (all of them in a dense model)."""
        dense, moe = self.layers - self.moe_blocks, self.moe_blocks
        active = dense * self.layer_params() + moe * self.active_layer_params(True)
        return active + self._embeddings()

    def layer_flops(self, seq_len: int, moe: bool = False) -> float:
        """One block's forward FLOPs per token: twice the matrix parameters it runs, and the
        two products of attention over ``seq_len`` keys (``Q K^T`` and the weighted values)."""
        return 2.0 * self.active_layer_params(moe) + self.attention_flops(seq_len)

    def blocks_flops(self, seq_len: int) -> float:
        """Every block's forward FLOPs per token, dense and with experts."""
        dense, moe = self.layers - self.moe_blocks, self.moe_blocks
        return dense * self.layer_flops(seq_len) + moe * self.layer_flops(seq_len, moe=True)

    def attention_flops(self, seq_len: int) -> float:
        """Of ``layer_flops``, the part that grows with the sequence."""
        return 2.0 * seq_len * (self.q_width + self.v_width)

    def logit_flops(self) -> float:
        """The logits' forward FLOPs per token."""
        return 2.0 * self.hidden * self.vocab


def gpt_shape(
    n_layer: int,
    d_model: int,
    n_head: int,
    vocab_size: int,
    d_ff: int | None = None,
    tied: bool = True,
) -> TransformerShape:
    """The built-in GPT (and Megatron-LM's): MLP 4x wide unless ``d_ff``, GELU, dropout."""
    if d_model % n_head:
        raise ValueError(f"--d-model {d_model} must be a multiple of --n-head {n_head}")
    return TransformerShape(
        name=f"gpt {n_layer}x{d_model}",
        layers=n_layer,
        hidden=d_model,
        heads=n_head,
        kv_heads=n_head,
        head_dim=d_model // n_head,
        ffn=d_ff or 4 * d_model,
        vocab=vocab_size,
        tied=tied,
        dropout=True,
    )


def _check_count(name: str, key: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a positive integer" if least else "a non-negative integer"
        raise ValueError(f"{name}: {key} must be {kind}, got {value!r}")


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
        _check_count("the config", key, value, least=1)
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
            _check_count("the config", count, config[count], least=0)
            _check_count("the config", "expert_ffn", width, least=1)
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
