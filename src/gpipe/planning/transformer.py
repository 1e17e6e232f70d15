"""A decoder-only transformer as a cluster plan sees it: its shapes, parameters and FLOPs.

Nothing is built: the shapes come from the built-in GPT's flags (``gpt_shape``) or from a
Hugging Face ``config.json`` (``planning/hf_config.py``).
FLOPs are counted as Megatron-LM counts them (Narayanan et al. 2021, arXiv:2104.04473,
appendix): the matrix products of each layer, attention over the whole ``s x s`` square (no
causal halving), and the logits, with a backward of twice the forward. A layer that attends
over a sliding window or in chunks (Mistral, Gemma 2/3, GPT-OSS, Llama 4 and the like) counts
its band of the causal triangle, scaled to the square as a full layer's is. In a mixture of
experts a token runs through the router, the shared experts and the ``experts_per_token``
experts it is routed to, so its FLOPs count those (the active parameters) while the memory
holds every expert.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TransformerShape", "check_count", "gpt_shape"]


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
    ``experts_per_token``, beside always-run shared experts of width ``shared_ffn`` in all.

    ``windows`` gives each block's attention window (None: the whole causal prefix; empty:
    every block's is): a query sees the ``w`` keys up to it, or (``chunked``, Llama 4) those
    of its own chunk of ``w``."""

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
    windows: tuple[int | None, ...] = ()
    chunked: bool = False

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
            check_count(self.name, key, getattr(self, key), least=1)
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{self.name}: {self.heads} attention heads do not group over "
                f"{self.kv_heads} key/value heads"
            )
        latent = ("q_lora_rank", "kv_lora_rank", "qk_rope_dim", "v_head_dim")
        for key in (*latent, "experts", "experts_per_token", "expert_ffn", "shared_ffn"):
            check_count(self.name, key, getattr(self, key), least=0)
        if self.max_seq_len is not None:
            check_count(self.name, "max_seq_len", self.max_seq_len, least=1)
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
        if self.windows and len(self.windows) != self.layers:
            raise ValueError(
                f"{self.name}: windows must give one window per block ({self.layers}), "
                f"got {len(self.windows)}"
            )
        for w in self.windows:
            if w is not None:
                check_count(self.name, "an attention window", w, least=1)

    def window(self, index: int) -> int | None:
        """Block ``index``'s attention window (None: it attends to the whole prefix)."""
        return self.windows[index] if self.windows else None

    def block_kinds(self) -> list[tuple[bool, int | None]]:
        """Each block's kind as its costs differ: whether it holds experts, and its window."""
        return [(self.is_moe_block(i), self.window(i)) for i in range(self.layers)]

    def causal_pairs(self, seq_len: int, window: int | None = None) -> float:
        """Query-key pairs of causal attention over ``seq_len`` tokens (``s^2 / 2``), or of
        a ``window``: sliding, ``s w - w^2 / 2``; chunked, ``w^2 / 2`` a whole chunk."""
        s = seq_len
        if window is None or window >= s:
            return s * s / 2
        if self.chunked:
            whole, rest = divmod(s, window)
            return (whole * window * window + rest * rest) / 2
        return s * window - window * window / 2

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

    def layer_flops(self, seq_len: int, moe: bool = False, window: int | None = None) -> float:
        """One block's forward FLOPs per token: twice the matrix parameters it runs, and the
        two products of attention over ``seq_len`` keys (``Q K^T`` and the weighted values)
        or its ``window``."""
        return 2.0 * self.active_layer_params(moe) + self.attention_flops(seq_len, window)

    def blocks_flops(self, seq_len: int) -> float:
        """Every block's forward FLOPs per token, dense and with experts, each attending
        over its window."""
        dense, moe = self.layers - self.moe_blocks, self.moe_blocks
        full = dense * self.layer_flops(seq_len) + moe * self.layer_flops(seq_len, moe=True)
        return full - self._windows_saved(seq_len)

    def blocks_attention_flops(self, seq_len: int) -> float:
        """Of ``blocks_flops``, the attention cores' (what selective recomputation redoes)."""
        return self.layers * self.attention_flops(seq_len) - self._windows_saved(seq_len)

    def attention_flops(self, seq_len: int, window: int | None = None) -> float:
        """Of ``layer_flops``, the part that grows with the sequence: Megatron's whole
        ``s x s`` square, and for a ``window`` below ``s`` its share of the causal triangle
        scaled to the square (``2 w - w^2 / s`` keys a query, sliding)."""
        if window is None or window >= seq_len:
            return 2.0 * seq_len * (self.q_width + self.v_width)
        keys = 2.0 * self.causal_pairs(seq_len, window) / seq_len
        return 2.0 * keys * (self.q_width + self.v_width)

    def _windows_saved(self, seq_len: int) -> float:
        """What the windowed blocks' attention counts less than full attention's, per token."""
        full = self.attention_flops(seq_len)
        return sum(full - self.attention_flops(seq_len, w) for w in self.windows if w)

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


def check_count(name: str, key: str, value: object, least: int) -> None:
    """Refuse, in one line naming ``key``, a count that is not an integer of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a positive integer" if least else "a non-negative integer"
        raise ValueError(f"{name}: {key} must be {kind}, got {value!r}")
