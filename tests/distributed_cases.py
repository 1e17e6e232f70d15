"""What each process runs in tests/test_pipeline.py (importable by name in new processes).

Every function runs on every rank under gpipe.launch and returns what the test checks.
Assertions inside fail the launch with the rank's message.
"""

import functools
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import mse_loss

from gpipe import Pipeline, StageError
from gpipe.comm.process_group import init_process_group

from .small_models import BALANCES, SPLITS, batch, bn_model, mlp

MODES = ["never", "always", "except_last"]


def _reference(model, x, y):
    loss = mse_loss(model(x), y)
    loss.backward()
    return loss


def _check_step(pipe, x, y, dtype=torch.float64, **tol):
    reference = mlp(dtype)
    ref_loss = _reference(reference, x, y)
    loss = pipe.step(x, y)
    torch.testing.assert_close(loss, ref_loss.double(), **tol)
    ref_params = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **tol)
    assert 0 < pipe.last_step.busy <= pipe.last_step.total
    out = pipe(x)
    if pipe.is_last:
        torch.testing.assert_close(out, reference(x), **tol)
    else:
        assert out is None
    torch.testing.assert_close(pipe.evaluate(x, y), ref_loss.double(), **tol)
    return reference


EXACT = {"rtol": 1e-12, "atol": 1e-14}


def _split(rows: int, chunks: int, mode: str, k: int) -> None:
    pipe = Pipeline(mlp(), BALANCES[k], chunks=chunks, checkpoint=mode, loss_fn=mse_loss)
    _check_step(pipe, *batch(rows), **EXACT)


def _float32(k: int) -> None:
    """float32 within 1e-5 relative."""
    pipe = Pipeline(mlp(torch.float32), BALANCES[k], chunks=4, loss_fn=mse_loss)
    _check_step(pipe, *batch(10, torch.float32), dtype=torch.float32, rtol=1e-5, atol=1e-6)


def _changing_shapes(k: int) -> None:
    """Shapes change between steps and the last micro-batch is short: (B, T, features)."""
    pipe = Pipeline(mlp(), BALANCES[k], chunks=4, checkpoint="always", loss_fn=mse_loss)
    for rows, length in [(8, 3), (7, 5), (2, 1)]:
        x, y = batch(rows * length)
        pipe.zero_grad()
        _check_step(pipe, x.view(rows, length, -1), y.view(rows, length, -1), **EXACT)


def _clipping(k: int) -> None:
    """Clipping by the global norm of all stages, as clip_grad_norm_ on the whole model."""
    pipe = Pipeline(mlp(), BALANCES[k], chunks=4, loss_fn=mse_loss)
    reference = _check_step(pipe, *batch(12), **EXACT)
    ref_norm = nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
    torch.testing.assert_close(pipe.clip_grad_norm_(1e-3).double(), ref_norm.double(), **EXACT)
    ref_params = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **EXACT)


def _dropout_replayed(k: int) -> None:
    """Recomputation replays the dropout masks of the first forward."""
    grads = {}
    for mode in MODES:
        pipe = Pipeline(mlp(dropout=0.5), BALANCES[k], chunks=4, checkpoint=mode, loss_fn=mse_loss)
        torch.manual_seed(1234 + dist.get_rank())
        pipe.step(*batch(16))
        grads[mode] = [p.grad for p in pipe.parameters()]
    for mode in ("always", "except_last"):
        assert all(torch.equal(a, b) for a, b in zip(grads["never"], grads[mode], strict=True))


# Pipeline against un-pipelined training, case by case: every split and checkpoint mode, then
# float32, shapes that change between steps, clipping, and dropout under recomputation.
EQUIVALENCE: dict[str, Callable[[int], None]] = {
    **{
        f"rows={rows}-chunks={chunks}-{mode}": functools.partial(_split, rows, chunks, mode)
        for rows, chunks in SPLITS
        for mode in MODES
    },
    "float32": _float32,
    "changing-shapes": _changing_shapes,
    "clipping": _clipping,
    "dropout-replayed": _dropout_replayed,
}


def equivalence(k: int, case: str) -> str:
    """The case of EQUIVALENCE named ``case`` at K = k (a mismatch fails the rank); returns
    its name."""
    EQUIVALENCE[case](k)
    return case


