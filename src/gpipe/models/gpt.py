"""A GPT-style decoder-only transformer as a flat list of layers a pipeline can cut anywhere.

The model is ``Embedding, Block x n_layer, Head``: each layer takes one tensor and returns
one, so the pipeline can pass a single activation between any two of them. Packed
documents (``gpipe.data.pack``) come as a dict of ``input_ids`` and ``position_ids`` that
restart with every document: then the layers pass ``(hidden, documents)`` on, each token's
document in its row, and attention stays within a document. Every layer
initializes all of its parameters in ``reset_parameters``, because the pipeline builds
layers on the meta device and materializes each one separately, in its own process.

Tied embedding and head: the first and last layer usually live in different processes, so
they cannot share one Parameter. Instead each holds a copy that starts equal (both draw it
from a generator seeded by ``init_seed``, whatever the global RNG) and whose gradients are
summed before every optimizer step by ``gpipe.parallel.ties``, the pipeline's one mechanism
for tied weights: ``sync_tied_grads_`` in one process, and across stages ``TiedGradients``
over the ties that ``tied_weights`` declares (``declared_ties``), so the copies stay equal as
one weight would.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe.parallel.ties import sum_local
from gpipe.runtime.kv_cache import CacheContext, KVCache
from gpipe.runtime.sub_sequence_attention import sub_sequence_attention

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "GPTConfig",
    "PRESETS",
    "config_from_preset",
    "Embedding",
    "documents_of",
    "Block",
    "Head",
    "build_gpt",
    "tied_weights",
    "tie_",
    "sync_tied_grads_",
    "count_parameters",
    "lm_loss",
    "generate",
]

_STD = 0.02  # GPT-2's initialization scale


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape; ``d_ff=None`` means ``4 * d_model`` (see ``ff_dim``)."""

    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    d_ff: int | None = None
    vocab_size: int = 256
    seq_len: int = 128
    dropout: float = 0.0
    tied: bool = True
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len"):
            _check_positive(name, getattr(self, name))
        if self.d_ff is not None:
            _check_positive("d_ff", self.d_ff)
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model must be divisible by n_head, "
                f"got d_model={self.d_model}, n_head={self.n_head}"
            )
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
            raise ValueError(f"GPTConfig.dropout must be a number in [0, 1), got {dropout!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {dropout}")
        for name in ("tied", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def ff_dim(self) -> int:
        """Width of the MLP's hidden layer."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for a checkpoint's description."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """The inverse of ``to_dict``; unknown keys are refused rather than silently dropped."""
        _check_names(values)
        return cls(**values)


def _check_names(values: dict[str, Any]) -> None:
    known = [f.name for f in fields(GPTConfig)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"GPTConfig has no fields {unknown}; expected some of {known}")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=32),
    "small": GPTConfig(n_layer=4, d_model=128, n_head=4, seq_len=128),
    "gpt2-small": GPTConfig(n_layer=12, d_model=768, n_head=12, seq_len=1024),
    "gpt2-medium": GPTConfig(n_layer=24, d_model=1024, n_head=16, seq_len=1024),
    "1b": GPTConfig(n_layer=20, d_model=2048, n_head=16, seq_len=1024),
}


def config_from_preset(name: str, **overrides: Any) -> GPTConfig:
    """The preset ``name`` with some fields changed (validated like any config)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    _check_names(overrides)
    return replace(PRESETS[name], **overrides)


class _Linear(nn.Linear):
    """A linear map initialized by the layer that holds it, with its own standard deviation.

    Materialization calls ``reset_parameters`` on every module, parents first; this one's
    does nothing so that PyTorch's default init cannot overwrite the layer's.
    """

    def __init__(self, d_in: int, d_out: int, *, bias: bool, std: float) -> None:
        super().__init__(d_in, d_out, bias=bias)
        self.std = std

    def reset_parameters(self) -> None:
        """Left to the holding layer (see the class docstring)."""

    def init_(self) -> None:
        _normal_(self.weight, self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class _TokenEmbedding(nn.Embedding):
    """Token vectors initialized by the ``Embedding`` layer, for the reason ``_Linear`` gives."""

    def reset_parameters(self) -> None:
        """Left to the holding layer."""


def _normal_(tensor: Tensor, std: float) -> None:
    """Draw ``tensor`` from N(0, std^2), unless it is on the meta device: it holds no values
    there, and drawing them would import PyTorch's compiler (1.5 s in every process)."""
    if not tensor.is_meta:
        nn.init.normal_(tensor, 0.0, std)


def _init_(layer: nn.Module) -> None:
    """GPT-2 initialization of every linear map and LayerNorm inside ``layer``."""
    with torch.no_grad():
        for module in layer.modules():
            if isinstance(module, _Linear):
                module.init_()
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()


def _init_tied_(weight: Tensor, seed: int) -> None:
    """Draw the tied weight on the CPU from its own generator: the same values on every
    device and in every process, whatever the global RNG."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    values = torch.randn(weight.shape, generator=generator, device="cpu") * _STD
    with torch.no_grad():
        weight.copy_(values)


class Embedding(nn.Module):
    """Token plus learned position embeddings: int64 ``[B, T]`` to ``[B, T, d_model]``."""

    # tensor parallelism (``gpipe.parallel.tensor``): the vocabulary split over the ranks
    tp_plan: ClassVar[dict[str, str]] = {"token": "rowwise"}

    def __init__(self, config: GPTConfig, *, init_seed: int = 0) -> None:
        super().__init__()
        self.seq_len = config.seq_len
        self.init_seed = init_seed
        self.token = _TokenEmbedding(config.vocab_size, config.d_model)
        self.position = nn.Parameter(torch.empty(config.seq_len, config.d_model))
        self.dropout = nn.Dropout(config.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_tied_(self.token.weight, self.init_seed)
        with torch.no_grad():
            _normal_(self.position, _STD)

    def forward(self, tokens: Tensor | Mapping[str, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        ids = tokens["input_ids"] if isinstance(tokens, Mapping) else tokens
        length = ids.shape[-1]
        if length > self.seq_len:
            raise ValueError(
                f"Embedding: input has {length} tokens (shape {list(ids.shape)}), "
                f"more than the model's seq_len {self.seq_len}"
            )
        if not isinstance(tokens, Mapping):
            return self.dropout(self.token(ids) + self.position[:length])
        positions = tokens["position_ids"]
        x = self.dropout(self.token(ids) + self.position[positions])
        return x, documents_of(positions)

    def new_cache(self) -> None:
        """Generation: an embedding keeps nothing between tokens."""
        return None

    def forward_cached(self, ids: Tensor, cache: None, context: CacheContext) -> Tensor:
        """New tokens at their positions in their sequences (``gpipe.runtime.kv_cache``)."""
        return self.dropout(self.token(ids) + self.position[context.positions])

    def generation_limits(self) -> tuple[int, int]:
        """The vocabulary and the context a generated sequence must fit."""
        return self.token.num_embeddings, self.seq_len


def documents_of(positions: Tensor) -> Tensor:
    """Each token's document within its row, numbered from 1: a document begins wherever
    the position restarts at 0 (so does each token of padding, alone)."""
    return (positions == 0).cumsum(dim=-1, dtype=torch.int32)


class _Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, residual_std = config.d_model, _STD / math.sqrt(2 * config.n_layer)
        self.head_dim, self.p = d // config.n_head, config.dropout
        # one map per projection, so that tensor parallelism splits each by whole heads
        self.q = _Linear(d, d, bias=config.bias, std=_STD)
        self.k = _Linear(d, d, bias=config.bias, std=_STD)
        self.v = _Linear(d, d, bias=config.bias, std=_STD)
        self.proj = _Linear(d, d, bias=config.bias, std=residual_std)
        self.dropout = nn.Dropout(config.dropout)

    def _heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values ``[B, heads, T, head_dim]`` of the heads this rank holds
        (all of them, unless tensor parallelism split the projections)."""
        b, t, _ = x.shape
        q, k, v = (
            projection(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for projection in (self.q, self.k, self.v)
        )
        return q, k, v

    def _out(self, y: Tensor) -> Tensor:
        b, _, t, _ = y.shape
        return self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, -1)))

    def forward(self, x: Tensor, documents: Tensor | None = None) -> Tensor:
        t = x.shape[1]
        q, k, v = self._heads(x)
        p = self.p if self.training else 0.0
        if documents is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:  # earlier tokens of the same document only
            same = documents[:, None, :, None] == documents[:, None, None, :]
            mask = same & torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self._out(y)

    def forward_cached(self, x: Tensor, cache: KVCache, context: CacheContext) -> Tensor:
        """The new tokens against the cached keys and values, which get theirs."""
        q, k, v = self._heads(x)
        p = self.p if self.training else 0.0
        return self._out(_attend_cached_outside_graphs(q, k, v, cache, context, p))


