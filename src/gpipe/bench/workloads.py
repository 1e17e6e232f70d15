"""The models a benchmark runs: an MLP stack (wide, and narrow where fixed costs show), the
main job's GPT and a small ResNet, each with its data and the one cut into two stages (and
four, for interleaved schedules) every contender shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss
from gpipe.models.resnet import resnet

__all__ = ["WORKLOADS", "Workload", "get_workload"]


@dataclass(frozen=True)
class Workload:
    """A model, its mini-batch and its loss; ``build`` gives the same weights every call."""

    name: str
    description: str
    build: Callable[[], nn.Sequential]
    data: Callable[[], tuple[Tensor, Tensor]]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    batch: int
    tokens_per_sample: int  # 1 for the MLP; the sequence length for the GPT
    balance: tuple[int, ...]  # two stages, one per process
    interleaved_balance: tuple[int, ...]  # four stages, two per process
    config: dict[str, Any] = field(default_factory=dict)


def _halves(n: int) -> tuple[int, ...]:
    return (n - n // 2, n // 2)


def _quarters(n: int) -> tuple[int, ...]:
    base, extra = divmod(n, 4)
    sizes = [base] * 4
    for i in (0, 3, 1, 2)[:extra]:  # the ends first: they hold the embedding and the head
        sizes[i] += 1
    return tuple(sizes)


def mlp(width: int, hidden: int, blocks: int, batch: int, name: str = "mlp") -> Workload:
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            *(
                nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
                for _ in range(blocks)
            )
        )

    def data() -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1)
        return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)

    return Workload(
        name=name,
        description=f"{blocks} blocks of Linear({width}, {hidden}) -> GELU -> "
        f"Linear({hidden}, {width}), batch {batch}, MSE",
        build=build,
        data=data,
        loss_fn=F.mse_loss,
        batch=batch,
        tokens_per_sample=1,
        balance=_halves(blocks),
        interleaved_balance=_quarters(blocks),
        config={"width": width, "hidden": hidden, "blocks": blocks, "batch": batch},
    )


def gpt(n_layer: int, d_model: int, n_head: int, seq_len: int, batch: int) -> Workload:
    # Untied: a tied embedding and head on two stages need a gradient exchange that the
    # other pipeline libraries do not make.
    config = GPTConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, tied=False)

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return build_gpt(config)

    def data() -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    layers = n_layer + 2  # embedding, blocks, head
    return Workload(
        name="gpt",
        description=f"GPT, {n_layer} blocks, d_model {d_model}, {n_head} heads, "
        f"seq_len {seq_len}, batch {batch}, untied, no dropout, cross-entropy",
        build=build,
        data=data,
        loss_fn=lm_loss,
        batch=batch,
        tokens_per_sample=seq_len,
        balance=_halves(layers),
        interleaved_balance=_quarters(layers),
        config={**config.to_dict(), "batch": batch},
    )


def cnn(widths: tuple[int, ...], size: int, batch: int) -> Workload:
    """A ResNet (``gpipe.models.resnet``) on random images; BatchNorm as PyTorch has
    it, and every cut between blocks, so that every contender can run it."""
    blocks = len(widths)
    if blocks % 4:
        raise ValueError(
            f"the cnn workload cuts between blocks: give a multiple of 4, got {blocks}"
        )

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return resnet(widths, in_channels=3, classes=10)

    def data() -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1)
        return torch.randn(batch, 3, size, size, generator=g), torch.randint(
            10, (batch,), generator=g
        )

    half, quarter = blocks // 2, blocks // 4
    return Workload(
        name="cnn",
        description=f"ResNet, {blocks} residual blocks of widths {list(widths)}, "
        f"{size}x{size} images, batch {batch}, BatchNorm, cross-entropy",
        build=build,
        data=data,
        loss_fn=F.cross_entropy,
        batch=batch,
        tokens_per_sample=1,
        balance=(1 + 2 * half, 2 * half + 1),  # stem and half the blocks | the rest and head
        interleaved_balance=(1 + 2 * quarter, 2 * quarter, 2 * quarter, 2 * quarter + 1),
        config={"widths": list(widths), "size": size, "batch": batch},
    )


WORKLOADS: dict[str, dict[str, Callable[[], Workload]]] = {
    "mlp": {
        "full": lambda: mlp(width=512, hidden=2048, blocks=8, batch=512),
        "tiny": lambda: mlp(width=16, hidden=32, blocks=4, batch=16),
    },
    "gpt": {
        "full": lambda: gpt(n_layer=8, d_model=256, n_head=4, seq_len=256, batch=64),
        "tiny": lambda: gpt(n_layer=2, d_model=16, n_head=2, seq_len=8, batch=16),
    },
    "cnn": {
        "full": lambda: cnn((16, 32, 32, 64), size=32, batch=64),
        "tiny": lambda: cnn((4, 4, 8, 8), size=8, batch=16),
    },
    # where a pipeline's fixed cost per action shows: small layers, small messages
    "mlp64": {
        "full": lambda: mlp(width=64, hidden=256, blocks=8, batch=64, name="mlp64"),
        "tiny": lambda: mlp(width=8, hidden=16, blocks=4, batch=16, name="mlp64"),
    },
}


def get_workload(name: str, size: str = "full") -> Workload:
    try:
        return WORKLOADS[name][size]()
    except KeyError:
        raise ValueError(
            f"workload must be one of {', '.join(WORKLOADS)} and size one of 'full', 'tiny', "
            f"got {name!r}, {size!r}"
        ) from None