def meta_initialization(k: int) -> dict:
    """A pipeline built on the meta device: this rank allocates and initializes only its own
    layers; returns its parameters' names and weights, which the test compares across K."""
    with torch.device("meta"):
        model = mlp()
    pipe = Pipeline(model, BALANCES[k], seed=5, loss_fn=mse_loss)
    assert not any(p.is_meta for p in pipe.parameters())
    state = {name: t.clone() for name, t in pipe.state_dict().items()}
    return {"state": state, "names": [n for n, _ in pipe.named_parameters()]}


class _Exit(nn.Module):
    """Ends its process in the middle of a step, as a crashed peer would."""

    def forward(self, x):
        os._exit(17)


class _Stall(nn.Module):
    """Stalls longer than the peers' timeout, as a hung peer would, until stage 0 has
    reported (8 s at most); then ends its process, as a hung peer's watchdog would."""

    def __init__(self, report: str):
        super().__init__()
        self.report = report

    def forward(self, x):
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and not _written(self.report):
            time.sleep(0.05)
        os._exit(17)


def _written(path: str) -> bool:
    """Whether stage 0's report is complete: its time, a newline, then its message."""
    try:
        with open(path) as f:
            return "\n" in f.read()
    except FileNotFoundError:
        return False


def failing_peer(how: str, report: str) -> None:
    """Stage 1 dies or stalls mid-step; stage 0 must raise within its timeout and say so."""
    last = _Exit() if how == "dies" else _Stall(report)
    pipe = Pipeline(
        nn.Sequential(nn.Linear(4, 4), last), [1, 1], chunks=2, timeout=2.0, loss_fn=mse_loss
    )
    x = torch.randn(4, 4)
    if pipe.is_first:
        start = time.monotonic()
        try:
            pipe.step(x, x)
            message = "no error"
        except StageError as exc:
            message = str(exc)
        with open(report, "w") as f:
            f.write(f"{time.monotonic() - start:.2f}\n{message}")
    else:
        pipe.step(x, x)


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:
        notes = "".join(f" [{note}]" for note in getattr(exc, "__notes__", []))
        return f"{type(exc).__name__}: {exc}{notes}"
    return "no error"


def bad_inputs() -> dict:
    """Each bad input on its own process group, so one case's stranded messages cannot reach
    the next; returns each rank's error messages."""
    init_process_group(torch.device("cpu"))
    ranks = list(range(dist.get_world_size()))
    errors = {}

    def fresh(**kwargs):
        options = {
            "balance": [4, 4],
            "loss_fn": mse_loss,
            "group": dist.new_group(ranks),
            "timeout": 1.0,
        }
        return Pipeline(mlp(), **(options | kwargs))

    errors["balance"] = _error(lambda: fresh(balance=[8]))
    errors["chunks"] = _error(lambda: fresh(chunks=0))
    errors["checkpoint"] = _error(lambda: fresh(checkpoint="sometimes"))
    errors["schedule"] = _error(lambda: fresh(schedule="fastest"))
    errors["reduction"] = _error(lambda: fresh(loss_reduction="median"))
    errors["no_loss"] = _error(lambda: fresh(loss_fn=None).step(*batch(4)))
    x, y = batch(4)
    errors["non_scalar_loss"] = _error(lambda: fresh(loss_fn=lambda o, t: o - t).step(x, y))
    errors["not_a_tensor"] = _error(lambda: fresh().step([1, 2], y))
    errors["targets_rows"] = _error(lambda: fresh().step(x, y[:3]))
    return errors


def different_text() -> str:
    """Stage 1 reads other training text than stage 0: the job must refuse to start."""
    import numpy as np

    from gpipe.training.data import TokenDataset, check_same_data

    pipe = Pipeline(mlp(), BALANCES[2], loss_fn=mse_loss)
    text = np.frombuffer(b"same" if pipe.is_first else b"other", dtype=np.uint8)
    dataset = TokenDataset(text, text, 256, "the text")
    return _error(lambda: check_same_data(dataset, pipe))


