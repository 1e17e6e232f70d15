"""``--tensor-parallel T`` and ``--tp-link`` of ``gpipe plan`` and ``gpipe simulate``: each
stage's layers split over T ranks as ``Pipeline(tensor_parallel=T)`` splits them, the world
K x D x T, and the link the T ranks' collectives cross (a ``--cluster`` catalogue device's
link within a node)."""

from __future__ import annotations

import argparse
from typing import Any

from torch import nn

from gpipe.cli.common import UsageError
from gpipe.planning.hardware import CATALOGUE, Device
from gpipe.planning.roofline import Link
from gpipe.planning.suggest import MAX_STAGES, LayerCosts

__all__ = [
    "DEFAULT_LINK",
    "add_link_argument",
    "check_heads",
    "link_of",
    "one_rank",
    "tensor_options",
    "with_collectives",
]

DEFAULT_LINK = "H100-SXM"  # NVLink within a node: where a stage's T ranks usually sit


def add_link_argument(p: Any) -> None:
    p.add_argument(
        "--tp-link",
        metavar="DEVICE",
        help="with --tensor-parallel: the device whose link within a node joins a stage's T "
        f"ranks, one of {', '.join(CATALOGUE)} (default {DEFAULT_LINK}: NVLink)",
    )


def link_of(args: argparse.Namespace, tensor_parallel: int) -> tuple[Device, Link]:
    """``--tp-link``'s device and the link of a group of ``tensor_parallel`` neighbours."""
    name = args.tp_link or DEFAULT_LINK
    device = CATALOGUE.get(name) or next(
        (d for n, d in CATALOGUE.items() if n.lower() == name.lower()), None
    )
    if device is None:
        known = ", ".join(CATALOGUE)
        raise UsageError(f"--tp-link: unknown device {name!r}; known devices: {known}")
    return device, Link.of_group(device, tensor_parallel)


def check_heads(tensor_parallel: int, n_head: int) -> None:
    """Refuse, in one line, a T that is not a positive divisor of the heads."""
    if tensor_parallel < 1:
        raise UsageError(f"--tensor-parallel must be a positive integer, got {tensor_parallel}")
    if n_head % tensor_parallel:
        raise UsageError(
            f"--tensor-parallel {tensor_parallel} must divide the {n_head} attention heads "
            f"(--n-head {n_head}): each rank holds whole heads"
        )


def one_rank(layers: nn.Sequential, tensor_parallel: int) -> nn.Sequential:
    """One rank's share of ``layers`` (the whole model), its refusal as one line."""
    # imported here: it loads PyTorch's DTensor styles, which other commands need not pay for
    from gpipe.planning.tensor_share import local_share

    try:
        return local_share(layers, tensor_parallel)
    except ValueError as exc:
        raise UsageError(f"--tensor-parallel {tensor_parallel}: {exc}") from None


def with_collectives(
    args: argparse.Namespace, costs: LayerCosts, whole: nn.Sequential, tensor_parallel: int
) -> LayerCosts:
    """``costs`` (one rank's compute) with the layers' collectives on ``--tp-link``, in their
    unit: counted FLOPs take a second as the device's sustained FLOPs."""
    if tensor_parallel == 1:
        return costs
    from gpipe.planning.tensor_share import collectives

    device, link = link_of(args, tensor_parallel)
    scale = 1.0 if costs.unit == "s" else device.peak_flops * device.gemm_efficiency
    found = collectives(whole, tensor_parallel)
    forward, backward = found.per_row(args.seq_len, link, tensor_parallel, scale)
    return LayerCosts(
        costs.fixed,
        costs.per_row,
        costs.unit,
        f"{costs.source}; collectives on {device.name}'s link",
        forward,
        backward,
    )


def tensor_options(args: argparse.Namespace) -> tuple[list[int], str]:
    """What ``--suggest`` tries for T: ``--tensor-parallel`` if given, else every divisor
    of the heads up to the link device's GPUs per node and ``--max-stages`` processes; and
    the bound, in words."""
    if args.tensor_parallel is not None:
        check_heads(args.tensor_parallel, args.n_head)
        return [args.tensor_parallel], "as given"
    device, _ = link_of(args, 1)
    top = min(device.gpus_per_node, args.max_stages or MAX_STAGES)
    ts = [t for t in range(1, top + 1) if args.n_head % t == 0]
    bound = f"divisors of the {args.n_head} heads up to {top}"
    return ts, f"{bound} ({device.name}: {device.gpus_per_node} GPUs a node)"
