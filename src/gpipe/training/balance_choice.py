"""How a training run splits the model's layers into stages (``--balance``), or has
``--schedule auto`` choose the cut with the schedule."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpipe.comm.process_group import init_process_group
from gpipe.pipeline_assembly import agreed_balance
from gpipe.planning.auto import AUTO
from gpipe.planning.balancing import balance_by_params
from gpipe.runtime.partitions import even_balance
from gpipe.training.options import TrainOptions

__all__ = ["BALANCE_MODES", "choose_balance", "held_choice", "parse_balance", "sample_tokens"]

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
    vocab_size: int,
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
    sample = sample_tokens(opts, vocab_size, seq_len, opts.chunks)
    first = dist.get_rank() == 0
    return agreed_balance(layers, parts, sample if first else None, device=device)


def sample_tokens(
    opts: TrainOptions, vocab_size: int, seq_len: int, chunks: int | None
) -> torch.Tensor:
    """Random tokens the size of one micro-batch of ``chunks`` (of a replica's whole share
    of the mini-batch if None), to time the layers on."""
    rows = math.ceil(opts.batch_size / opts.data_parallel / (chunks or 1))
    generator = torch.Generator().manual_seed(opts.seed)
    return torch.randint(0, vocab_size, (rows, seq_len), generator=generator)


def held_choice(opts: TrainOptions, saved: dict[str, Any]) -> TrainOptions:
    """Under ``--schedule auto``, a run resumed from a checkpoint keeps the schedule, the
    micro-batches and the stages per process it was trained with (its losses then go on as
    if never stopped); a run with nothing saved chooses afresh."""
    held = saved.get("train") or {}
    if opts.schedule != AUTO or held.get("schedule", AUTO) == AUTO:
        return opts
    return replace(
        opts,
        schedule=held["schedule"],
        chunks=held["chunks"],
        virtual_stages=held["virtual_stages"],
    )
