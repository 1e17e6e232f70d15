"""What each process runs in tests/parallel/test_sharding.py: Pipeline(shard="full") over real
processes, against one un-pipelined step on the union of the replicas' rows and against the
unsharded replicas."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.functional import mse_loss

from gpipe import Pipeline
from gpipe.comm.process_group import init_process_group
from gpipe.schedules import SCHEDULES, traits

from ..distributed_cases import _reference
from ..small_models import BALANCES, batch, mlp
from ..two_per_rank_cases import BALANCE as TWO_PER_RANK

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
    common = dict(
        chunks=chunks,
        checkpoint=mode,
        schedule=schedule,
        loss_fn=mse_loss,
        data_parallel=D,
        timeout=20,
        **more,
    )
    return Pipeline(mlp(), balance, shard="full", **common), Pipeline(mlp(), balance, **common)


def exactness(schedules=tuple(SCHEDULES), modes=("never", "always")) -> dict:
    """Every schedule, checkpoint never and always, D = 2 sharded "full": loss and every
    gathered gradient equal one un-pipelined step on the union of the replicas' rows; AdamW
    after two steps equals the unsharded replicas' weights (and the plain model's). Two are
    enough: the second gathers the shards the first step's update wrote and steps with the
    sharded optimizer state it left; a third would repeat it."""
    init_process_group(torch.device("cpu"))
    cases, names = 0, None
    for schedule in schedules:
        for mode in modes:
            sharded, whole = _pipelines(schedule, mode)
            reference = mlp()
            models = (sharded, whole, reference)
            optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
            for step in range(2):
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


class _Messages:
    """Counts fully_shard's all-gathers and reduce-scatters while it is open."""

    def __enter__(self):
        self.gathers = self.scatters = 0
        self._saved = dist.all_gather_single, dist.reduce_scatter_single

        def gather(*args, **kwargs):
            self.gathers += 1
            return self._saved[0](*args, **kwargs)

        def scatter(*args, **kwargs):
            self.scatters += 1
            return self._saved[1](*args, **kwargs)

        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter
        return self

    def __exit__(self, *exc):
        dist.all_gather_single, dist.reduce_scatter_single = self._saved


def _twins(make, balance, data, *, steps=2, tol=EXACT, scaled=False, clip=None, **options):
    """A sharded pipeline and its unsharded twin, ``steps`` steps of AdamW side by side on
    ``data(step)``: the same losses, gathered gradients, clipped norms, evaluations, outputs
    and weights. Returns the sharded one and its messages in the last step."""
    sharding = options.pop("shard", "full")
    common = dict(data_parallel=D, timeout=20, **options)
    pipes = [
        Pipeline(make(), balance, shard=sharding, **common),
        Pipeline(make(), balance, **common),
    ]
    optimizers = [torch.optim.AdamW(p.parameters(), lr=0.01) for p in pipes]
    scalers = [torch.amp.GradScaler("cpu", init_scale=256.0) if scaled else None for _ in pipes]
    messages = None
    for step in range(steps):
        x, y = data(step)
        found = []
        for pipe, optimizer, scaler in zip(pipes, optimizers, scalers, strict=True):
            optimizer.zero_grad()
            with _Messages() as counted:
                loss = pipe.step(_mine(x, pipe, True), _mine(y, pipe, False), scaler=scaler)
            messages = counted if pipe is pipes[0] else messages
            norm = pipe.clip_grad_norm_(clip, scaler=scaler, optimizer=optimizer) if clip else 0
            grads = {n: full(p.grad) for n, p in pipe.named_parameters() if p.grad is not None}
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            value = pipe.evaluate(_mine(x, pipe, True), _mine(y, pipe, False))
            out = pipe(_mine(x, pipe, True))
            found.append((loss, norm, grads, value, out))
        (loss, norm, grads, value, out), (loss_, norm_, grads_, value_, out_) = found
        torch.testing.assert_close(loss, loss_, **tol)
        torch.testing.assert_close(norm, norm_, **tol)
        assert grads.keys() == grads_.keys() and grads
        for name in grads:
            torch.testing.assert_close(grads[name], grads_[name], **tol)
        torch.testing.assert_close(value, value_, **tol)
        torch.testing.assert_close(out, out_, **tol)
    held = dict(pipes[1].state_dict())
    for name, tensor in pipes[0].state_dict().items():  # weights and buffers
        torch.testing.assert_close(full(tensor), held[name], **tol)
    return pipes[0], messages


def _rows(make_batch, rows):
    return lambda step: make_batch(rows, seed=step + 1)


