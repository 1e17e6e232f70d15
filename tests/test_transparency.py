"""The promise: a pipelined step gives the outputs and gradients of an un-pipelined one.

Here in one process (GPipe); tests/test_pipeline.py checks the same across processes.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn.functional import mse_loss

from gpipe import GPipe
from gpipe.comm.in_process import InProcessTransport
from gpipe.runtime.recompute import Layers

from .small_models import BALANCES, SPLITS, UNET_BALANCES, batch, mlp, unet, unet_batch

MODES = ["never", "always", "except_last"]


def _step(model, x, y):
    x = x.clone().requires_grad_()
    out = model(x)
    loss = mse_loss(out, y)
    loss.backward()
    return out, loss, x.grad


def _assert_same(pipe, reference, x, y, **tol):
    out, loss, x_grad = _step(pipe, x, y)
    ref_out, ref_loss, ref_x_grad = _step(reference, x, y)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(loss, ref_loss, **tol)
    torch.testing.assert_close(x_grad, ref_x_grad, **tol)
    ref_params = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        layer_name = name.split(".", 2)[2]  # partitions.<j>.<layer>.<param>
        torch.testing.assert_close(p.grad, ref_params[layer_name].grad, **tol)
    assert len(list(pipe.parameters())) == len(ref_params)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("rows", "chunks"), SPLITS)
@pytest.mark.parametrize("k", sorted(BALANCES))
def test_gpipe_float64_matches_unpipelined(k, rows, chunks, mode):
    reference = mlp()
    pipe = GPipe(
        copy.deepcopy(reference), BALANCES[k], devices=["cpu"] * k, chunks=chunks, checkpoint=mode
    )
    x, y = batch(rows)
    _assert_same(pipe, reference, x, y, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", MODES)
def test_gpipe_float32_matches_unpipelined_within_1e5(mode):
    reference = mlp(torch.float32)
    pipe = GPipe(
        copy.deepcopy(reference), [3, 3, 2], devices=["cpu"] * 3, chunks=4, checkpoint=mode
    )
    x, y = batch(10, torch.float32)
    _assert_same(pipe, reference, x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_recomputation_replays_dropout_masks(mode):
    x, y = batch(16)

    def grads(checkpoint):
        pipe = GPipe(mlp(dropout=0.5), [4, 4], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint)
        torch.manual_seed(123)
        out, _, x_grad = _step(pipe, x, y)
        return out, x_grad, [p.grad for p in pipe.parameters()]

    out_never, x_grad_never, never = grads("never")
    out_mode, x_grad_mode, other = grads(mode)
    assert torch.equal(out_never, out_mode)
    assert torch.equal(x_grad_never, x_grad_mode)
    assert all(torch.equal(a, b) for a, b in zip(never, other, strict=True))
    # and dropout really dropped something: two seeds differ
    torch.manual_seed(124)
    pipe = GPipe(mlp(dropout=0.5), [4, 4], devices=["cpu"] * 2, chunks=4)
    assert not torch.equal(pipe(x), out_never)


class _Masked(nn.Module):
    """Takes (x, mask) and returns (linear(x) * mask, mask): a non-floating tensor rides along."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width, dtype=torch.float64)

    def forward(self, pair):
        x, mask = pair
        return self.linear(x) * mask.unsqueeze(1), mask


def test_tuples_with_non_floating_tensors_pass_through():
    torch.manual_seed(0)
    reference = nn.Sequential(*[_Masked(5) for _ in range(4)])
    pipe = GPipe(copy.deepcopy(reference), [1, 2, 1], devices=["cpu"] * 3, chunks=3)
    x = torch.randn(7, 5, dtype=torch.float64)
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 1])
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, out_mask = pipe((x1, mask))
    ref, _ = reference((x2, mask))
    assert torch.equal(out_mask, mask) and not out_mask.requires_grad
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_several_forwards_before_their_backwards_match_unpipelined(mode):
    """Two inputs through one model, then one loss (a siamese net, or a target computed by
    the model itself): each forward keeps its own graphs. The second forward took the first
    one's place and its backward gave wrong gradients (3.3 off) or failed."""
    reference = mlp()
    pipe = GPipe(copy.deepcopy(reference), [4, 4], devices=["cpu"] * 2, chunks=2, checkpoint=mode)
    (x1, _), (x2, _), (x3, _) = batch(6, seed=1), batch(6, seed=2), batch(6, seed=3)
    for model in (pipe, reference):
        out1, out2 = model(x1), model(x2)
        mse_loss(model(x3), out2.detach()).backward()  # the latest first
        ((out1 - out2) ** 2).sum().backward()
    ref_params = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name.split(".", 2)[2]].grad)


