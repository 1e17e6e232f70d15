"""Step runners built by hand, as ``Pipeline`` builds its own: for tests/engine/test_runner.py,
in its process (all stages on one rank) and on each of two processes (importable by name)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import mse_loss

from gpipe.comm.process_group import init_process_group
from gpipe.engine import (
    RankPlacement,
    ScheduleSource,
    StageRecipe,
    StepRunner,
    StepSchedules,
    build_stages,
    forward_logprobs,
)
from gpipe.errors import StageError
from gpipe.runtime.timeline import Recorder

from ..small_models import batch, mlp

CPU = torch.device("cpu")
CHUNKS = 4
EXACT = {"rtol": 1e-12, "atol": 1e-14}


def runner(
    model: nn.Sequential,
    balance: tuple[int, ...],
    schedule: str,
    *,
    rank: int = 0,
    n_ranks: int = 1,
    local_pipes: bool = False,
    recorder: Recorder | None = None,
    timeout: float = 10,
    loss_fn=mse_loss,
) -> StepRunner:
    """This rank's step runner of ``model`` cut by ``balance``, under ``schedule``."""
    source = ScheduleSource.of(schedule)
    placement = RankPlacement(balance, rank, n_ranks, None, source.layout())
    recipe = StageRecipe(
        device=CPU,
        chunks=CHUNKS,
        checkpoint="never",
        loss_fn=loss_fn,
        autocast=None,
        deferred_batch_norm=False,
        seed=0,
    )
    built = build_stages(model, [], placement, recipe)
    params = {
        f"{name}.{key}": p
        for name, layer in built.layers.items()
        for key, p in layer.named_parameters(remove_duplicate=False)
    }
    schedules = StepSchedules(
        source, n_ranks, placement.stage_to_rank, built.skip_layout.routes, "never"
    )
    return StepRunner(
        placement,
        built,
        params,
        schedules,
        recipe,
        loss_reduction="mean",
        timeout=timeout,
        local_pipes=local_pipes,
        bucket_bytes=None,
        recorder=recorder,
    )


