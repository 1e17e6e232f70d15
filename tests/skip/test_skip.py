"""The skip API: skippable layers stash and pop tensors, in a plain Sequential or across
stages, and a model whose skips do not pair up is refused before anything runs."""

import copy
import pickle

import pytest
import torch
from torch import nn

from gpipe import GPipe
from gpipe.skip import Namespace, SkipLayout, find_skips, pop, skippable, stash, verify_skippables

from ..small_models import UNET_BALANCES, Decode, Encode, unet, unet_batch


@skippable(stash=["x"])
class Keep(nn.Module):
    def forward(self, x):
        yield stash("x", x)
        return x * 2


@skippable(pop=["x"])
class Add(nn.Module):
    def forward(self, y):
        x = yield pop("x")
        return x + y


@skippable(stash=["x"])
class DeclaresButReturns(nn.Module):
    def forward(self, x):
        return x


@skippable()
class StashesUndeclared(nn.Module):
    def forward(self, x):
        yield stash("x", x)
        return x


def test_a_plain_sequential_runs_skippable_layers_and_their_gradients():
    x = torch.randn(3, requires_grad=True)
    out = nn.Sequential(Keep(), nn.Tanh(), Add())(x)
    torch.testing.assert_close(out, torch.tanh(x * 2) + x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * (1 - torch.tanh(x * 2) ** 2) + 1)


def test_misuse_inside_a_layer_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="declared 'x' as stashable but did not stash it"):
        DeclaresButReturns()(torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"stashed 'x' without declaring it"):
        StashesUndeclared()(torch.zeros(1))
    with pytest.raises(RuntimeError, match="'x' was popped before it was stashed"):
        Add()(torch.zeros(1))


def test_skippable_keeps_the_class_name_state_dict_keys_and_pickles():
    @skippable(stash=["x"])
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x):
            yield stash("x", x)
            return self.conv(x)

    block = Block()
    assert type(block).__name__ == "Block"
    assert list(block.state_dict()) == ["conv.weight", "conv.bias"]
    assert repr(block).startswith("@skippable(Block(")
    restored = pickle.loads(pickle.dumps(Encode()))
    assert isinstance(restored, Encode)


def test_namespaces_compare_by_origin():
    a = Namespace()
    assert a != Namespace() and copy.copy(a) == a and copy.copy(a) is not a
    assert copy.deepcopy(Encode().isolate(a)).namespaced("skip") == (a, "skip")
    with pytest.raises(ValueError, match="cannot isolate \\['y'\\]"):
        Encode().isolate(a, only=["y"])


def test_verify_skippables_lists_every_problem():
    @skippable(stash=["a"], pop=["a"])
    class Both(nn.Module):
        pass

    model = nn.Sequential(Keep(), Keep(), Add(), Add(), Decode(), Both())
    with pytest.raises(TypeError) as caught:
        verify_skippables(model)
    message = str(caught.value)
    assert "'1' redeclared 'x' as stashable" in message
    assert "'3' redeclared 'x' as poppable" in message
    assert "'4' declared 'skip' as poppable but it was not stashed" in message
    assert "'5' declared 'a' both as stashable and as poppable" in message
    with pytest.raises(TypeError, match="no module declared 'x' as poppable but stashed"):
        verify_skippables(nn.Sequential(Keep()))
    ns1, ns2 = Namespace(), Namespace()
    verify_skippables(
        nn.Sequential(
            Keep().isolate(ns1), Keep().isolate(ns2), Add().isolate(ns2), Add().isolate(ns1)
        )
    )


def test_nested_skippables_are_found_and_named_by_their_path():
    model = nn.Sequential(nn.Sequential(nn.Linear(1, 1), Keep()), nn.Identity())
    with pytest.raises(TypeError, match="no module declared 'x'"):
        verify_skippables(model)
    model.append(nn.Sequential(Add()))
    assert [(s.name, s.stash_layer, s.pop_layer) for s in find_skips(model)] == [("x", 0, 2)]


def test_a_bad_model_is_refused_before_any_step():
    with pytest.raises(TypeError, match="no module declared 'x' as poppable but stashed"):
        GPipe(nn.Sequential(Keep(), nn.Identity()), [1, 1], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match="'1' declared 'x' as poppable but it was not stashed"):
        GPipe(nn.Sequential(nn.Identity(), Add()), [1, 1], devices=["cpu"] * 2)


def test_the_layout_routes_skips_between_stages():
    layout = SkipLayout(find_skips(unet()), UNET_BALANCES[4])
    assert layout.routes == ((0, 2), (0, 3), (1, 2), (1, 3))
    ports = layout.ports(2)
    assert sorted(ports.imports) == [0, 1] and not ports.exports
    assert [len(keys) for keys in layout.ports(1).exports.values()] == [1, 2]  # c; mask, None


def test_a_skip_tensor_is_copied_to_the_popping_partition():
    """The popping partition gets its own copy of the stashed tensor, not the stasher's."""
    seen = {}

    @skippable(pop=["x"])
    class Check(nn.Module):
        def forward(self, y):
            x = yield pop("x")
            seen["x"] = x
            return x + y

    model = GPipe(
        nn.Sequential(Keep(), nn.Identity(), Check()),
        [1, 1, 1],
        devices=[torch.device("cpu", j) for j in range(3)],
        chunks=1,
    )
    x = torch.randn(2, 3, requires_grad=True)
    model(x).sum().backward()
    assert seen["x"].data_ptr() != x.data_ptr()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


def test_unet_runs_unpipelined_and_pipelined_alike():
    x, _ = unet_batch(4)
    reference = unet()
    pipe = GPipe(copy.deepcopy(reference), [4, 5], devices=["cpu"] * 2, chunks=2)
    torch.testing.assert_close(pipe(x), reference(x), rtol=1e-12, atol=1e-14)


def test_pipeline_refuses_a_bad_model_before_any_process_group_work(monkeypatch):
    from gpipe import Pipeline

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # a process group would be an error of its own
    with pytest.raises(TypeError, match="no module declared 'x' as poppable but stashed"):
        Pipeline(nn.Sequential(Keep(), nn.Identity()), [1, 1])


@skippable(stash=["h"])
class StashComputed(nn.Module):
    """Stashes a tensor it computed, not its input: its graph is this layer's own."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6).double()

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        yield stash("h", h)
        return h * 2


@skippable(pop=["h"])
class PopComputed(nn.Module):
    def forward(self, x):
        h = yield pop("h")
        return x + h


@pytest.mark.parametrize("profile", ["time", "size"])
def test_balancing_profiles_skip_models_layer_by_layer(profile):
    from gpipe.planning.balancing import balance_by_size, balance_by_time

    model = nn.Sequential(StashComputed(), nn.Linear(6, 6).double(), PopComputed(), *unet())
    x = torch.randn(8, 6, dtype=torch.float64)
    balance = (
        balance_by_time(3, model, x, timeout=0.3, device="cpu")
        if profile == "time"
        else balance_by_size(3, model, x, device="cpu")
    )
    assert sum(balance) == len(model) and len(balance) == 3
