"""A tensor-parallel style for a mixture of experts' MLPs stored as stacked tensors (Hugging
Face's ``Experts`` modules since transformers 5: ``gate_up_proj`` of shape (experts, 2 x
width, hidden), ``down_proj`` of (experts, hidden, width)): every expert split over the tensor
ranks as a dense MLP is, each rank running its share of every expert's width on all of the
tokens routed to it. Hugging Face's plans call the pieces ``packed_colwise`` (the gate and up
maps side by side, each split), ``rowwise`` (the down map's input features) and
``moe_tp_experts`` (the module: its partial outputs summed over the ranks).

The parameters become DTensors: a packed map's placement is ``_StridedShard``, so that each
rank holds the same slice of the gate and of the up map side by side while ``full_tensor()``
gives back the stored layout. The module's own forward runs on the ranks' local shards
(swapped in for the call; their gradients flow back to the DTensors). Its inputs, the tokens
and the routing weights, are whole on every rank, and each rank's partial output depends on
them: their gradients are summed over the ranks in the backward; the outputs are summed in
the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["ExpertsParallel"]


class ExpertsParallel(ParallelStyle):
    """Split a stacked-experts module's ``packed`` maps (gate and up side by side, split
    along their output features), ``columns`` maps (split along their output features) and
    ``rows`` maps (split along their input features) over the tensor ranks."""

    def __init__(
        self, packed: Sequence[str] = (), columns: Sequence[str] = (), rows: Sequence[str] = ()
    ) -> None:
        super().__init__()
        self.packed, self.columns, self.rows = tuple(packed), tuple(columns), tuple(rows)

    def _placements(self, name: str, param: Tensor) -> list[Placement]:
        # a stacked map is (experts, out, in), its bias (experts, out)
        out = param.dim() - (2 if param.dim() == 3 else 1)
        if name in self.packed:
            return [_StridedShard(out, split_factor=2)]
        if name in self.columns:
            return [Shard(out)]
        return [Shard(param.dim() - 1)]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        size = device_mesh.size()
        named = dict(module.named_parameters(recurse=False))
        split = (*self.packed, *self.columns, *self.rows)
        whole = sorted(set(named) - set(split))
        if whole:
            raise ValueError(
                f"{type(module).__name__}'s parameters {whole} have no place in its tensor plan: "
                "each rank would add them to its partial output; pass Pipeline(tp_plan=...) "
                "instead"
            )
        for name in split:
            param = named[name]
            placements = self._placements(name, param)
            dim = placements[0].dim  # type: ignore[attr-defined]
            features = param.shape[dim] // (2 if name in self.packed else 1)
            if features % size:
                raise ValueError(
                    f"tensor_parallel={size} does not divide the {features} features of "
                    f"{type(module).__name__}.{name} {tuple(param.shape)}"
                )
            shard = distribute_tensor(param.detach(), device_mesh, placements)
            module._parameters[name] = nn.Parameter(shard, requires_grad=param.requires_grad)
        group = device_mesh.get_group()
        module.register_forward_pre_hook(_local_call(split, group), with_kwargs=True)
        module.register_forward_hook(_summed_output(group), always_call=True)
        return module


def _local_call(names: Sequence[str], group: dist.ProcessGroup) -> Any:
    """Swap the split parameters for their local shards for the call; route the inputs'
    gradients through a sum over the ranks."""

    def pre_hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        split = {n: module._parameters[n] for n in names}
        module.__dict__["_gpipe_split_parameters"] = split
        for name, param in split.items():
            module._parameters[name] = param.to_local()  # type: ignore[union-attr]
        args = tuple(_summed_backward(a, group) for a in args)
        kwargs = {k: _summed_backward(v, group) for k, v in kwargs.items()}
        return args, kwargs

    return pre_hook


def _summed_output(group: dist.ProcessGroup) -> Any:
    """Put the split parameters back; sum the partial outputs over the ranks."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        module._parameters.update(module.__dict__.pop("_gpipe_split_parameters", {}))
        if isinstance(output, Tensor):
            return _SummedForward.apply(output, group)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return output

    return hook


def _summed_backward(value: Any, group: dist.ProcessGroup) -> Any:
    """``value``, a floating-point tensor's gradient summed over ``group`` (others as they
    are: routing indices)."""
    if not isinstance(value, Tensor) or isinstance(value, DTensor):
        return value
    if not value.is_floating_point():
        return value
    return _SummedBackward.apply(value, group)  # type: ignore[no-untyped-call]  # torch leaves it unannotated


class _SummedBackward(torch.autograd.Function):
    """The identity whose gradient is summed over the ranks of ``group``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class _SummedForward(torch.autograd.Function):
    """The sum of ``x`` over the ranks of ``group``; its gradient passes through as it is."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None
