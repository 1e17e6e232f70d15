"""What torchgpipe users rely on, in gpipe's GPipe: errors that keep their type, inputs and
outputs shaped as given, arguments coerced as torchgpipe does, and the pass a layer is in."""

import importlib
import threading
import time

import pytest
import torch
from torch import nn

import gpipe
from gpipe import GPipe
from gpipe.balance import balance_by_size, balance_by_time

# Separate CPU "devices": GPipe runs one worker thread per distinct device.
THREADED = [torch.device("cpu", j) for j in range(4)]


class UserError(Exception):
    pass


class Raise(nn.Module):
    def __init__(self, when="forward"):
        super().__init__()
        self.when = when

    def forward(self, x):
        if self.when == "forward":
            raise UserError("from the user's layer")
        return _RaiseInBackward.apply(x)


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise UserError("from the user's backward")


@pytest.mark.parametrize("devices", [["cpu"] * 3, THREADED[:3]], ids=["one-thread", "threads"])
def test_an_error_in_a_partition_keeps_its_type_and_notes_the_stage(devices):
    model = GPipe(
        nn.Sequential(nn.Linear(2, 2), nn.Tanh(), Raise()), [1, 1, 1], devices=devices, chunks=2
    )
    with pytest.raises(UserError, match="from the user's layer") as caught:
        model(torch.randn(4, 2))
    assert caught.value.__notes__ == ["raised in pipeline stage 2, forward of micro-batch 0"]


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_an_error_in_the_backward_keeps_its_type_too(checkpoint):
    model = GPipe(
        nn.Sequential(nn.Linear(2, 2), Raise("backward"), nn.Linear(2, 2)),
        [1, 1, 1],
        devices=THREADED[:3],
        chunks=3,
        checkpoint=checkpoint,
    )
    out = model(torch.randn(6, 2))
    with pytest.raises(UserError, match="from the user's backward") as caught:
        out.sum().backward()
    assert "stage 1, backward of micro-batch 2" in caught.value.__notes__[0]


@pytest.mark.parametrize("devices", [["cpu"] * 4, THREADED], ids=["one-thread", "threads"])
def test_other_partitions_stop_at_the_failing_clock_cycle(devices):
    """Stage 3 fails on micro-batch 0 at clock cycle 3, while stage 2 runs micro-batch 1; stage
    2 must not start micro-batch 2 (cycle 4)."""
    seen = []

    class Slow(nn.Module):
        def forward(self, x):
            time.sleep(0.2)
            seen.append(threading.get_ident())
            return x

    model = GPipe(
        nn.Sequential(nn.Identity(), nn.Identity(), Slow(), Raise()),
        [1, 1, 1, 1],
        devices=devices,
        chunks=3,
    )
    with pytest.raises(UserError):
        model(torch.randn(3, 2))
    assert len(seen) <= 2


def test_nothing_hangs_when_the_first_of_several_threads_fails():
    model = GPipe(
        nn.Sequential(Raise(), nn.Linear(2, 2), nn.Linear(2, 2)),
        [1, 1, 1],
        devices=THREADED[:3],
        chunks=4,
        timeout=30,
    )
    start = time.monotonic()
    with pytest.raises(UserError):
        model(torch.randn(8, 2))
    assert time.monotonic() - start < 5


class Pair(nn.Module):
    """Takes a tuple and records what it was given."""

    def __init__(self):
        super().__init__()
        self.given = None

    def forward(self, pair):
        self.given = pair
        return tuple(t * 2 for t in pair)


@pytest.mark.parametrize("arity", [1, 2])
def test_a_tuple_reaches_the_first_partition_as_a_tuple_and_comes_back_as_one(arity):
    layer = Pair()
    model = GPipe(nn.Sequential(layer, nn.Identity()), [1, 1], devices=["cpu"] * 2, chunks=2)
    inputs = tuple(torch.randn(4, 3, requires_grad=True) for _ in range(arity))
    out = model(inputs)
    assert isinstance(layer.given, tuple) and len(layer.given) == arity
    assert isinstance(out, tuple) and len(out) == arity
    sum(o.sum() for o in out).backward()
    assert all(torch.equal(x.grad, torch.full_like(x, 2.0)) for x in inputs)


def test_a_tensor_stays_a_tensor():
    out = GPipe(nn.Sequential(nn.Identity()), [1], devices=["cpu"], chunks=2)(torch.ones(4, 1))
    assert isinstance(out, torch.Tensor)


