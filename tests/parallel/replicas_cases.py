"""What each process runs in tests/parallel/test_replicas.py: D = 2 replicas of a K = 2
pipeline, against one un-pipelined step on the union of the replicas' rows (float64)."""

from itertools import pairwise

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.functional import mse_loss

from gpipe import Pipeline
from gpipe.comm.process_group import init_process_group
from gpipe.parallel.replicas import shard

from ..distributed_cases import _error
from ..small_models import INTERLEAVED_MLP, batch, mlp

EXACT = {"rtol": 1e-12, "atol": 1e-14}
D = 2


class Gate(nn.Module):
    """Adds its linear map only to micro-batches of more than 2 rows: a branch that one
    replica's data takes and another's skips, as an expert no token chose."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + self.lin(x) if x.size(0) > 2 else x


def gated() -> nn.Sequential:
    """Stage 0 (of [2, 2]) holds a linear map and, after it, the gate: the gate's gradients
    are the first a backward reaches, so a replica that skips it has others ready first."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6), Gate(6), nn.Tanh(), nn.Linear(6, 4)]
    return nn.Sequential(*layers).double()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _mine(x: torch.Tensor, cut: list[int]) -> torch.Tensor:
    replica = dist.get_rank() % D
    return x[cut[replica] : cut[replica + 1]]


def _equal_to_reference(pipe: Pipeline, loss: torch.Tensor, ref: nn.Module, ref_loss) -> None:
    torch.testing.assert_close(loss, ref_loss.detach(), **EXACT)
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        want = grads[name].grad
        torch.testing.assert_close(_whole(p.grad), want, **EXACT)


def unused_parameters() -> dict:
    """Replica 0's 6 rows take the gate's branch, replica 1's 2 rows skip it: whole replicas
    (a bucket per parameter) and sharded ones sum its gradient as zeros, every other one
    exactly. Then what each call gives with replicas: ``microbatches=`` lists of different
    lengths, ``loss_reduction="sum"``, evaluate (the union's loss) and forward (its rows)."""
    init_process_group(torch.device("cpu"))
    x, y = batch(8)
    cut = [0, 6, 8]
    reference = gated()
    ref_loss = sum(mse_loss(reference(x[a:b]), y[a:b]) * (b - a) / len(x) for a, b in pairwise(cut))
    ref_loss.backward()
    found = {}
    for mode in (None, "full"):
        options = dict(loss_fn=mse_loss, data_parallel=D, timeout=20)
        bucket_bytes = 1 if mode is None else None
        pipe = Pipeline(gated(), [2, 2], shard=mode, bucket_bytes=bucket_bytes, **options)
        xs, ys = _mine(x, cut), _mine(y, cut)
        loss = pipe.step(xs if pipe.is_first else None, ys if pipe.is_last else None)
        _equal_to_reference(pipe, loss, reference, ref_loss)
        found[mode] = pipe.last_step.allreduce_buckets
    # each replica its own micro-batches (3 and 1), losses summed
    reference = mlp()
    x, y = batch(9)
    ref_loss = mse_loss(reference(x), y, reduction="sum")
    ref_loss.backward()
    pipe = Pipeline(
        mlp(),
        [4, 4],
        loss_fn=lambda o, t: mse_loss(o, t, reduction="sum"),
        loss_reduction="sum",
        data_parallel=D,
        timeout=20,
    )
    xs, ys = shard(x, dist.get_rank() % D, D), shard(y, dist.get_rank() % D, D)
    given = [(xs[i : i + 2], ys[i : i + 2]) for i in range(0, len(xs), 2)]
    _equal_to_reference(pipe, pipe.step(microbatches=given), reference, ref_loss)
    torch.testing.assert_close(pipe.evaluate(xs, ys), ref_loss.detach(), **EXACT)
    out = pipe(xs)
    if pipe.is_last:
        torch.testing.assert_close(out, reference(xs), **EXACT)  # its own rows only
    found["microbatches"] = len(given)
    return found


def too_small_a_share() -> dict:
    """Interleaved runs at least 2 micro-batches on 2 processes: replica 1's share of one row
    (or its one micro-batch) is refused, on every replica's first stage at once; the step
    after each refusal runs and is exact."""
    init_process_group(torch.device("cpu"))
    options = dict(chunks=4, schedule="interleaved", loss_fn=mse_loss, timeout=20)
    pipe = Pipeline(mlp(), INTERLEAVED_MLP, data_parallel=D, **options)
    x, y = batch(9)
    xs, ys = _mine(x, [0, 8, 9]), _mine(y, [0, 8, 9])
    mine = [(xs[:4], ys[:4]), (xs[4:], ys[4:])] if len(xs) > 1 else [(xs, ys)]
    reference = mlp()
    ref_loss = mse_loss(reference(x), y)
    ref_loss.backward()
    replica = dist.get_rank() % D
    errors = {}
    for key, refused in (
        ("rows", lambda: pipe.step(xs, ys)),
        ("microbatches", lambda: pipe.step(microbatches=mine)),
    ):
        errors[key] = _error(refused)
        pipe.zero_grad()
        loss = pipe.step(shard(x, replica, D), shard(y, replica, D))
        _equal_to_reference(pipe, loss, reference, ref_loss)
    return errors
