"""How a training run splits the model's layers into stages (``--balance``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpipe.pipeline import agreed_balance, init_process_group
from gpipe.planning.balancing import balance_by_params
from gpipe.runtime.partitions import even_balance
from gpipe.training.models.gpt import GPTConfig
from gpipe.training.options import TrainOptions

__all__ = ["BALANCE_MODES", "choose_balance", "parse_balance"]

BALANCE_MODES = ("time", "params", "even")


def parse_balance(value: str, parts: int, n_layers: int) -> list[int] | None:
    """Layers per stage from ``--balance``: a list for explicit counts, None for a mode."""
    if value in BALANCE_MODES:
        return None
    try:
        counts = [int(v) for v in value.split(",")]
    except ValueError:
        counts = []
    if len(counts) != parts or sum(counts) != n_layers or min(counts, default=0) < 1:
        raise ValueError(
            f"--balance must be time, params, even, or {parts} positive layer counts that add "
            f"up to the model's {n_layers} layers (such as "
            f"{','.join(map(str, even_balance(n_layers, parts)))}), got {value!r}"
        )
    return counts


def choose_balance(
    opts: TrainOptions,
    layers: nn.Sequential,
    config: GPTConfig,
    seq_len: int,
    device: torch.device,
    saved: Any,
) -> list[int]:
    """Layers per stage, the same on every rank. By time, the first rank profiles a
    micro-batch of random tokens; a resumed run keeps the balance it was measured with."""
    parts = opts.parts
    explicit = parse_balance(opts.balance, parts, len(layers))
    if explicit is not None:
        return explicit
    if parts == 1:
        return [len(layers)]
    if opts.balance == "even":
        return even_balance(len(layers), parts)
    if opts.balance == "params":
        return balance_by_params(parts, layers)
    if saved is not None and len(saved) == parts:
        return list(saved)
    init_process_group(device, opts.timeout)
    rows = math.ceil(opts.batch_size / opts.data_parallel / opts.chunks)
    generator = torch.Generator().manual_seed(opts.seed)
    sample = torch.randint(0, config.vocab_size, (rows, seq_len), generator=generator)
    first = dist.get_rank() == 0
    return agreed_balance(layers, parts, sample if first else None, device=device)
