"""A tensor-parallel style for parameters kept whole on every tensor rank whose gradient each
rank computes from its own share of the activations, so that the ranks' gradients must be
summed: a norm applied per attention head between a column-split map and a row-split one
(Qwen3's ``q_norm`` and ``k_norm`` see only their rank's heads). Hugging Face's plans call it
``replicated_with_grad_allreduce``.

The forward needs nothing: the parameter is the same everywhere and the activation is already
the rank's own. Each backward's gradient is summed over the tensor ranks as autograd computes
it, before it is added to ``.grad``, so gradients accumulated over micro-batches are summed
once each, and the parameter stays an ordinary tensor, equal on every tensor rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["SummedGradients"]


class SummedGradients(ParallelStyle):
    """Keep the module's own parameters whole; sum each of their gradients over the tensor
    ranks of ``device_mesh``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                param.register_hook(_summed_over(group))
        return module


def _summed_over(group: dist.ProcessGroup) -> Callable[[Tensor], Tensor]:
    def summed(grad: Tensor) -> Tensor:
        total = grad.clone()
        dist.all_reduce(total, group=group)
        return total

    return summed