def equivalence_cuda() -> str:
    """Pipeline over NCCL, one GPU per rank (cuda:LOCAL_RANK), against the CPU reference."""
    for mode in MODES:
        pipe = Pipeline(mlp(), BALANCES[2], chunks=4, checkpoint=mode, loss_fn=mse_loss)
        assert pipe.device.type == "cuda"
        x, y = batch(10)
        reference = mlp()
        ref_loss = _reference(reference, x, y)
        torch.testing.assert_close(pipe.step(x, y).cpu(), ref_loss)
        ref = dict(reference.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad.cpu(), ref[name].grad)
    return "ok"


def traced() -> dict:
    """Pipeline(trace=True) over two ranks: the merged timelines of a step and an evaluate."""
    pipe = Pipeline(mlp(), BALANCES[2], chunks=4, loss_fn=mse_loss, trace=True)
    x, y = batch(8)
    pipe.step(x, y)
    step = pipe.timeline()
    pipe.evaluate(x, y)
    return {"step": step, "evaluate": pipe.timeline()}


def balanced_by_time() -> dict:
    """balance=None with a sample: one slow layer before five cheap ones; the rank that is
    not first passes no sample and still gets the first rank's decision."""
    torch.manual_seed(0)
    layers = nn.Sequential(
        nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 256)),
        *[nn.Identity() for _ in range(5)],
    )
    init_process_group(torch.device("cpu"))
    sample = torch.randn(256, 256) if dist.get_rank() == 0 else None
    rng = torch.get_rng_state()
    timed = Pipeline(layers, sample=sample, chunks=2, loss_fn=mse_loss)
    untimed = Pipeline(layers, chunks=2, loss_fn=mse_loss)
    return {
        "timed": timed.balance,
        "untimed": untimed.balance,
        "rng_untouched": torch.equal(rng, torch.get_rng_state()),
    }


MEMORY_SCHEDULES = (
    "gpipe",
    "1f1b",
    "zero-bubble",
    "interleaved",
    "zero-bubble-v",
    "v-half",
    "v-min",
)


def memory_workload(name: str, device: str = "cpu"):
    """The model, its balance per schedule, a mini-batch and the loss of a memory check."""
    from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss

    generator = torch.Generator().manual_seed(0)
    if name == "mlp":
        with torch.device(device):
            model = nn.Sequential(
                *[
                    nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
                    for _ in range(4)
                ]
            )
        x = torch.randn(64, 64, generator=generator)
        y = torch.randn(64, 64, generator=generator)
        return model, x, y, mse_loss
    if name == "unet":  # skips cross the cut of every balance below
        from .small_models import N_OUT, unet

        with torch.device(device):
            model = unet(torch.float32, width=64)
        x = torch.randn(64, 64, generator=generator)
        y = torch.randn(64, N_OUT, generator=generator)
        return model, x, y, mse_loss
    config = GPTConfig(n_layer=4, d_model=64, n_head=4, seq_len=64, dropout=0.1)
    x, y = torch.randint(0, 256, (2, 32, 64), generator=generator)
    return build_gpt(config, device=device), x, y, lm_loss