class FailsOnce(nn.Module):
    """Raises in the forward of its micro-batch 2, once."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise ValueError("once")
        return x


class _RaisesInBackward(torch.autograd.Function):
    """The identity, whose backward counts its runs on ``module`` and raises on the third
    (micro-batch 2's)."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.module.calls += 1
        if ctx.module.calls == 3:
            raise ValueError("backward once")
        return grad, None


class FailsOnceInBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        return _RaisesInBackward.apply(x, self)


class LossFailsOnce:
    """The mean squared error, which runs out of memory on its third call (micro-batch 2's),
    once."""

    def __init__(self):
        self.calls = 0

    def __call__(self, outputs, targets):
        self.calls += 1
        if self.calls == 3:
            raise torch.OutOfMemoryError("out of memory in the loss")
        return mse_loss(outputs, targets)


def reference(x, y, at: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The un-pipelined step: its loss and each parameter's gradient, by name (with a layer
    that changes nothing inserted at ``at``, as the failing one of a pipelined model is)."""
    model = mlp()
    if at is not None:
        model.insert(at, nn.Identity())
    loss = mse_loss(model(x), y)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def check_grads(step_runner: StepRunner, expected: dict[str, torch.Tensor]) -> None:
    for stage in step_runner.stages.values():
        for name, p in stage.module.named_parameters():
            torch.testing.assert_close(p.grad, expected[name], **EXACT)


def two_ranks(local_pipes: bool) -> dict:
    """A step of the model cut in two, a stage on each of two processes: the loss every rank
    knows, the step's size the second rank read off its first message, and the outputs and
    losses on the last."""
    init_process_group(CPU)
    rank = dist.get_rank()
    step_runner = runner(mlp(), (4, 4), "1f1b", rank=rank, n_ranks=2, local_pipes=local_pipes)
    x, y = batch(10)
    expected_loss, expected_grads = reference(x, y)
    loss, times = step_runner.train(
        x if rank == 0 else None,
        y if rank == 1 else None,
        scale=1.0,
        counts=None,
        keep_outputs=True,
        training=True,
    )
    torch.testing.assert_close(loss.loss, expected_loss.double(), **EXACT)
    check_grads(step_runner, expected_grads)
    assert 0 < times.busy <= times.total
    if rank == 1:
        torch.testing.assert_close(loss.outputs, mlp()(x).detach(), **EXACT)
        assert len(loss.losses) == CHUNKS
    else:
        assert loss.outputs is None and loss.losses is None
    return {"loss": loss.loss.item(), "info": tuple(step_runner.transport.info)}


def train_step(step_runner: StepRunner, inputs, targets) -> torch.Tensor:
    """The loss of a training step of ``inputs`` (read on the first of two ranks) against
    ``targets`` (read on the second)."""
    first = step_runner.placement.rank == 0
    loss, _ = step_runner.train(
        inputs if first else None,
        None if first else targets,
        scale=1.0,
        counts=None,
        keep_outputs=False,
        training=True,
    )
    return loss


def after_a_failed_call(local_pipes: bool) -> str | None:
    """A forward that fails on the second stage at micro-batch 2, after the first stage sent
    it every micro-batch and returned, then a training step and a forward: both exact, the
    failed call's micro-batches 2 and 3 never taken for theirs. Returns this rank's error."""
    init_process_group(CPU)
    rank = dist.get_rank()
    model = mlp()
    model.insert(6, FailsOnce())  # in the second stage
    step_runner = runner(model, (4, 5), "1f1b", rank=rank, n_ranks=2, local_pipes=local_pipes)
    x, y = batch(16)
    failed = None
    try:
        step_runner.forward(x if rank == 0 else None, training=True)
    except ValueError as exc:
        failed = str(exc)
    torch.testing.assert_close(train_step(step_runner, x, y), reference(x, y)[0].double(), **EXACT)
    outputs = step_runner.forward(x if rank == 0 else None, training=True)
    if rank == 1:
        torch.testing.assert_close(outputs, mlp()(x).detach(), **EXACT)
    return failed


def after_a_failed_backward() -> list[int]:
    """Steps after one whose first stage fails in the backward of micro-batch 2, once the
    last stage has done all of its part and broadcast the loss: the failed step's broadcast
    is not taken for a later step's loss. The last stage notices the failure only when its
    wait for the loss times out, and the first stage's next step may time out meanwhile
    (then the last stage's ends too, on a message of the step after): each step that does
    not fail is exact on both ranks. Returns the steps that failed here."""
    init_process_group(CPU)
    rank = dist.get_rank()
    model = mlp()
    model.insert(1, FailsOnceInBackward())  # in the first stage, after a layer with weights
    step_runner = runner(model, (5, 4), "1f1b", rank=rank, n_ranks=2, local_pipes=True, timeout=3)
    failed = []
    for seed in range(4):
        x, y = batch(16, seed=seed)
        try:
            loss = train_step(step_runner, x, y)
        except (ValueError, StageError):
            failed.append(seed)
            continue
        torch.testing.assert_close(loss, reference(x, y)[0].double(), **EXACT)
    return failed


def forward_only_after_a_failed_step() -> bool:
    """A step whose first stage fails in a backward, after the last stage broadcast the loss,
    then a forward alone that broadcasts the last stage's check of its targets: that
    broadcast, not the step's stale one, is what every rank takes (the two differed in size,
    which gloo aborts the process on), and the log-probabilities and the step after are
    exact. Returns whether this rank's first step failed."""
    init_process_group(CPU)
    rank = dist.get_rank()
    model = mlp()
    model.insert(1, FailsOnceInBackward())
    step_runner = runner(model, (5, 4), "1f1b", rank=rank, n_ranks=2, local_pipes=True, timeout=3)
    try:
        train_step(step_runner, *batch(16, seed=0))
        failed = False
    except (ValueError, StageError):
        failed = True
    x, _ = batch(16, seed=1)
    tokens = torch.arange(16) % 4
    got = forward_logprobs(step_runner, x if rank == 0 else None, tokens if rank == 1 else None)
    if rank == 1:
        want = torch.log_softmax(mlp()(x), -1).gather(-1, tokens[:, None])[:, 0]
        torch.testing.assert_close(got, want.detach(), **EXACT)
    x, y = batch(16, seed=2)
    torch.testing.assert_close(train_step(step_runner, x, y), reference(x, y)[0].double(), **EXACT)
    return failed


def after_two_refused_steps() -> list[str]:
    """Two steps whose inputs the first stage refuses before it sends anything, then one
    that runs: the first stage is two steps on by the time the second hears of any, and its
    messages end the second's waiting steps rather than run in them. Returns this rank's
    errors; the step after them is exact."""
    init_process_group(CPU)
    rank = dist.get_rank()
    step_runner = runner(mlp(), (4, 4), "1f1b", rank=rank, n_ranks=2, local_pipes=True)
    x, y = batch(16)
    errors = []
    for inputs in ("not a batch", "not a batch", x):
        try:
            loss = train_step(step_runner, inputs, y)
        except (TypeError, StageError) as exc:
            errors.append(type(exc).__name__)
    torch.testing.assert_close(loss, reference(x, y)[0].double(), **EXACT)
    return errors


# a failure of each kind a step meets: (where the failing layer goes, the balance, the loss)
FAILURES = {
    "loss": (None, (4, 4), LossFailsOnce),  # on the last stage, in its loss
    "backward": (1, (5, 4), None),  # on the first, in the backward of micro-batch 2
    "middle": (4, (3, 4, 2), None),  # on the middle one of three, in a forward
    "last of three": (None, (3, 3, 2), LossFailsOnce),  # the first stage hears it relayed
}


def failed_then_retried(case: str, local_pipes: bool) -> str:
    """A training step that fails on one rank (``FAILURES[case]``), caught on every rank and
    retried at once: the retry is exact against the un-pipelined model, loss and gradients.
    Returns how the failed step ended here."""
    init_process_group(CPU)
    rank = dist.get_rank()
    at, balance, loss = FAILURES[case]
    model = mlp()
    if at is not None:
        model.insert(at, FailsOnceInBackward() if case == "backward" else FailsOnce())
    step_runner = runner(
        model,
        balance,
        "1f1b",
        rank=rank,
        n_ranks=len(balance),
        local_pipes=local_pipes,
        timeout=30,
        loss_fn=mse_loss if loss is None else loss(),
    )
    x, y = batch(16)
    try:
        train_step(step_runner, x, y)
        ended = "returned"
    except Exception as exc:
        ended = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    for stage in step_runner.stages.values():
        stage.module.zero_grad(set_to_none=True)
    expected_loss, expected_grads = reference(x, y, at)
    torch.testing.assert_close(train_step(step_runner, x, y), expected_loss.double(), **EXACT)
    check_grads(step_runner, expected_grads)
    return ended
