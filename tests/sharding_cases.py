"""What each process runs in tests/test_sharding.py: Pipeline(shard="full") over real
processes, against one un-pipelined step on the union of the replicas' rows and against the
unsharded replicas."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.functional import mse_loss

from gpipe import Pipeline
from gpipe.pipeline import init_process_group
from gpipe.schedules import SCHEDULES, traits

from .distributed_cases import _reference
from .models import BALANCES, batch, mlp
from .two_per_rank_cases import BALANCE as TWO_PER_RANK

EXACT = {"rtol": 1e-12, "atol": 1e-14}
D = 2


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (gathered over the replicas), or the tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _setting(schedule: str, k: int) -> tuple[list[int], int]:
    """The balance and micro-batches of ``schedule`` on ``k`` processes per pipeline."""
    two = traits(schedule).several_stages_per_rank
    chunks = 2 * k if two else 4
    return (TWO_PER_RANK[k] if two else BALANCES[k]), chunks


def _mine(x: torch.Tensor, pipe: Pipeline, first: bool) -> torch.Tensor | None:
    from gpipe.parallel.replicas import shard

    assert pipe.replicas is not None
    part = shard(x, pipe.replicas.replica, pipe.replicas.data_parallel)
    return part if (pipe.is_first if first else pipe.is_last) else None


def _pipelines(schedule: str, mode: str, **more) -> tuple[Pipeline, Pipeline]:
    k = dist.get_world_size() // D
    balance, chunks = _setting(schedule, k)
    common = dict(chunks=chunks, checkpoint=mode, schedule=schedule, loss_fn=mse_loss,
                  data_parallel=D, timeout=20, **more)  # fmt: skip
    return Pipeline(mlp(), balance, shard="full", **common), Pipeline(mlp(), balance, **common)


def exactness(schedules=tuple(SCHEDULES), modes=("never", "always")) -> dict:
    """Every schedule, checkpoint never and always, D = 2 sharded "full": loss and every
    gathered gradient equal one un-pipelined step on the union of the replicas' rows; AdamW
    after three steps equals the unsharded replicas' weights (and the plain model's)."""
    init_process_group(torch.device("cpu"))
    cases, names = 0, None
    for schedule in schedules:
        for mode in modes:
            sharded, whole = _pipelines(schedule, mode)
            reference = mlp()
            models = (sharded, whole, reference)
            optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
            for step in range(3):
                x, y = batch(11, seed=step)
                for optimizer in optimizers:
                    optimizer.zero_grad()
                ref_loss = _reference(reference, x, y)
                loss = sharded.step(_mine(x, sharded, True), _mine(y, sharded, False))
                whole.step(_mine(x, whole, True), _mine(y, whole, False))
                torch.testing.assert_close(loss, ref_loss.double(), **EXACT)
                ref = dict(reference.named_parameters())
                for name, p in sharded.named_parameters():
                    assert isinstance(p.grad, DTensor), name
                    torch.testing.assert_close(full(p.grad), ref[name].grad, **EXACT)
                for optimizer in optimizers:
                    optimizer.step()
            held = dict(whole.named_parameters())
            for name, p in sharded.named_parameters():
                weight = full(p.detach())
                torch.testing.assert_close(weight, held[name].detach(), rtol=1e-12, atol=0)
                torch.testing.assert_close(weight, ref[name].detach(), **EXACT)
            names = [name for name, _ in sharded.named_parameters()]
            cases += 1
    return {"cases": cases, "names": names}
