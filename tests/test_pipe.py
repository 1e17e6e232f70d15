"""GPipe's public surface: torchgpipe-compatible arguments, attributes and behaviour."""

import weakref

import pytest
import torch
from torch import nn

from gpipe import BalanceError, GPipe, MovingDenied

from .small_models import batch, mlp


def _pipe(**kwargs):
    options = {"devices": ["cpu"] * 2, "chunks": 2} | kwargs
    return GPipe(mlp(), [4, 4], **options)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"chunks": 0}, ValueError, "chunks must be a positive integer, got 0"),
        ({"chunks": -2}, ValueError, "got -2"),
        ({"chunks": 1.5}, ValueError, "got 1.5"),
        ({"checkpoint": "sometimes"}, ValueError, "checkpoint is not one of.*'sometimes'"),
        ({"devices": ["cpu"]}, IndexError, r"too few devices.*\(devices: 1, partitions: 2\)"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        _pipe(**kwargs)


def test_bad_balance_and_module():
    with pytest.raises(BalanceError, match=r"module: 8, sum of balance: 7"):
        GPipe(mlp(), [4, 3], devices=["cpu"] * 2)
    with pytest.raises(BalanceError, match="balance is required"):
        GPipe(mlp())
    with pytest.raises(TypeError, match="must be nn.Sequential"):
        GPipe(nn.Linear(2, 2), [1])
    with pytest.raises(BalanceError, match="balance must be a list of ints, got '4,4'"):
        GPipe(mlp(), "4,4", devices=["cpu"] * 2)
    assert GPipe(mlp(), (n for n in (4, 4)), devices=["cpu"] * 2).balance == [4, 4]
    lazy = nn.Sequential(nn.Linear(2, 2), nn.LazyBatchNorm1d())  # torch spoke of load_state_dict
    with pytest.raises(ValueError, match="uninitialized lazy tensor '1.weight'.*run the module"):
        GPipe(lazy, [1, 1], devices=["cpu"] * 2, deferred_batch_norm=True)


def test_attributes_and_sequential_access():
    model = mlp()
    layers = list(model)
    pipe = GPipe(model, [3, 5], devices=["cpu", "cpu"], chunks=4, checkpoint="always")
    assert pipe.balance == [3, 5] and pipe.chunks == 4 and pipe.checkpoint == "always"
    assert pipe.devices == [torch.device("cpu")] * 2
    assert isinstance(pipe.partitions, nn.ModuleList)
    assert all(isinstance(p, nn.Sequential) for p in pipe.partitions)
    assert len(pipe) == 8
    assert list(pipe) == layers
    assert pipe[3] is layers[3] and pipe[-1] is layers[-1]
    with pytest.raises(IndexError, match="out of range"):
        pipe[8]


def test_state_dict_keys_name_partition_and_layer():
    keys = set(_pipe().state_dict())
    assert "partitions.0.0.weight" in keys
    assert "partitions.1.7.bias" in keys


def test_moving_is_refused_but_casting_is_allowed():
    pipe = _pipe()
    for move in (
        lambda: pipe.to("cpu"),
        lambda: pipe.to(torch.device("cpu")),
        pipe.cpu,
        pipe.cuda,
        lambda: pipe.to(device="cpu"),
        lambda: pipe.to(torch.zeros(1)),
    ):
        with pytest.raises(MovingDenied, match="denied to move"):
            move()
    pipe.to(torch.float32)
    assert all(p.dtype == torch.float32 for p in pipe.parameters())
    pipe.double()
    assert pipe(batch(4)[0]).dtype == torch.float64


@pytest.mark.parametrize("value", [[1.0, 2.0], "x", None])
def test_inputs_that_are_not_tensors_are_refused(value):
    with pytest.raises(TypeError, match="input must be a Tensor or a tuple of Tensors"):
        _pipe()(value)


class _Failing(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


def test_a_failing_partition_raises_its_own_error_noting_the_stage_and_the_pipe_recovers():
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), _Failing())
    pipe = GPipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=4)
    with pytest.raises(RuntimeError, match="boom") as caught:
        pipe(torch.randn(8, 6))
    assert type(caught.value) is RuntimeError
    assert caught.value.__notes__ == ["raised in pipeline stage 2, forward of micro-batch 0"]
    pipe.partitions[2][0] = nn.Identity()  # the failing layer was the stage's only one
    assert pipe(torch.randn(8, 6)).shape == (8, 6)


def test_shape_mismatch_between_stages_names_the_stage():
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(6, 2))
    pipe = GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=2)
    with pytest.raises(RuntimeError, match="mat1 and mat2") as caught:
        pipe(torch.randn(4, 6))
    assert "stage 1, forward of micro-batch 0" in caught.value.__notes__[0]


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


@pytest.mark.parametrize(
    ("mode", "training", "grad", "calls"),
    [
        ("always", True, True, 8),  # 4 forwards + 4 recomputations
        ("except_last", True, True, 7),
        ("never", True, True, 4),
        ("always", False, True, 4),  # eval mode never recomputes
        ("always", True, False, 4),  # nor does no_grad
    ],
)
def test_recomputation_runs_only_when_training_with_grad(mode, training, grad, calls):
    counting = _Counting()
    pipe = GPipe(
        nn.Sequential(counting, nn.Linear(6, 1)),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=4,
        checkpoint=mode,
    )
    pipe.train(training)
    with torch.set_grad_enabled(grad):
        out = pipe(torch.randn(8, 6))
    if grad:
        out.sum().backward()
    assert counting.calls == calls
    assert out.requires_grad == grad


def test_backward_twice_is_refused():
    pipe = _pipe()
    out = pipe(batch(4)[0])
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        out.sum().backward()


@pytest.mark.parametrize("mode", ["never", "always"])
def test_an_output_dropped_unused_frees_what_its_forward_kept(mode):
    """A training forward whose output is dropped (a metric, a target) must not hold its
    micro-batches' activations until the next forward."""
    kept = []

    class Keep(nn.Module):
        def forward(self, x):
            y = x * 2
            kept.append(weakref.ref(y))
            return y

    pipe = GPipe(
        nn.Sequential(nn.Linear(6, 6), Keep()),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=2,
        checkpoint=mode,
    )
    out = pipe(torch.randn(4, 6))
    del out
    assert kept and all(ref() is None for ref in kept)


def test_copies_off_gpu_need_no_stream():
    """Only a copy between two GPUs takes the copy streams (tested on CUDA in test_cuda.py);
    anything else is a plain detached copy, and no stream is made."""
    from gpipe.comm.copy_streams import DeviceCopies

    copies, cpu = DeviceCopies(), torch.device("cpu")
    assert copies.mark(cpu, cpu) is None
    assert copies.mark(torch.device("cuda", 0), torch.device("cuda", 0)) is None
    t = torch.randn(3, 2, requires_grad=True)
    moved = copies.move(t, cpu, None)
    assert torch.equal(moved, t) and not moved.requires_grad
    assert copies.devices == frozenset()
