"""The optimizer of a training run and its learning-rate schedule."""

from __future__ import annotations

import math

import torch

from gpipe.pipeline import Pipeline
from gpipe.runtime.dtensors import is_dtensor
from gpipe.training.options import TrainOptions

__all__ = ["build_optimizer", "learning_rate"]


def learning_rate(step: int, opts: TrainOptions) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at the last step."""
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    progress = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    return opts.min_lr + 0.5 * (opts.lr - opts.min_lr) * (1 + math.cos(math.pi * min(progress, 1)))


def build_optimizer(pipe: Pipeline, opts: TrainOptions) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases and norms). Split parameters
    (DTensors, under tensor parallelism) and whole ones go in groups of their own: the
    optimizer's foreach kernels take one kind or the other in a call, never both."""
    params = [p for p in pipe.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if _kind(p) == (matrix, split)], "weight_decay": decay}
        for matrix, decay in ((True, opts.weight_decay), (False, 0.0))
        for split in (False, True)
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=opts.lr, betas=(0.9, 0.95), foreach=True
    )


def _kind(param: torch.Tensor) -> tuple[bool, bool]:
    """Whether ``param`` is a matrix, and whether it is split over ranks (a DTensor)."""
    return param.dim() >= 2, is_dtensor(param)