def test_inputs_that_need_no_grad_get_none():
    pipe = GPipe(mlp(), [4, 4], devices=["cpu"] * 2, chunks=2)
    x, y = batch(8)
    mse_loss(pipe(x), y).backward()
    assert x.grad is None
    assert all(p.grad is not None for p in pipe.parameters())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("rows", "chunks"), [(16, 4), (10, 4), (3, 8)])
@pytest.mark.parametrize("k", sorted(UNET_BALANCES))
def test_skips_across_partitions_match_unpipelined(k, rows, chunks, mode):
    """Skips spanning 1, 2 and 3 partition boundaries, one that needs no gradient, and a
    stashed None: outputs and every gradient as without the pipeline."""
    reference = unet()
    pipe = GPipe(
        copy.deepcopy(reference),
        UNET_BALANCES[k],
        devices=["cpu"] * k,
        chunks=chunks,
        checkpoint=mode,
    )
    x, y = unet_batch(rows)
    _assert_same(pipe, reference, x, y, rtol=1e-12, atol=1e-14)
    # shapes that change between steps: (B, T, features)
    pipe.zero_grad()
    reference.zero_grad()
    x, y = unet_batch(rows * 3)
    _assert_same(pipe, reference, x.view(rows, 3, -1), y.view(rows, 3, -1), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_recomputed_skips_replay_dropout_and_are_sent_once(mode, monkeypatch):
    x, y = unet_batch(16)
    sent = []
    send = InProcessTransport.send

    def counting(self, message, src, dst, microbatch, kind):
        sent.append((kind.value, src, dst, microbatch))
        send(self, message, src, dst, microbatch, kind)

    monkeypatch.setattr(InProcessTransport, "send", counting)

    def run(checkpoint):
        sent.clear()
        pipe = GPipe(
            unet(dropout=0.5), [3, 3, 3], devices=["cpu"] * 3, chunks=4, checkpoint=checkpoint
        )
        torch.manual_seed(7)
        out, _, x_grad = _step(pipe, x, y)
        # routes 0 -> 1 and 0 -> 2, four micro-batches: each skip and its gradient moves once
        skips = [s for s in sent if s[0] in ("SEND_SKIP", "SEND_SKIP_B")]
        assert len(skips) == len(set(skips)) == 2 * 2 * 4
        return out, x_grad, [p.grad for p in pipe.parameters()]

    out_never, x_grad_never, never = run("never")
    out_mode, x_grad_mode, other = run(mode)
    assert torch.equal(out_never, out_mode) and torch.equal(x_grad_never, x_grad_mode)
    assert all(torch.equal(a, b) for a, b in zip(never, other, strict=True))


@pytest.mark.parametrize(
    "policy",
    [
        Layers(every=2),
        Layers(every=1),
        Layers(select=lambda name, layer: isinstance(layer, nn.Linear)),
    ],
    ids=["every-2", "every-1", "linear-layers"],
)
def test_layers_recomputed_selectively_match_unpipelined(policy):
    """Some layers recomputed in the backward, dropout replayed: every gradient exact."""
    reference = mlp(dropout=0.3)
    pipe = GPipe(copy.deepcopy(reference), [4, 4], devices=["cpu"] * 2, chunks=4, checkpoint=policy)
    x, y = batch(12)
    torch.manual_seed(11)
    out, _, x_grad = _step(pipe, x, y)
    torch.manual_seed(11)
    never = GPipe(
        copy.deepcopy(reference), [4, 4], devices=["cpu"] * 2, chunks=4, checkpoint="never"
    )
    ref_out, _, ref_grad = _step(never, x, y)
    assert torch.equal(out, ref_out) and torch.equal(x_grad, ref_grad)
    for a, b in zip(pipe.parameters(), never.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)


def test_a_layer_policy_that_picks_nothing_or_a_skip_is_refused():
    with pytest.raises(ValueError, match=r"checkpoint=Layers\(select=...\) picks no layer"):
        GPipe(mlp(), [4, 4], devices=["cpu"] * 2, checkpoint=Layers(select=lambda n, m: False))
    with pytest.raises(ValueError, match="picks layer '0', which stashes or pops skip tensors"):
        GPipe(unet(), [4, 5], devices=["cpu"] * 2, checkpoint=Layers(every=1))
    with pytest.raises(ValueError, match="exactly one of them"):
        Layers()
