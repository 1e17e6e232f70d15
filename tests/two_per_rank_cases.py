"""What each process runs for the schedules that place two stages on every process (the V
schedules and the looped ones), in tests/engine/test_distributed_schedules.py."""

import copy

import torch
import torch.distributed as dist
from torch.nn.functional import mse_loss

from gpipe import Pipeline
from gpipe.errors import StageError
from gpipe.runtime.recompute import Layers

from .distributed_cases import MODES, _check_step, _replicated_step_is_exact, tied_weights
from .schedule_cases import EXACT, _check_unet_step
from .small_models import UNET_INTERLEAVED, batch, mlp, unet, unet_batch

TWO_PER_RANK = ["zero-bubble-v", "dualpipe-v", "interleaved-zero-bubble", "looped-bfs"]
# two stages per process over mlp()'s eight layers
BALANCE = {1: [4, 4], 2: [2, 2, 2, 2], 4: [1] * 8}


def fewest_microbatches(schedule: str, k: int) -> int:
    return 2 * k if schedule == "dualpipe-v" else k


def equivalence(k: int, schedule: str) -> dict:
    """``schedule`` against un-pipelined training for M from the fewest it takes to 4K, one
    micro-batch a row short, every checkpoint mode and layers recomputed selectively."""
    cases = 0
    modes = [*MODES, Layers(every=2), Layers(select=lambda name, layer: name in ("2", "5"))]
    for chunks in sorted({fewest_microbatches(schedule, k), 2 * k, 4 * k}):
        for mode in modes:
            pipe = Pipeline(
                mlp(),
                BALANCE[k],
                chunks=chunks,
                checkpoint=mode,
                schedule=schedule,
                loss_fn=mse_loss,
            )
            _check_step(pipe, *batch(2 * chunks - 1), **EXACT)
            cases += 1
    # dropout replayed in the recomputation: the same gradients with and without it
    grads = {}
    for mode in MODES:
        pipe = Pipeline(
            mlp(dropout=0.5),
            BALANCE[k],
            chunks=2 * k,
            checkpoint=mode,
            schedule=schedule,
            loss_fn=mse_loss,
        )
        torch.manual_seed(99 + dist.get_rank())
        pipe.step(*batch(4 * k))
        grads[mode] = [p.grad for p in pipe.parameters()]
    for mode in ("always", "except_last"):
        assert all(torch.equal(a, b) for a, b in zip(grads["never"], grads[mode], strict=True))
    return {"cases": cases, "stages": list(pipe.stages), "last": pipe.is_last}


def memory_capped(k: int) -> dict:
    """v-half and v-min against un-pipelined training, float64: never and always, M from
    v-min's fewest to 2K + 1 with one micro-batch a row short, skips across processes; and
    v-min with fewer micro-batches than it needs refused in one line."""
    from gpipe.schedules.v_memory import v_min_fewest

    cases = 0
    for schedule in ("v-half", "v-min"):
        for chunks in sorted({v_min_fewest(k), 2 * k + 1}):
            for mode in ("never", "always"):
                pipe = Pipeline(
                    mlp(),
                    BALANCE[k],
                    chunks=chunks,
                    checkpoint=mode,
                    schedule=schedule,
                    loss_fn=mse_loss,
                )
                _check_step(pipe, *batch(2 * chunks - 1), **EXACT)
                cases += 1
        pipe = Pipeline(
            unet(),
            UNET_INTERLEAVED[k],
            chunks=2 * k,
            checkpoint="except_last",
            schedule=schedule,
            loss_fn=mse_loss,
        )
        _check_unet_step(pipe, *unet_batch(4 * k - 1))
        cases += 1
    try:
        Pipeline(mlp(), BALANCE[k], chunks=1, schedule="v-min", loss_fn=mse_loss)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"cases": cases, "stages": list(pipe.stages), "refused": refused}


