"""What each process runs in tests/engine/test_distributed_schedules.py (importable by name)."""

import os

import torch
import torch.distributed as dist
from torch.nn.functional import mse_loss

from gpipe import Pipeline

from .distributed_cases import MODES, _check_step
from .small_models import (
    BALANCES,
    SPLITS,
    UNET_BALANCES,
    UNET_INTERLEAVED,
    batch,
    mlp,
    unet,
    unet_batch,
)

EXACT = {"rtol": 1e-12, "atol": 1e-14}


def equivalence(k: int, schedule: str) -> int:
    """``schedule`` against un-pipelined training: every split, every checkpoint mode, with
    dropout replayed, and over several steps of shapes that change."""
    cases = 0
    for rows, chunks in SPLITS:
        for mode in MODES:
            pipe = Pipeline(
                mlp(),
                BALANCES[k],
                chunks=chunks,
                checkpoint=mode,
                schedule=schedule,
                loss_fn=mse_loss,
            )
            _check_step(pipe, *batch(rows), **EXACT)
            cases += 1
    pipe = Pipeline(mlp(), BALANCES[k], chunks=4, schedule=schedule, loss_fn=mse_loss)
    for rows in (9, 16, 3):
        pipe.zero_grad()
        _check_step(pipe, *batch(rows), **EXACT)
        cases += 1
    grads = {}
    for mode in MODES:
        pipe = Pipeline(
            mlp(dropout=0.5),
            BALANCES[k],
            chunks=4,
            checkpoint=mode,
            schedule=schedule,
            loss_fn=mse_loss,
        )
        torch.manual_seed(99 + dist.get_rank())
        pipe.step(*batch(16))
        grads[mode] = [p.grad for p in pipe.parameters()]
    for mode in ("always", "except_last"):
        assert all(torch.equal(a, b) for a, b in zip(grads["never"], grads[mode], strict=True))
    return cases + 1


# two stages per process: rank r holds stages r and r + K
INTERLEAVED = {1: [4, 4], 2: [2, 2, 2, 2], 3: [2, 1, 1, 2, 1, 1], 4: [1] * 8}


def interleaved(k: int) -> dict:
    """Interleaved 1F1B against un-pipelined training; micro-batches come in groups of K."""
    cases = 0
    for rows, chunks in [(16, k), (10, 2 * k), (2 * k, 2 * k)]:
        for mode in MODES:
            pipe = Pipeline(
                mlp(),
                INTERLEAVED[k],
                chunks=chunks,
                checkpoint=mode,
                schedule="interleaved",
                loss_fn=mse_loss,
            )
            _check_step(pipe, *batch(rows), **EXACT)
            cases += 1
    return {
        "cases": cases,
        "stages": list(pipe.stages),
        "names": [n for n, _ in pipe.named_parameters()],
    }


def _unet_reference(x, y):
    reference = unet()
    loss = mse_loss(reference(x), y)
    loss.backward()
    return reference, loss


def _check_unet_step(pipe, x, y):
    reference, ref_loss = _unet_reference(x, y)
    torch.testing.assert_close(pipe.step(x, y), ref_loss.double(), **EXACT)
    ref_params = dict(reference.named_parameters())
    names = [name for name, _ in pipe.named_parameters()]
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **EXACT)
    out = pipe(x)
    if pipe.is_last:
        torch.testing.assert_close(out, reference(x), **EXACT)
    torch.testing.assert_close(pipe.evaluate(x, y), ref_loss.double(), **EXACT)
    return names


def skips(k: int) -> dict:
    """The U-Net-like model, its skips spanning 1, 2 and 3 stage boundaries, under every
    schedule and checkpoint mode, against un-pipelined training; returns the parameter names
    this rank holds, to check that every one was compared."""
    cases, names = 0, set()
    for schedule in ("gpipe", "1f1b", "zero-bubble", "interleaved"):
        interleaved = schedule == "interleaved"
        balance = UNET_INTERLEAVED[k] if interleaved else UNET_BALANCES[k]
        splits = [(4 * k, 2 * k), (2 * k, 2 * k)] if interleaved else [(16, 4), (10, 4), (3, 8)]
        for rows, chunks in splits:
            for mode in MODES:
                pipe = Pipeline(
                    unet(),
                    balance,
                    chunks=chunks,
                    checkpoint=mode,
                    schedule=schedule,
                    loss_fn=mse_loss,
                )
                names.update(_check_unet_step(pipe, *unet_batch(rows)))
                cases += 1
        # shapes that change between steps: (B, T, features)
        pipe = Pipeline(unet(), balance, chunks=2 * k, schedule=schedule, loss_fn=mse_loss)
        for rows, length in [(2 * k, 3), (4 * k, 2)]:
            x, y = unet_batch(rows * length)
            pipe.zero_grad()
            _check_unet_step(pipe, x.view(rows, length, -1), y.view(rows, length, -1))
            cases += 1
    return {"cases": cases, "names": sorted(names)}


def separate_envelopes(k: int) -> int:
    """The transport as it runs on CUDA (descriptions on a side group, tensors in one
    tag-less stream per pair of processes, as NCCL delivers them), emulated over gloo:
    interleaved with skips sends and receives in different orders, the hardest case."""
    import torch.distributed as dist

    from gpipe.comm.distributed import DistributedTransport
    from gpipe.comm.process_group import init_process_group

    init_process_group(torch.device("cpu"))
    side = dist.new_group(list(range(k)), backend="gloo")
    cases = 0
    for schedule, balance, rows, chunks in [
        ("interleaved", UNET_INTERLEAVED[k], 4 * k, 2 * k),
        ("1f1b", UNET_BALANCES[k], 10, 4),
        ("zero-bubble", UNET_BALANCES[k], 16, 4),
    ]:
        for mode in MODES:
            pipe = Pipeline(
                unet(),
                balance,
                chunks=chunks,
                checkpoint=mode,
                schedule=schedule,
                loss_fn=mse_loss,
                group=dist.new_group(list(range(k))),
            )
            pipe.runner.transport = DistributedTransport(
                [s % k for s in range(len(balance))],
                pipe.device,
                pipe.group,
                envelope_group=side,
            )
            _check_unet_step(pipe, *unet_batch(rows))
            cases += 1
    return cases


def auto(k: int) -> dict:
    """``schedule="auto"``: every rank runs the one choice, which trains exactly; a bad
    setting is refused on every rank, none waits for another."""
    x, y = batch(16)
    first = os.environ["RANK"] == "0"  # the process group starts in the Pipeline
    pipe = Pipeline(mlp(), schedule="auto", sample=x if first else None, loss_fn=mse_loss)
    _check_step(pipe, x, y, **EXACT)
    errors = {}
    for name, options in {
        "sample": {},
        "budget": {"sample": x, "memory_budget": 1024},
    }.items():
        try:
            Pipeline(mlp(), schedule="auto", loss_fn=mse_loss, **options)
        except ValueError as exc:
            errors[name] = str(exc)
    choice = pipe.auto_choice
    return {
        "choice": (pipe.schedule_name, pipe.chunks, pipe.balance, choice.chosen.virtual_stages),
        "stages": list(pipe.stages),
        "errors": errors,
    }
