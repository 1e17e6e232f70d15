"""A small ResNet as a flat list of layers: each residual block is two layers joined by a
skip connection (``gpipe.skip``), so a pipeline may cut inside a block."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from gpipe.skip import Namespace, Skippable, pop, skippable, stash

__all__ = ["BlockIn", "BlockOut", "resnet"]


def conv_bn(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride, padding=1, bias=False), nn.BatchNorm2d(c_out)
    )


@skippable(stash=["shortcut"])
class BlockIn(nn.Module):
    """First half of a residual block: keeps the block's input for the shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(conv_bn(c_in, c_out, stride), nn.ReLU())

    def forward(self, x: Tensor) -> Generator[object, None, Tensor]:
        yield stash("shortcut", x)
        return self.body(x)


@skippable(pop=["shortcut"])
class BlockOut(nn.Module):
    """Second half: adds the shortcut back (through a 1x1 convolution when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.body = conv_bn(c_out, c_out)
        self.project = (
            nn.Identity()
            if c_in == c_out and stride == 1
            else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
        )

    def forward(self, x: Tensor) -> Generator[object, Tensor, Tensor]:
        shortcut = yield pop("shortcut")
        return torch.relu(self.body(x) + self.project(shortcut))


def resnet(
    widths: Sequence[int] = (32, 64, 64), in_channels: int = 1, classes: int = 10
) -> nn.Sequential:
    """Stem, one residual block per entry of ``widths`` (its output channels; a block that
    widens also halves the resolution), then pooling and a linear head: 2 + 2 x blocks
    layers."""
    layers: list[nn.Module] = [nn.Sequential(conv_bn(in_channels, widths[0]), nn.ReLU())]
    c_in = widths[0]
    for c_out in widths:
        stride = 1 if c_out == c_in else 2
        scope = Namespace()  # each block's shortcut is its own
        # @skippable made both Skippable; mypy keeps the type a class decorator is given
        block_in = cast(Skippable, BlockIn(c_in, c_out, stride))
        block_out = cast(Skippable, BlockOut(c_in, c_out, stride))
        layers += [block_in.isolate(scope), block_out.isolate(scope)]
        c_in = c_out
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)))
    return nn.Sequential(*layers)