def skips(k: int) -> int:
    """The U-Net-like model, its skips within a process and across processes, under every
    two-per-process schedule and checkpoint mode."""
    cases = 0
    for schedule in TWO_PER_RANK:
        for mode in MODES:
            pipe = Pipeline(
                unet(),
                UNET_INTERLEAVED[k],
                chunks=2 * k,
                checkpoint=mode,
                schedule=schedule,
                loss_fn=mse_loss,
            )
            _check_unet_step(pipe, *unet_batch(4 * k - 1))
            cases += 1
    return cases


def data_parallel(d: int) -> int:
    """D replicas of each two-per-process schedule against one un-pipelined step on the union
    of the shards, even and uneven shards (the uneven cut leaves one replica 3 rows: too few
    for dualpipe-v's 2K micro-batches and the interleaved schedules' multiple of K)."""
    from gpipe.comm.process_group import init_process_group

    init_process_group(torch.device("cpu"))
    k = dist.get_world_size() // d
    replica = dist.get_rank() % d
    cases = 0
    for schedule in TWO_PER_RANK:
        any_m = schedule in ("zero-bubble-v", "looped-bfs")
        for uneven in (False, True) if any_m else (False,):
            pipe = Pipeline(
                mlp(),
                BALANCE[k],
                chunks=2 * k,
                checkpoint="except_last",
                schedule=schedule,
                loss_fn=mse_loss,
                data_parallel=d,
                timeout=10,
            )
            _replicated_step_is_exact(pipe, replica, d, uneven)
            cases += 1
    return cases


def ties() -> dict:
    """A weight shared by the first and the last stage under each schedule: on one process
    in a V (its two copies summed there), on two in a loop."""
    return {s: tied_weights([1, 1, 1, 1], s)["ties"] for s in ["interleaved", *TWO_PER_RANK]}


def schedule_file(path: str) -> dict:
    """A schedule read from a PyTorch schedule file, every checkpoint mode, against
    un-pipelined training; and a step with fewer micro-batches than the file refused."""
    from gpipe.schedules import from_csv

    schedule = from_csv(path)
    k = schedule.n_ranks
    for mode in MODES:
        pipe = Pipeline(
            mlp(),
            BALANCE[k],
            chunks=schedule.n_microbatches,
            checkpoint=mode,
            schedule=schedule,
            loss_fn=mse_loss,
        )
        _check_step(pipe, *batch(2 * schedule.n_microbatches - 1), **EXACT)
    errors = {}
    try:
        Pipeline(mlp(), BALANCE[k], chunks=1, schedule=schedule, loss_fn=mse_loss)
    except ValueError as exc:
        errors["chunks"] = str(exc)
    try:  # refused on the first rank; the others lose it and say so, rather than hang
        pipe.step(*batch(schedule.n_microbatches - 1))
    except (ValueError, StageError) as exc:
        errors["rows"] = str(exc)
    return {"stages": list(pipe.stages), "name": pipe.schedule_name, "errors": errors}


def large_messages() -> int:
    """Messages larger than a pipe holds, both ways between two processes on two channels
    each (a V: stage 0 to 1 and 3 to 2 forward, back the other way): every schedule ends,
    exact. Each process reads its pipes in its own order, so one full pipe must never hold
    up the writes to another."""
    torch.manual_seed(0)
    width = 1 << 14  # 16 rows x 16384 x 8 bytes: 2 MiB a message, twice a pipe's 1 MiB
    model = torch.nn.Sequential(
        torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.GELU(), torch.nn.Linear(width, 4)
    ).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 4, generator=g).double(), torch.randn(64, 4, generator=g).double()
    reference = copy.deepcopy(model)
    mse_loss(reference(x), y).backward()
    expected = dict(reference.named_parameters())
    cases = 0
    for schedule in TWO_PER_RANK:
        pipe = Pipeline(
            copy.deepcopy(model),
            [1, 1, 1, 1],
            chunks=4,
            checkpoint="never",
            schedule=schedule,
            loss_fn=mse_loss,
            timeout=20,
        )
        pipe.step(x, y)
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, expected[name].grad, **EXACT)
        cases += 1
    return cases
