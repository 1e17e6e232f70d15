"""ExpertsParallel on a stacked-experts module, in a world of one process: what it splits,
what it refuses, and what a checkpoint cannot hold. Its exactness over real tensor ranks is
tests/splitting/test_hf_tensor_plan.py's (Hugging Face's mixture-of-experts families)."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn import functional as F

from gpipe.parallel.experts import ExpertsParallel, split_packed
from gpipe.training.checkpoints.format import check_checkpointable


class Experts(nn.Module):
    """Hugging Face's layout: (experts, 2 x width, hidden) and (experts, hidden, width)."""

    def __init__(self, experts: int = 3, hidden: int = 4, width: int = 6, bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, width))
        if bias:
            self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for k in range(index.shape[1]):
            for e in range(self.gate_up_proj.shape[0]):
                rows = index[:, k] == e
                gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down_proj[e])
                out[rows] += weights[rows, k, None] * y
        return out


@pytest.fixture
def mesh(one_process_group):
    return DeviceMesh("cpu", [0])


def test_the_maps_become_dtensors_and_the_module_computes_as_before(mesh):
    torch.manual_seed(0)
    module = Experts()
    x, index = torch.randn(5, 4), torch.randint(0, 3, (5, 2))
    weights = torch.rand(5, 2, requires_grad=True)
    want = module(x, index, weights)
    ExpertsParallel(packed=["gate_up_proj"], rows=["down_proj"])._apply(module, mesh)
    assert isinstance(module.gate_up_proj, DTensor) and split_packed(module.gate_up_proj)
    assert module.down_proj.placements == (Shard(2),) and not split_packed(module.down_proj)
    got = module(x, index, weights)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert isinstance(module.gate_up_proj.grad, DTensor) and weights.grad is not None
    assert isinstance(module.gate_up_proj, DTensor)  # the local shards were swapped back


def test_a_parameter_the_plan_does_not_place_is_refused(mesh):
    module = Experts(bias=True)
    with pytest.raises(ValueError, match=r"parameters \['down_proj_bias'\] have no place"):
        ExpertsParallel(packed=["gate_up_proj"], rows=["down_proj"])._apply(module, mesh)


def test_a_checkpoint_refuses_packed_maps_in_one_line(mesh):
    model = nn.Sequential(Experts())
    check_checkpointable(model)  # nothing split: nothing refused
    ExpertsParallel(packed=["gate_up_proj"], rows=["down_proj"])._apply(model[0], mesh)
    with pytest.raises(ValueError, match="splits 0.gate_up_proj as packed gate-and-up") as caught:
        check_checkpointable(model)
    assert "\n" not in str(caught.value)