def compositions() -> dict:
    """shard="full" beside every other option, against unsharded replicas: layers recomputed
    selectively, parameters freed after every forward (with zero-bubble's W), autocast,
    GradScaler with clipping, deferred BatchNorm, skips, tied weights; and the messages of a
    step: one all-gather and one reduce-scatter per unit."""
    from gpipe.parallel.sharding import Sharding
    from gpipe.runtime.recompute import Layers

    from ..small_models import (
        UNET_BALANCES,
        UNET_INTERLEAVED,
        bn_model,
        tied,
        token_loss,
        tokens,
        unet,
        unet_batch,
    )

    init_process_group(torch.device("cpu"))
    data = _rows(batch, 11)
    out = {}
    # one unit per layer with parameters: gathered once, reduced once, during the last B
    pipe, messages = _twins(mlp, [4, 4], data, chunks=4, schedule="1f1b", loss_fn=mse_loss)
    units = len(pipe.sharded.gradients[pipe.stage_index].buckets)
    out["1f1b"] = (units, messages.gathers, messages.scatters, pipe.last_step.allreduce_early)
    pipe, messages = _twins(mlp, [4, 4], data, chunks=4, schedule="zero-bubble", loss_fn=mse_loss)
    out["zero-bubble"] = (
        units,
        messages.gathers,
        messages.scatters,
        pipe.last_step.allreduce_early,
    )
    freed = Sharding(reshard_after_forward=True)
    for schedule in ("zero-bubble", "interleaved-zero-bubble"):
        balance = [4, 4] if schedule == "zero-bubble" else [2, 2, 2, 2]
        pipe, messages = _twins(
            mlp,
            balance,
            data,
            chunks=4,
            schedule=schedule,
            shard=freed,
            checkpoint="except_last",
            loss_fn=mse_loss,
        )
        out[f"freed {schedule}"] = (messages.gathers, messages.scatters)
    _twins(
        mlp,
        [4, 4],
        data,
        chunks=4,
        schedule="zero-bubble",
        loss_fn=mse_loss,
        checkpoint=Layers(every=2),
    )
    # units of one's choosing: the rest of each stage's parameters in the stage's own unit
    chosen = Sharding(unit=lambda name, module: name in ("0", "5"))
    pipe, messages = _twins(
        mlp, [4, 4], data, chunks=4, schedule="1f1b", shard=chosen, loss_fn=mse_loss
    )
    out["chosen"] = (
        len(pipe.sharded.gradients[pipe.stage_index].buckets),
        messages.gathers,
        messages.scatters,
    )
    _twins(
        mlp,
        [4, 4],
        data,
        chunks=4,
        schedule="gpipe",
        shard=Sharding(unit=(nn.Linear,)),
        loss_fn=mse_loss,
    )
    single = _rows(lambda rows, seed: batch(rows, torch.float32, seed), 11)
    _twins(
        lambda: mlp(torch.float32),
        [4, 4],
        single,
        chunks=4,
        schedule="zero-bubble",
        autocast=torch.bfloat16,
        loss_fn=lambda o, t: mse_loss(o.float(), t),
        tol={"rtol": 1e-6, "atol": 1e-7},
    )
    _twins(mlp, [4, 4], data, chunks=4, schedule="1f1b", loss_fn=mse_loss, scaled=True, clip=0.05)
    x = torch.randn(8, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _twins(
        bn_model,
        [2, 4],
        lambda step: (x, x),
        chunks=2,
        deferred_batch_norm=True,
        loss_fn=lambda o, t: o.pow(2).mean(),
    )
    _twins(
        unet,
        UNET_BALANCES[2],
        _rows(unet_batch, 11),
        chunks=4,
        schedule="zero-bubble",
        loss_fn=mse_loss,
    )
    _twins(
        unet,
        UNET_INTERLEAVED[2],
        _rows(unet_batch, 8),
        chunks=4,
        schedule="interleaved",
        loss_fn=mse_loss,
        checkpoint="always",
    )
    ids = _rows(lambda rows, seed: tokens(rows, seed=seed), 7)
    _twins(tied, [2, 2], ids, chunks=3, loss_fn=token_loss, clip=0.5)
    _twins(tied, [1, 1, 1, 1], ids, chunks=4, schedule="zero-bubble-v", loss_fn=token_loss)
    return out


class _Scaled(nn.Module):
    """A layer with a scalar parameter, which fully_shard cannot split."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def forward(self, x):
        return x * self.scale


def bad_inputs() -> dict:
    """One clear error each, on every rank alike (so none waits for the others)."""
    from ..distributed_cases import _error

    init_process_group(torch.device("cpu"))
    layers = [*mlp(), _Scaled()]
    return {
        "alone": _error(lambda: Pipeline(mlp(), [8], shard="full", loss_fn=mse_loss)),
        "unknown": _error(lambda: Pipeline(mlp(), data_parallel=2, shard="zero3")),
        "optimizer": _error(lambda: Pipeline(mlp(), data_parallel=2, shard="optimizer")),
        "gradients": _error(lambda: Pipeline(mlp(), data_parallel=2, shard="gradients")),
        "scalar": _error(lambda: Pipeline(layers, [5, 4], data_parallel=2, shard="full")),
    }


def _steps(pipe: Pipeline, optimizer, steps: range) -> list[float]:
    """AdamW steps on the global mini-batches of ``steps``; the losses."""
    losses = []
    for step in steps:
        x, y = batch(11, seed=step)
        optimizer.zero_grad()
        if pipe.replicas is not None:
            x, y = _mine(x, pipe, True), _mine(y, pipe, False)
        losses.append(float(pipe.step(x, y)))
        optimizer.step()
    return losses


def checkpoints(root: str) -> dict:
    """A run saved at D = 2 x K = 2 sharded (in the foreground and in the background)
    resumes at D = 2 sharded, at D = 1 (two pipelines of K = 2, unsharded) and at D = 4 x
    K = 1 sharded, with the losses the run itself goes on with."""
    from pathlib import Path

    from gpipe.training.checkpoints.format import (
        latest_checkpoint,
        load_checkpoint,
        verify_checkpoint,
    )
    from gpipe.training.checkpoints.writer import CheckpointWriter

    init_process_group(torch.device("cpu"))
    options = dict(chunks=4, schedule="1f1b", loss_fn=mse_loss, timeout=20)
    pipe = Pipeline(mlp(), [4, 4], data_parallel=D, shard="full", **options)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    _steps(pipe, optimizer, range(2))
    paths = {}
    for how in ("foreground", "background"):
        writer = CheckpointWriter(Path(root) / how, pipe, background=how == "background")
        writer.save(2, pipe, optimizer, {"step": 2}, {"model": "mlp"})
        paths[how] = writer.close()
    going_on = _steps(pipe, optimizer, range(2, 4))
    found = {"problems": [verify_checkpoint(p) for p in paths.values()]}
    found["latest"] = [str(latest_checkpoint(Path(root) / how)) for how in paths]
    me = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    resumed = {
        "D=2 sharded": lambda: Pipeline(mlp(), [4, 4], data_parallel=D, shard="full", **options),
        "D=1": lambda: Pipeline(mlp(), [4, 4], group=halves[me // 2], **options),
        "D=4 K=1 sharded": lambda: Pipeline(mlp(), [8], data_parallel=4, shard="full", **options),
    }
    for how, path in paths.items():
        for name, make in resumed.items():
            again = make()
            optimizer = torch.optim.AdamW(again.parameters(), lr=0.01)
            held = load_checkpoint(path, again, optimizer, {"step": 0}, group=again.group)
            assert held["step"] == 2
            losses = _steps(again, optimizer, range(2, 4))
            torch.testing.assert_close(losses, going_on, **EXACT, msg=f"{how}, {name}")
    found["losses"] = going_on
    return found


def mixed_precision() -> float:
    """fully_shard's MixedPrecisionPolicy through Sharding: gathered and computed in float32,
    float64 shards and reductions; the unsharded float64 replicas' gradients to float32's
    precision. Returns the largest relative difference."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from gpipe.parallel.sharding import Sharding

    init_process_group(torch.device("cpu"))
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    common = dict(
        chunks=4,
        schedule="zero-bubble",
        data_parallel=D,
        timeout=20,
        loss_fn=lambda o, t: mse_loss(o.double(), t),
    )
    sharded = Pipeline(mlp(), [4, 4], shard=Sharding(mp_policy=policy), **common)
    whole = Pipeline(mlp(), [4, 4], **common)
    x, y = batch(11)
    for pipe in (sharded, whole):
        pipe.step(_mine(x, pipe, True), _mine(y, pipe, False))
    held = dict(whole.named_parameters())
    worst = 0.0
    for name, p in sharded.named_parameters():
        assert p.dtype == torch.float64 and p.grad.dtype == torch.float64, name
        want = held[name].grad
        torch.testing.assert_close(full(p.grad), want, rtol=1e-4, atol=1e-5)
        worst = max(worst, float((full(p.grad) - want).abs().max() / want.abs().max()))
    return worst


def failed_step() -> bool:
    """A step whose loss raises on every replica after some micro-batches' backward: the
    next step's gradients are a clean step's, the half-accumulated ones forgotten."""
    init_process_group(torch.device("cpu"))
    calls = {"n": 0}

    def flaky(output, target):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("flaky loss")
        return mse_loss(output, target)

    common = dict(chunks=4, schedule="1f1b", data_parallel=4, timeout=20)
    sharded = Pipeline(mlp(), [8], shard="full", loss_fn=flaky, **common)
    whole = Pipeline(mlp(), [8], loss_fn=mse_loss, **common)
    x, y = batch(16)
    try:
        sharded.step(_mine(x, sharded, True), _mine(y, sharded, False))
    except RuntimeError as exc:
        assert "flaky loss" in str(exc)
    else:
        raise AssertionError("the flaky step did not fail")
    sharded.zero_grad()
    for pipe in (sharded, whole):
        pipe.step(_mine(x, pipe, True), _mine(y, pipe, False))
    held = dict(whole.named_parameters())
    for name, p in sharded.named_parameters():
        torch.testing.assert_close(full(p.grad), held[name].grad, **EXACT)
    return True
