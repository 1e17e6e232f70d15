"""ExpertsParallel on a stacked-experts module, in a world of one process: what it splits and
what it refuses. Its exactness over real tensor ranks is tests/splitting/test_hf_tensor_plan.py's
(Hugging Face's mixture-of-experts families); its checkpoints, tests/training/test_pieces.py's."""

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from gpipe.parallel.experts import ExpertsParallel

from ..small_models import Experts


@pytest.fixture
def mesh(one_process_group):
    return DeviceMesh("cpu", [0])


def test_the_maps_become_dtensors_and_the_module_computes_as_before(mesh):
    torch.manual_seed(0)
    module = Experts()
    x, index = torch.randn(5, 4), torch.randint(0, 3, (5, 2))
    weights = torch.rand(5, 2, requires_grad=True)
    want = module(x, index, weights)
    parallelize_module(module, mesh, ExpertsParallel(packed=["gate_up_proj"], rows=["down_proj"]))
    (packed,) = module.gate_up_proj.placements  # gate and up side by side: a strided shard
    assert packed.dim == 1 and packed.split_factor == 2 and packed != Shard(1)
    assert module.down_proj.placements == (Shard(2),)
    got = module(x, index, weights)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert isinstance(module.gate_up_proj.grad, DTensor) and weights.grad is not None
    assert isinstance(module.gate_up_proj, DTensor)  # the local shards were swapped back


def test_a_parameter_the_plan_does_not_place_is_refused(mesh):
    module = Experts(bias=True)
    with pytest.raises(ValueError, match=r"parameters \['down_proj_bias'\] have no place"):
        parallelize_module(
            module, mesh, ExpertsParallel(packed=["gate_up_proj"], rows=["down_proj"])
        )