def memory_balance(n_layers: int, schedule: str) -> list[int]:
    half = n_layers // 2
    if schedule in ("interleaved", "zero-bubble-v", "v-half", "v-min"):  # looped, or a V
        return [half // 2, half - half // 2, half // 2, n_layers - half - half // 2]
    return [half, n_layers - half]


def measured_memory(name: str) -> dict:
    """Peak activation bytes of this rank, measured in one step of every schedule and mode."""
    from gpipe.planning.memory import ActivationMeter

    init_process_group(torch.device("cpu"))
    model, x, y, loss_fn = memory_workload(name, device="meta")
    out = {}
    for schedule in MEMORY_SCHEDULES:
        for checkpoint in ("never", "except_last", "always"):
            pipe = Pipeline(
                model,
                memory_balance(len(model), schedule),
                chunks=8,
                checkpoint=checkpoint,
                schedule=schedule,
                loss_fn=loss_fn,
            )
            with ActivationMeter(pipe) as meter:
                pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            out[f"{schedule}/{checkpoint}"] = meter.peak
    return out


SUB_SEQUENCE_GPT = {"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 256, "vocab_size": 128}


# the GPT's six layers per schedule: on a V of four stages, rank 0 holds the first and last
SUB_SEQUENCE_BALANCES = {
    "gpipe": [3, 3],
    "1f1b": [3, 3],
    "zero-bubble": [3, 3],
    "zero-bubble-v": [2, 1, 1, 2],
}


def sub_sequence_workload() -> tuple[torch.Tensor, torch.Tensor]:
    """Eight rows of 256 tokens for ``SUB_SEQUENCE_GPT``: inputs and targets."""
    ids = torch.randint(0, 128, (8, 257), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def measured_sub_sequence_memory() -> dict:
    """Peak activation bytes of this rank in one step (after one to warm up) of the GPT on
    four sub-sequences per micro-batch, under gpipe, 1F1B, zero-bubble and zero-bubble-v and
    every mode (``SUB_SEQUENCE_BALANCES``)."""
    from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss
    from gpipe.planning.memory import ActivationMeter

    init_process_group(torch.device("cpu"))
    x, y = sub_sequence_workload()
    out = {}
    for schedule, balance in SUB_SEQUENCE_BALANCES.items():
        for checkpoint in ("never", "except_last", "always"):
            torch.manual_seed(0)
            pipe = Pipeline(
                build_gpt(GPTConfig(**SUB_SEQUENCE_GPT)),
                balance,
                chunks=4,
                checkpoint=checkpoint,
                schedule=schedule,
                loss_fn=lm_loss,
                seq_chunks=4,
            )
            inputs, targets = (x if pipe.is_first else None), (y if pipe.is_last else None)
            pipe.step(inputs, targets)
            pipe.zero_grad()
            with ActivationMeter(pipe) as meter:
                pipe.step(inputs, targets)
            out[f"{schedule}/{checkpoint}"] = meter.peak
    return out


def deferred_batch_norm() -> int:
    """Pipeline(deferred_batch_norm=True) against the same deferred model run micro-batch by
    micro-batch in one piece: running statistics, outputs and gradients, every schedule and
    checkpoint mode, over two steps, one of them shorter than ``chunks``."""
    from gpipe.runtime.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm

    exact = {"rtol": 1e-12, "atol": 1e-14}
    cases = 0
    for schedule in ("gpipe", "1f1b", "zero-bubble", "interleaved"):
        balance = [1, 2, 1, 2] if schedule == "interleaved" else [2, 4]
        for mode in MODES:
            reference = convert_deferred_batch_norm(bn_model(), chunks=4)
            pipe = Pipeline(
                bn_model(),
                balance,
                chunks=4,
                checkpoint=mode,
                schedule=schedule,
                loss_fn=lambda out, y: out.pow(2).mean(),
                deferred_batch_norm=True,
            )
            for step, rows in enumerate([16, 4 if schedule == "interleaved" else 3]):
                generator = torch.Generator().manual_seed(step)
                x = torch.randn(rows, 5, 3, dtype=torch.float64, generator=generator)
                pipe.zero_grad()
                reference.zero_grad()
                loss = pipe.step(x, x)
                parts = x.split([len(p) for p in x.chunk(4)])
                ref_loss = sum(reference(p).pow(2).mean() * len(p) / rows for p in parts)
                for layer in reference.modules():
                    if isinstance(layer, DeferredBatchNorm):
                        layer.commit()
                ref_loss.backward()
                torch.testing.assert_close(loss, ref_loss, **exact)
                ref_state = reference.state_dict()
                for name, tensor in pipe.state_dict().items():
                    torch.testing.assert_close(tensor, ref_state[name], **exact)
                ref_params = dict(reference.named_parameters())
                for name, p in pipe.named_parameters():
                    torch.testing.assert_close(p.grad, ref_params[name].grad, **exact)
                cases += 1
    return cases


def _shards(x, y, replica: int, d: int, uneven: bool):
    """Replica ``replica``'s rows: gpipe.parallel.replicas.shard, or a deliberately lopsided cut."""
    from gpipe.parallel.replicas import shard

    if not uneven:
        return shard(x, replica, d), shard(y, replica, d)
    cut = [0, 3, len(x)] if d == 2 else [0, len(x)]
    return x[cut[replica] : cut[replica + 1]], y[cut[replica] : cut[replica + 1]]


def _replicated_step_is_exact(pipe: Pipeline, replica: int, d: int, uneven: bool):
    """One step of ``pipe`` on this replica's shard: its loss and every gradient equal one
    un-pipelined step on the union of the shards (float64). Returns the shard and loss."""
    exact = {"rtol": 1e-12, "atol": 1e-14}
    x, y = batch(11)
    xs, ys = _shards(x, y, replica, d, uneven)
    reference = mlp()
    ref_loss = _reference(reference, x, y)
    loss = pipe.step(xs if pipe.is_first else None, ys if pipe.is_last else None)
    torch.testing.assert_close(loss, ref_loss.double(), **exact)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, **exact)
    return xs, ys, ref_loss


def data_parallel(d: int) -> dict:
    """D replicas of a K-stage pipeline (K = world / D) against one un-pipelined step on the
    union of the shards: loss on every rank, every gradient, float64; even and uneven shards,
    gpipe and 1f1b, every checkpoint mode; deferred BatchNorm statistics merged over replicas."""
    from gpipe.runtime.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm

    exact = {"rtol": 1e-12, "atol": 1e-14}
    init_process_group(torch.device("cpu"))
    world = dist.get_world_size()
    k = world // d
    replica = dist.get_rank() % d
    cases = 0
    for schedule in ("gpipe", "1f1b"):
        for mode in MODES:
            for uneven in (False, True):
                pipe = Pipeline(
                    mlp(),
                    BALANCES[k],
                    chunks=4,
                    checkpoint=mode,
                    schedule=schedule,
                    loss_fn=mse_loss,
                    data_parallel=d,
                    timeout=10,
                )
                xs, ys, ref_loss = _replicated_step_is_exact(pipe, replica, d, uneven)
                torch.testing.assert_close(pipe.evaluate(xs, ys), ref_loss.double(), **exact)
                cases += 1
    # BatchNorm: the statistics of the global mini-batch, equal on every replica
    reference = convert_deferred_batch_norm(bn_model(), chunks=2, auto_commit=False)
    pipe = Pipeline(
        bn_model(),
        [2, 4] if k == 2 else [6],
        chunks=2,
        loss_fn=lambda o, t: o.pow(2).mean(),
        deferred_batch_norm=True,
        data_parallel=d,
    )
    x = torch.randn(8, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    xs, _ = _shards(x, x, replica, d, uneven=False)
    pipe.step(xs, xs)
    for r in range(d):  # the union of every replica's micro-batches, replica by replica
        part, _ = _shards(x, x, r, d, uneven=False)
        for mb in part.chunk(2):
            reference(mb)
    for layer in reference.modules():
        if isinstance(layer, DeferredBatchNorm):
            layer.commit()
    ref_state = reference.state_dict()
    for name, tensor in pipe.state_dict().items():
        if "running" in name or "num_batches" in name:
            torch.testing.assert_close(tensor, ref_state[name], **exact)
            cases += 1
    times = pipe.last_step
    found = {"cases": cases, "buckets": times.allreduce_buckets, "early": times.allreduce_early}
    # buckets of one parameter each: still exact, and each starts during the last backward
    pipe = Pipeline(
        mlp(),
        BALANCES[k],
        chunks=4,
        loss_fn=mse_loss,
        data_parallel=d,
        bucket_bytes=1,
    )
    _replicated_step_is_exact(pipe, replica, d, uneven=True)
    found["small"] = (pipe.last_step.allreduce_buckets, pipe.last_step.allreduce_early)
    found["held"] = sum(1 for p in pipe.parameters() if p.requires_grad)
    return found


def data_parallel_bad_inputs() -> dict:
    init_process_group(torch.device("cpu"))
    errors = {
        "divides": _error(lambda: Pipeline(mlp(), [8], data_parallel=3, loss_fn=mse_loss)),
        "bucket": _error(lambda: Pipeline(mlp(), [8], bucket_bytes=0, loss_fn=mse_loss)),
    }
    errors["both"] = _error(
        lambda: Pipeline(mlp(), [8], data_parallel=2, group=dist.new_group([0, 1]))
    )
    errors["type"] = _error(lambda: Pipeline(mlp(), [8], data_parallel=0))
    pipe = Pipeline(mlp(), [8], data_parallel=2, loss_fn=mse_loss, timeout=5)
    x, y = batch(4)
    rows = 4 if dist.get_rank() == 0 else 0
    errors["empty"] = _error(lambda: pipe.step(x[:rows] if rows else x[:0], y[:rows]))
    counts = torch.tensor([1.0, -2.0, 1.0, 1.0]) if dist.get_rank() == 1 else torch.ones(4)
    errors["counts"] = _error(lambda: pipe.step(x, y, counts=counts))
    pipe.zero_grad()
    pipe.step(x, y)
    errors["after"] = "ok"
    return errors


def autocast() -> int:
    """Pipeline(autocast=torch.bfloat16) against the plain model under the same autocast,
    micro-batch by micro-batch: every schedule and checkpoint mode."""
    from .small_models import INTERLEAVED_MLP

    cases = 0
    for schedule in ("gpipe", "1f1b", "zero-bubble", "interleaved"):
        balance = INTERLEAVED_MLP if schedule == "interleaved" else BALANCES[2]
        for mode in MODES:
            pipe = Pipeline(
                mlp(torch.float32),
                balance,
                chunks=4,
                checkpoint=mode,
                schedule=schedule,
                loss_fn=lambda o, t: mse_loss(o.float(), t),
                autocast=torch.bfloat16,
            )
            reference = mlp(torch.float32)
            x, y = batch(16, torch.float32)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref_loss = 0.0
                for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
                    part = mse_loss(reference(xm).float(), ym) * len(xm) / len(x)
                    part.backward()
                    ref_loss += part.item()
            loss = pipe.step(x, y)
            torch.testing.assert_close(loss.item(), ref_loss, rtol=1e-6, atol=1e-7)
            ref = dict(reference.named_parameters())
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-6, atol=1e-7)
            cases += 1
    return cases


def loss_scaling() -> dict:
    """torch.amp.GradScaler with a pipeline: a clean step equals the unscaled one; an inf in
    one stage's gradients makes every rank skip and halve the scale."""
    import torch.amp

    exact = {"rtol": 1e-12, "atol": 1e-14}
    out = {}
    pipe = Pipeline(mlp(), BALANCES[2], chunks=4, loss_fn=mse_loss)
    plain = Pipeline(mlp(), BALANCES[2], chunks=4, loss_fn=mse_loss)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    x, y = batch(12)
    loss = pipe.step(x, y, scaler=scaler)
    torch.testing.assert_close(loss, plain.step(x, y), **exact)  # reported unscaled
    norm = pipe.clip_grad_norm_(1e9, scaler=scaler, optimizer=optimizer)  # unscales first
    torch.testing.assert_close(norm, plain.clip_grad_norm_(1e9), **exact)
    scaler.step(optimizer)
    scaler.update()
    plain_optimizer.step()
    for a, b in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, **exact)
    out["scale_after_clean"] = scaler.get_scale()
    # an inf in the last stage's gradients only: every rank must skip
    pipe.zero_grad()
    before = [p.detach().clone() for p in pipe.parameters()]
    pipe.step(x, y, scaler=scaler)
    if pipe.is_last:
        next(pipe.parameters()).grad[0] = float("inf")
    out["skipped"] = pipe.unscale_(scaler, optimizer)
    scaler.step(optimizer)
    scaler.update()
    out["unchanged"] = all(
        torch.equal(a, b) for a, b in zip(before, pipe.parameters(), strict=True)
    )
    out["scale_after_inf"] = scaler.get_scale()
    result = pipe.step(x, y, return_outputs=True)  # outputs of the step: no second forward
    if pipe.is_last:
        assert not result.outputs.requires_grad and result.outputs.shape == y.shape
        torch.testing.assert_close(mse_loss(result.outputs, y), result.loss, **exact)
        parts = zip(result.losses, x.chunk(4), strict=True)
        weighted = sum(loss * len(part) / len(x) for loss, part in parts)
        torch.testing.assert_close(weighted, result.loss, **exact)
        out["losses"] = len(result.losses)
    else:
        out["losses"] = result.outputs
    return out


def layer_checkpoint() -> int:
    """checkpoint=Layers(...) under every schedule: the gradients of un-pipelined training."""
    from gpipe.runtime.recompute import Layers

    from .small_models import INTERLEAVED_MLP

    cases = 0
    for schedule in ("gpipe", "1f1b", "zero-bubble", "interleaved"):
        balance = INTERLEAVED_MLP if schedule == "interleaved" else BALANCES[2]
        for policy in (Layers(every=2), Layers(select=lambda name, layer: name in ("2", "5"))):
            pipe = Pipeline(
                mlp(), balance, chunks=4, checkpoint=policy, schedule=schedule, loss_fn=mse_loss
            )
            _check_step(pipe, *batch(16), rtol=1e-12, atol=1e-14)
            cases += 1
    return cases


LAYER_POLICIES = {"every-1": 1, "every-2": 2}


def measured_layer_memory(name: str) -> dict:
    """Peak activation bytes of this rank with layers recomputed selectively."""
    from gpipe.planning.memory import ActivationMeter
    from gpipe.runtime.recompute import Layers

    init_process_group(torch.device("cpu"))
    model, x, y, loss_fn = memory_workload(name, device="meta")
    out = {}
    for schedule in ("gpipe", "1f1b"):
        for policy, every in LAYER_POLICIES.items():
            balance = memory_balance(len(model), schedule)
            pipe = Pipeline(
                model,
                balance,
                chunks=8,
                checkpoint=Layers(every=every),
                schedule=schedule,
                loss_fn=loss_fn,
            )
            with ActivationMeter(pipe) as meter:
                pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            out[f"{schedule}/{policy}"] = meter.peak
    return out


def two_ties() -> dict:
    """Two ties over different sets of ranks ({0, 2} and {1, 2}): built without waiting
    forever, and each copy's gradient is its shared weight's."""
    from .small_models import token_loss, tokens, two_ties

    exact = {"rtol": 1e-12, "atol": 1e-14}
    reference = two_ties()
    pipe = Pipeline(two_ties(), [1, 1, 2], chunks=3, loss_fn=token_loss, timeout=20)
    ids, targets = tokens(7)
    ref_loss = token_loss(reference(ids), targets)
    ref_loss.backward()
    loss = pipe.step(ids, targets)
    torch.testing.assert_close(loss, ref_loss.detach(), **exact)
    ref = dict(reference.named_parameters())
    shared = {"3.weight": "0.weight", "2.weight": "1.weight"}
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[shared.get(name, name)].grad, **exact)
    return {"ties": sorted(t.stages for t in pipe.ties)}


