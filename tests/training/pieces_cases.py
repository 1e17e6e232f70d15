"""Cases of tests/training/test_pieces.py that run on real processes: a stacked-experts module
split over the tensor ranks, trained a step, saved by ``save_checkpoint`` and loaded back."""

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from gpipe.comm.process_group import init_process_group
from gpipe.parallel.experts import ExpertsParallel
from gpipe.training.checkpoints.format import load_checkpoint, save_checkpoint

from ..small_models import Experts

EXPERTS = {"experts": 3, "hidden": 4, "width": 6}


def trained(split: bool, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The module (split over this world's ranks, or whole) after one Adam step on the same
    tokens: Adam's moments are split as its parameters are."""
    torch.manual_seed(seed)
    model = nn.Sequential(Experts(**EXPERTS).double())
    if split:
        mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
        style = ExpertsParallel(packed=["gate_up_proj"], rows=["down_proj"])
        parallelize_module(model[0], mesh, style)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, EXPERTS["hidden"], generator=generator, dtype=torch.float64)
    index = torch.randint(0, EXPERTS["experts"], (8, 2), generator=generator)
    weights = torch.rand(8, 2, generator=generator, dtype=torch.float64)
    model[0](x, index, weights).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _whole(state: dict) -> dict[str, torch.Tensor]:
    return {
        key: value.full_tensor() if isinstance(value, DTensor) else value
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def saved_and_reloaded(root: str) -> dict:
    """Save the split module and its optimizer; load them into a split module of other
    values. Returns where it was saved, and whether what was loaded, gathered, equals what
    was saved, parameters and Adam's moments."""
    init_process_group(torch.device("cpu"))
    model, optimizer = trained(split=True)
    path = save_checkpoint(Path(root), 1, model, optimizer, {"step": 1}, {"what": "test"})
    other, other_optimizer = trained(split=True, seed=7)
    restored = load_checkpoint(path, other, other_optimizer, {"step": 0})
    same_weights = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )
    moments = [
        (_whole(optimizer.state[a]), _whole(other_optimizer.state[b]))
        for a, b in zip(model.parameters(), other.parameters(), strict=True)
    ]
    same_moments = all(
        saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
        for saved, loaded in moments
    )
    return {
        "path": str(path),
        "step": restored["step"],
        "weights": same_weights,
        "moments": same_moments,
    }
