"""A decoder-only transformer as a cluster plan sees it: its shapes, parameters and FLOPs.

Nothing is built: the shapes come from the built-in GPT's flags or from a Hugging Face
``config.json`` (GPT-2, Llama, Mistral, Qwen and the like), read as JSON. FLOPs are counted
as Megatron-LM counts them (Narayanan et al. 2021, arXiv:2104.04473, appendix): the matrix
products of each layer, attention over the whole ``s x s`` square (no causal halving), and the
logits, with a backward of twice the forward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TransformerShape", "from_hf_config", "gpt_shape"]

# Families whose MLP is gated (SwiGLU/GeGLU: three matrices, gate and up side by side).
_GATED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "olmo", "olmo2"}
_GATED |= {"phi3", "cohere", "internlm2", "granite", "yi", "baichuan", "exaone"}
_GATED_ACTS = {"silu", "swish", "swiglu", "geglu"}


@dataclass(frozen=True)
class TransformerShape:
    """The shapes that decide a step's cost: ``layers`` blocks of width ``hidden`` with
    ``heads`` query heads of ``head_dim`` and ``kv_heads`` key/value heads (GQA when fewer),
    an MLP of width ``ffn`` (``gated``: SwiGLU's three matrices), and ``vocab`` logits.
    ``dropout`` says whether the layers keep dropout masks (Megatron's GPT does)."""

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

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {key} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{self.name}: {self.heads} attention heads do not group over "
                f"{self.kv_heads} key/value heads"
            )

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """One block's matrix parameters (norms and biases are left out: under 0.1 %)."""
        attention = self.hidden * (2 * self.q_width + 2 * self.kv_width)
        mlp = (3 if self.gated else 2) * self.hidden * self.ffn
        return attention + mlp

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def params(self) -> int:
        """Every parameter: the blocks, the embedding and (untied) the output matrix."""
        head = 0 if self.tied else self.embedding_params()
        return self.layers * self.layer_params() + self.embedding_params() + head

    def layer_flops(self, seq_len: int) -> float:
        """One block's forward FLOPs per token: twice its matrix parameters, and the two
        products of attention over ``seq_len`` keys (``Q K^T`` and the weighted values)."""
        return 2.0 * self.layer_params() + 4.0 * seq_len * self.q_width

    def attention_flops(self, seq_len: int) -> float:
        """Of ``layer_flops``, the part that grows with the sequence."""
        return 4.0 * seq_len * self.q_width

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


def _first(config: dict[str, Any], *keys: str) -> Any:
    return next((config[k] for k in keys if config.get(k) is not None), None)


def from_hf_config(path: str | Path) -> TransformerShape:
    """The shapes in a Hugging Face ``config.json`` (or a folder holding one). Dense decoders
    only: a mixture of experts is refused, in one line."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model hf:{path}: cannot read a config.json ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model hf:{path}: expected a JSON object")
    config = {**config, **(config.get("text_config") or {})}
    experts = _first(config, "num_local_experts", "num_experts", "n_routed_experts")
    if experts:
        raise ValueError(
            f"--model hf:{path}: a mixture of {experts} experts; the planner models dense "
            "decoders only"
        )
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head")
    vocab = _first(config, "vocab_size")
    missing = [
        n
        for n, v in (("layers", layers), ("width", hidden), ("heads", heads), ("vocab", vocab))
        if not isinstance(v, int)
    ]
    if missing:
        raise ValueError(f"--model hf:{path}: the config gives no {', '.join(missing)}")
    kind = str(config.get("model_type", "")).lower()
    act = str(_first(config, "hidden_act", "activation_function", "hidden_activation") or "")
    kv = _first(config, "num_key_value_heads", "n_head_kv", "num_kv_heads")
    if kv is None and config.get("multi_query"):
        kv = 1
    dropouts = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "dropout")
    return TransformerShape(
        name=str(config.get("_name_or_path") or kind or file.parent.name or "hf model"),
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv or heads,
        head_dim=_first(config, "head_dim") or hidden // heads,
        ffn=_first(config, "intermediate_size", "n_inner", "ffn_hidden_size") or 4 * hidden,
        vocab=vocab,
        gated=kind in _GATED or act.lower() in _GATED_ACTS,
        tied=bool(config.get("tie_word_embeddings", kind in ("gpt2", "bloom", "opt"))),
        dropout=any(float(config.get(k) or 0) > 0 for k in dropouts),
        max_seq_len=_first(config, "max_position_embeddings", "n_positions", "seq_length"),
    )
