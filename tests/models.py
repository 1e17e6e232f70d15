"""Small models shared by the tests: the same layers pipelined and un-pipelined."""

import torch
from torch import nn

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