def _attend_cached(
    q: Tensor, k: Tensor, v: Tensor, cache: KVCache, context: CacheContext, dropout_p: float
) -> Tensor:
    """The new tokens' attention, their keys and values added to ``cache``."""
    if not context.every_token:  # generation: rows left-padded to one length
        k, v = cache.append(k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=context.attention_mask)
    # a sub-sequence in training: its keys and values laid out once, kept by its own
    # attention and by every later sub-sequence's
    k, v = k.contiguous(), v.contiguous()
    keys_before, values_before = cache.add_sub_sequence(k, v)
    return sub_sequence_attention(
        q, k, v, keys_before, values_before, dropout_p=dropout_p, mask=context.causal_bias
    )


def _attend_cached_outside_graphs(
    q: Tensor, k: Tensor, v: Tensor, cache: KVCache, context: CacheContext, dropout_p: float
) -> Tensor:
    """``_attend_cached`` outside torch.compile's graphs (compiled layers:
    gpipe.runtime.compiled): the cache's Python state, its list of sub-sequences and its
    length, would make it compile the layer again for every sub-sequence and every generated
    token. The wrapper is made only while compiling: making it imports torch's compiler,
    half a second that an eager process need not pay."""
    if torch.compiler.is_compiling():
        outside: Callable[..., Tensor] = torch.compiler.disable(_attend_cached)
        return outside(q, k, v, cache, context, dropout_p)
    return _attend_cached(q, k, v, cache, context, dropout_p)


