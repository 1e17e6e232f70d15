"""Small models shared by the tests: the same layers pipelined and un-pipelined."""

import torch
from torch import nn
from torch.nn import functional as F

from gpipe.skip import Namespace, pop, skippable, stash

N_IN, N_OUT = 6, 4


def mlp(dtype: torch.dtype = torch.float64, dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    """Eight layers of several kinds, so every balance cuts between different ones."""
    torch.manual_seed(seed)
    layers = [
        nn.Linear(N_IN, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Dropout(dropout),
        nn.GELU(),
        nn.Linear(16, 16),
        nn.LayerNorm(16),
        nn.Linear(16, N_OUT),
    ]
    return nn.Sequential(*layers).to(dtype)


BALANCES = {1: [8], 2: [4, 4], 3: [3, 3, 2], 4: [2, 2, 2, 2]}

# (rows, chunks): even splits, an uneven split, and fewer rows than chunks
SPLITS = [(16, 1), (16, 2), (16, 4), (16, 8), (10, 4), (3, 8)]


def batch(rows: int, dtype: torch.dtype = torch.float64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, N_IN, dtype=dtype, generator=g)
    y = torch.randn(rows, N_OUT, dtype=dtype, generator=g)
    return x, y


# --- a U-Net-like model whose skips span 1, 2 and 3 stage boundaries -------------------------

WIDTH = 6


@skippable(stash=["skip"])
class Encode(nn.Module):
    """Keeps its input for the matching Decode, then transforms it."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        yield stash("skip", x)
        return torch.tanh(self.linear(x))


@skippable(pop=["skip"])
class Decode(nn.Module):
    """Adds what the matching Encode kept to its transformed input."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        skip = yield pop("skip")
        return torch.tanh(self.linear(x)) + skip


@skippable(stash=["mask", "nothing"])
class StashMask(nn.Module):
    """Stashes a tensor that needs no gradient, and None."""

    def forward(self, x):
        yield stash("mask", (x.detach() > 0).to(x.dtype))
        yield stash("nothing", None)
        return x


@skippable(pop=["mask", "nothing"])
class ApplyMask(nn.Module):
    def forward(self, x):
        mask = yield pop("mask")
        nothing = yield pop("nothing")
        assert nothing is None
        return x * (1 + mask)


def unet(
    dtype: torch.dtype = torch.float64, seed: int = 0, dropout: float = 0.0, width: int = WIDTH
) -> nn.Sequential:
    """Nine layers; with UNET_BALANCES the skip 'a' crosses 3 boundaries at K = 4, 'b' and the
    mask 2, and 'c' 1."""
    torch.manual_seed(seed)
    a, b, c = Namespace(), Namespace(), Namespace()
    layers = [
        Encode(width).isolate(a),
        Encode(width).isolate(b),
        StashMask(),
        Encode(width).isolate(c),
        Decode(width).isolate(c),
        Decode(width).isolate(b),
        ApplyMask(),
        Decode(width).isolate(a),
        nn.Sequential(nn.Dropout(dropout), nn.Linear(width, N_OUT)),
    ]
    return nn.Sequential(*layers).to(dtype)


UNET_BALANCES = {1: [9], 2: [4, 5], 3: [3, 3, 3], 4: [2, 2, 2, 3]}
# two stages per rank, for the interleaved schedule
UNET_INTERLEAVED = {1: [4, 5], 2: [2, 2, 2, 3], 3: [2, 2, 1, 2, 1, 1], 4: [2, 1, 1, 1, 1, 1, 1, 1]}


def unet_batch(rows: int, dtype: torch.dtype = torch.float64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, WIDTH, dtype=dtype, generator=g)
    y = torch.randn(rows, N_OUT, dtype=dtype, generator=g)
    return x, y


INTERLEAVED_MLP = [2, 2, 2, 2]  # two stages per rank over mlp()'s eight layers, for K = 2


# --- one weight in the first and the last layer: a tied embedding and output projection ----

VOCAB, EMBED = 11, 6


class TiedHead(nn.Module):
    """Projects onto the vocabulary with the embedding's own weight (the same Parameter)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight = embedding.weight
        self.bias = nn.Parameter(torch.zeros(embedding.num_embeddings))

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


def tied(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    embedding = nn.Embedding(VOCAB, EMBED)
    layers = [embedding, nn.Linear(EMBED, EMBED), nn.Tanh(), TiedHead(embedding)]
    return nn.Sequential(*layers).to(dtype)


class Reused(nn.Module):
    """Applies another layer's weight again (the same Parameter), then tanh."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight

    def forward(self, x):
        return torch.tanh(nn.functional.linear(x, self.weight))


def two_ties(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    """Cut [1, 1, 2]: the embedding is shared by stages 0 and 2, a linear weight by stages 1
    and 2, so the last stage holds copies of two ties over different sets of ranks."""
    torch.manual_seed(seed)
    embedding, linear = nn.Embedding(VOCAB, EMBED), nn.Linear(EMBED, EMBED)
    layers = [embedding, linear, Reused(linear), TiedHead(embedding)]
    return nn.Sequential(*layers).to(dtype)


def bn_model() -> nn.Sequential:
    """Convolutions and BatchNorm (one with momentum=None) on (N, C, L), so that a one-row
    micro-batch still has statistics; float64."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(5, 6, 1),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Conv1d(6, 6, 1),
        nn.BatchNorm1d(6, momentum=None),
        nn.Conv1d(6, 2, 1),
    ).double()


def tokens(rows: int, length: int = 5, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    return ids, ids.roll(-1, 1)


def token_loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Experts(nn.Module):
    """Hugging Face's layout: (experts, 2 x width, hidden) and (experts, hidden, width)."""

    def __init__(self, experts: int = 3, hidden: int = 4, width: int = 6, bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, width))
        if bias:
            self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for k in range(index.shape[1]):
            for e in range(self.gate_up_proj.shape[0]):
                rows = index[:, k] == e
                gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down_proj[e])
                out[rows] += weights[rows, k, None] * y
        return out


def tiny_llama_config(**overrides):
    """The Llama of the Hugging Face cases: 4 blocks 32 wide, 4 attention heads over 2
    key-value heads, 64 tokens; ``overrides`` are the case's own settings."""
    from transformers import LlamaConfig

    shape = dict(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return LlamaConfig(**{**shape, **overrides})
