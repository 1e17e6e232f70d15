"""A split backward: B gives the input gradients alone, W the weight gradients alone, and
together they equal one whole backward."""

import copy

import pytest
import torch
from torch import nn

from gpipe.stage import Stage


def _layers():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8), nn.GELU(), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.LayerNorm(8)
    ).double()


@pytest.mark.parametrize("checkpoint", [False, True])
def test_b_then_w_equals_one_backward(checkpoint):
    layers = _layers()
    reference = copy.deepcopy(layers)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 8, dtype=torch.float64)

    stage = Stage(1, 3, layers, torch.device("cpu"))
    stage.forward(0, x, build_graph=True, checkpoint=checkpoint, split_backward=True)
    reached = []
    (input_grad,), skip_grads = stage.backward_input(0, (g,))
    assert skip_grads == {}
    assert all(p.grad is None for p in layers.parameters())  # B computes no weight gradient

    # W must not go back through the graph as far as the input
    saved = stage._saved[0]
    saved.inputs.register_hook(reached.append)
    stage.backward_weight(0)
    assert reached == []

    xr = x.detach().clone().requires_grad_()
    reference(xr).backward(g)
    torch.testing.assert_close(input_grad, xr.grad, rtol=1e-12, atol=1e-14)
    for p, q in zip(layers.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_w_before_b_is_refused():
    stage = Stage(0, 1, _layers(), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="weight gradients of micro-batch 3 before its B"):
        stage.backward_weight(3)