class _MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        residual_std = _STD / math.sqrt(2 * config.n_layer)
        self.fc = _Linear(config.d_model, config.ff_dim, bias=config.bias, std=_STD)
        self.act = nn.GELU()
        self.proj = _Linear(config.ff_dim, config.d_model, bias=config.bias, std=residual_std)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = _Attention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = _MLP(config)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_(self)

    @property
    def tp_plan(self) -> dict[str, str | ParallelStyle]:
        """Tensor parallelism as Megatron-LM splits a block: the heads and the MLP's hidden
        layer over the ranks, one all-reduce after attention and one after the MLP. The
        attention takes its input as one replicated DTensor that q, k and v share, so that
        the backward sums their input gradients before one all-reduce rather than three."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import PrepareModuleInput

        return {
            "attn": PrepareModuleInput(
                input_layouts=(Replicate(), None),
                desired_input_layouts=(Replicate(), None),
                use_local_output=False,
            ),
            "attn.q": "colwise",
            "attn.k": "colwise",
            "attn.v": "colwise",
            "attn.proj": "rowwise",
            "mlp.fc": "colwise",
            "mlp.proj": "rowwise",
        }

    def forward(self, x: Tensor | tuple[Tensor, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        if isinstance(x, tuple):  # packed documents
            h, documents = x
            h = h + self.attn(self.ln1(h), documents)
            return h + self.mlp(self.ln2(h)), documents
        x = x + self.attn(self.ln1(x), None)
        return x + self.mlp(self.ln2(x))

    def new_cache(self) -> KVCache:
        """Generation: this block's keys and values for one group of sequences."""
        return KVCache()

    def forward_cached(self, x: Tensor, cache: KVCache, context: CacheContext) -> Tensor:
        x = x + self.attn.forward_cached(self.ln1(x), cache, context)
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the map to logits: ``[B, T, d_model]`` to ``[B, T, vocab_size]``.

    When ``tied``, ``proj.weight`` starts equal to the embedding's token weight built with
    the same ``init_seed``; it is a separate Parameter (see the module docstring).
    """

    def __init__(self, config: GPTConfig, *, init_seed: int = 0) -> None:
        super().__init__()
        self.tied, self.init_seed = config.tied, init_seed
        self.ln = nn.LayerNorm(config.d_model, bias=config.bias)
        self.proj = _Linear(config.d_model, config.vocab_size, bias=False, std=_STD)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_(self)
        if self.tied:
            _init_tied_(self.proj.weight, self.init_seed)

    @property
    def tp_plan(self) -> dict[str, ParallelStyle]:
        """Tensor parallelism: the vocabulary split over the ranks, the logits gathered."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel

        return {"proj": ColwiseParallel(output_layouts=Replicate())}

    def forward(self, x: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        if isinstance(x, tuple):  # packed documents: their logits alike
            x = x[0]
        return self.proj(self.ln(x))

    def new_cache(self) -> None:
        return None

    def forward_cached(self, x: Tensor, cache: None, context: CacheContext) -> Tensor:
        """Generation samples from the last new token alone: only its logits are computed
        (every token's for a sub-sequence in training)."""
        return self(x) if context.every_token else self(x[:, -1:])


def build_gpt(
    config: GPTConfig, device: torch.device | str | None = None, *, init_seed: int = 0
) -> nn.Sequential:
    """``[Embedding, Block x n_layer, Head]``; on ``device="meta"`` it takes no memory.

    ``init_seed`` seeds the tied embedding/head weight; every other parameter draws from
    the global RNG.
    """
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return nn.Sequential(
            Embedding(config, init_seed=init_seed),
            *(Block(config) for _ in range(config.n_layer)),
            Head(config, init_seed=init_seed),
        )


def tied_weights(layers: Iterable[nn.Module]) -> list[tuple[int, str, int, str]]:
    """``(embedding index, name, head index, name)`` of each tied pair among ``layers``."""
    layers = list(layers)
    embeddings = [i for i, layer in enumerate(layers) if isinstance(layer, Embedding)]
    heads = [i for i, layer in enumerate(layers) if isinstance(layer, Head) and layer.tied]
    if not embeddings or not heads:
        return []
    return [(embeddings[0], "token.weight", heads[-1], "proj.weight")]


def tie_(embedding: Embedding, head: Head) -> None:
    """Copy the embedding's token weight into the head, e.g. after loading only the first."""
    with torch.no_grad():
        head.proj.weight.copy_(embedding.token.weight)


def sync_tied_grads_(embedding: Embedding, head: Head) -> None:
    """Set both copies' gradients to their sum, as one shared weight would receive (a copy
    without a gradient gets the other's); call after backward and before the optimizer step
    (single process)."""
    sum_local([[embedding.token.weight, head.proj.weight]])


def count_parameters(config: GPTConfig, *, tied_once: bool = True) -> int:
    """Parameters of the model, counted on the meta device; a tied pair once if ``tied_once``."""
    model = build_gpt(config, device="meta")
    total = sum(p.numel() for p in model.parameters())
    if config.tied and tied_once:
        total -= cast(Head, model[-1]).proj.weight.numel()
    return total


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over every token: ``[B, T, V]`` logits, ``[B, T]`` targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def generate(
    model: Callable[[Tensor], Tensor],
    prompt: Tensor,
    max_new_tokens: int,
    seq_len: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``prompt`` ``[1, T]`` followed by ``max_new_tokens`` sampled tokens.

    ``model`` is anything mapping tokens to logits (a model, a pipeline); it sees at most
    the last ``seq_len`` tokens. Sampling happens on the CPU so that a CPU ``generator``
    gives the same text whatever device the model runs on.
    """
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must have shape [1, T] with T >= 1, got {list(prompt.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be a positive integer or None, got {top_k}")
    tokens = prompt
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -seq_len:])[:, -1, :].float().cpu() / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, token.to(tokens.device)], dim=1)
    return tokens