def test_an_empty_sequential_is_the_identity():
    model = GPipe(nn.Sequential(), [])
    x = torch.tensor(3.0)
    assert model(x) is x
    pair = (torch.zeros(2), torch.ones(2))
    assert model(pair) == pair
    with pytest.raises(TypeError, match="input must be a Tensor or a tuple of Tensors, got int"):
        model(3)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_an_in_place_change_of_a_partitions_input_is_explained(checkpoint):
    """torchgpipe let a partition's first layer be in place without re-materialization; here
    it fails in every mode, and the error says why (torch's alone speaks of a leaf)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True))
    model = GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)
    with pytest.raises(RuntimeError, match="leaf Variable") as caught:
        model(torch.randn(4, 2)).sum().backward()
    assert "its first layers may not change in place" in caught.value.__notes__[-1]


class ReturnsText(nn.Module):
    def forward(self, x):
        return x, "text"


def test_non_tensors_in_or_out_raise_type_error():
    model = GPipe(nn.Sequential(ReturnsText()), [1], devices=["cpu"])
    with pytest.raises(TypeError, match=r"output of stage 0 must be.*tuple\[Tensor, str\]"):
        model(torch.zeros(2, 1))
    with pytest.raises(TypeError, match=r"got tuple\[Tensor, str\]"):
        model((torch.zeros(2, 1), "text"))


def test_arguments_are_coerced_as_torchgpipe_does():
    class Mode:
        def __str__(self):
            return "always"

    model = GPipe(
        nn.Sequential(nn.Linear(1, 1)), (1,), devices=("cpu",), chunks=42.0, checkpoint=Mode()
    )
    assert model.balance == [1]
    assert model.chunks == 42 and type(model.chunks) is int
    assert model.checkpoint == "always" and type(model.checkpoint) is str
    with pytest.raises(ValueError, match="chunks must be a positive integer, got 4.5"):
        GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], chunks=4.5)
    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last', or"):
        GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], checkpoint="sometimes")


@pytest.mark.parametrize("balance", [None, [1], [2, 1]])
def test_a_missing_or_wrong_balance_points_to_gpipe_balance(balance):
    with pytest.raises(ValueError, match=r"gpipe\.balance"):
        GPipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), balance)


class Phases(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.seen = []

    def forward(self, x):
        self.seen.append((gpipe.is_checkpointing(), gpipe.is_recomputing()))
        return self.linear(x)


@pytest.mark.parametrize(
    ("checkpoint", "expected"),
    [
        ("always", [(True, False)] * 2 + [(False, True)] * 2),
        ("except_last", [(True, False), (False, False), (False, True)]),
        ("never", [(False, False)] * 2),
    ],
)
def test_a_layer_knows_whether_it_is_checkpointing_or_recomputing(checkpoint, expected):
    layer = Phases()
    model = GPipe(nn.Sequential(layer), [1], devices=["cpu"], chunks=2, checkpoint=checkpoint)
    model(torch.randn(4, 2)).sum().backward()
    assert layer.seen == expected
    assert not gpipe.is_checkpointing() and not gpipe.is_recomputing()


class AssertTraining(nn.Module):
    def forward(self, x):
        assert self.training, "profiled in eval mode"
        return x * 2


@pytest.mark.parametrize("profile", [balance_by_time, balance_by_size])
def test_balancing_profiles_in_training_mode_and_leaves_the_mode_alone(profile):
    model = nn.Sequential(AssertTraining(), nn.Linear(2, 2)).eval()
    assert profile(2, model, torch.randn(4, 2), device="cpu") == [1, 1]
    assert not any(layer.training for layer in model)


@pytest.mark.parametrize("profile", [balance_by_time, balance_by_size])
def test_balancing_profiles_layers_that_change_their_input_in_place(profile):
    """Each layer was handed a leaf, which torch refuses to change in place: a model with
    nn.ReLU(inplace=True), which runs as it is, could not be balanced."""
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(2, 2), nn.ReLU(inplace=True))
    assert sum(profile(2, model, torch.randn(4, 2), device="cpu")) == 3


@pytest.mark.parametrize("profile", [balance_by_time, balance_by_size])
def test_balancing_refuses_a_model_that_already_has_gradients(profile):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model(torch.randn(4, 2)).sum().backward()
    with pytest.raises(ValueError, match="some parameter already has gradient"):
        profile(2, model, torch.randn(4, 2), device="cpu")


@pytest.mark.parametrize(
    ("name", "home", "names"),
    [
        ("gpipe.balance", "gpipe.planning.balancing", ["balance_by_time", "balance_by_size"]),
        ("gpipe.batchnorm", "gpipe.runtime.batchnorm", ["DeferredBatchNorm"]),
    ],
)
def test_torchgpipe_module_names_are_modules_that_hold_the_very_same_objects(name, home, names):
    module, source = importlib.import_module(name), importlib.import_module(home)
    assert module.__name__ == name and module is not source
    assert all(getattr(module, attr) is getattr(source, attr) for attr in names)
