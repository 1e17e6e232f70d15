"""Cutting a sequence of layers into consecutive stages, and materializing a stage's layers."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from gpipe.errors import BalanceError

__all__ = [
    "as_sequential",
    "balance_counts",
    "check_balance",
    "even_balance",
    "layer_seed",
    "materialize",
    "split_sequential",
    "stage_bounds",
]


def as_sequential(layers: nn.Module | Iterable[nn.Module]) -> nn.Sequential:
    """An ``nn.Sequential`` of the layers, checked to share no module between two layers
    (a parameter they may share: ``gpipe.parallel.ties``)."""
    if isinstance(layers, nn.Sequential):
        module = layers
    elif isinstance(layers, nn.Module):
        raise TypeError(
            f"module must be nn.Sequential to be partitioned, got {type(layers).__name__}"
        )
    else:
        items = list(layers)
        bad = [type(m).__name__ for m in items if not isinstance(m, nn.Module)]
        if bad:
            raise TypeError(f"layers must all be nn.Module, got {bad}")
        module = nn.Sequential(*items)
    owner: dict[int, str] = {}
    # torch types these as modules, but register_module(name, None) leaves a None
    children: Mapping[str, nn.Module | None] = module._modules
    for name, child in children.items():
        if child is None:
            continue
        if id(child) in owner:
            raise ValueError(
                f"module with duplicate children is not supported: layer {name!r} is layer "
                f"{owner[id(child)]!r}"
            )
        for sub_name, sub in child.named_modules(prefix=name):
            if id(sub) in owner and sub_name != name:
                raise ValueError(
                    "module with duplicate parameters in distinct children is not supported: "
                    f"layer {name!r} shares module {sub_name!r} with layer {owner[id(sub)]!r} "
                    "(layers may share a parameter, not a module holding it)"
                )
        owner.update((id(sub), name) for sub in child.modules())
    return module


_SEE_BALANCE = (
    "gpipe.balance chooses one from measured costs, e.g. "
    "balance = gpipe.balance.balance_by_time(partitions, model, sample)"
)


def balance_counts(balance: object, *, allow_empty: bool = False) -> list[int]:
    """``balance`` as a list of positive ints, for any model: its sum is checked against the
    model's layers once they are known (``check_balance``)."""
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Iterable):
        raise BalanceError(f"balance must be a list of ints, got {balance!r}")
    items = list(balance)
    if not items and not allow_empty:
        raise BalanceError("balance must name at least one partition, got []")
    if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in items):
        raise BalanceError(f"all balance numbers must be positive integers (balance: {items})")
    return items


def check_balance(n_layers: int, balance: object) -> list[int]:
    """``balance`` (a list, tuple or other iterable of ints) as a list of positive ints
    summing to ``n_layers``, or a BalanceError that points to ``gpipe.balance``."""
    if balance is None:
        raise BalanceError(
            f"balance is required: the number of layers in each partition; {_SEE_BALANCE}"
        )
    items = balance_counts(balance, allow_empty=not n_layers)
    if sum(items) != n_layers:
        raise BalanceError(
            "module and sum of balance have different length "
            f"(module: {n_layers}, sum of balance: {sum(items)}); {_SEE_BALANCE}"
        )
    return items


def even_balance(n_layers: int, n_partitions: int) -> list[int]:
    """As even a split by layer count as possible, larger partitions first."""
    if not 1 <= n_partitions <= n_layers:
        raise BalanceError(f"cannot cut {n_layers} layers into {n_partitions} non-empty partitions")
    base, extra = divmod(n_layers, n_partitions)
    return [base + 1 if j < extra else base for j in range(n_partitions)]


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` layer indices of each partition."""
    bounds, start = [], 0
    for size in balance:
        bounds.append((start, start + size))
        start += size
    return bounds


def split_sequential(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Consecutive partitions that keep the layers' names (``"3"`` stays ``"3"``)."""
    named = list(module.named_children())
    return [nn.Sequential(OrderedDict(named[start:stop])) for start, stop in stage_bounds(balance)]


def layer_seed(seed: int, index: int) -> int:
    """The seed layer ``index`` is initialized from, the same whatever the number of stages."""
    return (seed * 1_000_003 + index * 7_919 + 12_345) % (2**63 - 1)


def _is_meta(layer: nn.Module) -> bool:
    return any(t.is_meta for t in layer.parameters()) or any(t.is_meta for t in layer.buffers())


def materialize(layer: nn.Module, index: int, device: torch.device, seed: int) -> nn.Module:
    """Put layer ``index`` on ``device``; a layer built on the meta device is allocated there
    and initialized by its modules' ``reset_parameters`` from ``layer_seed(seed, index)``."""
    if not _is_meta(layer):
        return layer.to(device)
    layer.to_empty(device=device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(layer_seed(seed, index))
        for sub in layer.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
    return layer