def tied_weights(balance: list[int], schedule: str = "gpipe") -> dict:
    """A weight used by the first and the last stage: each copy's gradient is the shared
    weight's, the copies stay equal through optimizer steps, and clipping counts it once."""
    from .small_models import tied, token_loss, tokens

    exact = {"rtol": 1e-12, "atol": 1e-14}
    reference = tied()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.1)
    # several stages per process: a multiple of the ranks, and dualpipe-v's 2K
    chunks = 3 if schedule in ("gpipe", "1f1b", "zero-bubble") else 4
    pipe = Pipeline(tied(), balance, chunks=chunks, schedule=schedule, loss_fn=token_loss)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.1)
    last = len(balance) - 1
    for step in range(3):
        ids, targets = tokens(7, seed=step)
        ref_opt.zero_grad()
        ref_loss = token_loss(reference(ids), targets)
        ref_loss.backward()
        opt.zero_grad()
        loss = pipe.step(ids, targets)
        torch.testing.assert_close(loss, ref_loss.detach(), **exact)
        ref_grads = dict(reference.named_parameters())
        for name, p in pipe.named_parameters():
            want = ref_grads["0.weight"] if name == "3.weight" else ref_grads[name]
            torch.testing.assert_close(p.grad, want.grad, **exact)
        ref_norm = nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        torch.testing.assert_close(pipe.clip_grad_norm_(0.5), ref_norm.double(), **exact)
        ref_opt.step()
        opt.step()
    copies = {}
    for name, p in pipe.named_parameters():
        if name in ("0.weight", "3.weight"):
            copies[name] = p.detach().clone()
    # every copy equals the reference's one weight, bit for bit across the copies
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, copies)
    both = {k: v for d in gathered for k, v in d.items()}
    assert torch.equal(both["0.weight"], both["3.weight"])
    torch.testing.assert_close(both["0.weight"], reference[0].weight.detach(), **exact)
    return {"ties": [t.stages for t in pipe.ties], "last": last}
