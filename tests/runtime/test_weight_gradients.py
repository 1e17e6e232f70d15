"""A split backward: B gives the input gradients alone, W the weight gradients alone, and
together they equal one whole backward.

Some checks read ``Stage._saved``, what a stage keeps between B and W: how far W goes back
through the graph is a property of what is saved, which no public call shows."""

import copy

import pytest
import torch
from torch import nn

from gpipe.runtime import weight_gradients as weightgrad
from gpipe.runtime.stage import Stage


def _layers():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8), nn.GELU(), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.LayerNorm(8)
    ).double()


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("direct", [True, False], ids=["engine", "public-api"])
def test_b_then_w_equals_one_backward(checkpoint, direct, monkeypatch):
    if not direct:  # a torch without the private engine entry point takes the public one
        monkeypatch.setattr(weightgrad, "_engine_run_backward", None)
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


def test_w_covers_every_output_of_a_layer_and_none_on_a_first_stage():
    """A layer whose output nests several tensors gets W from each of them; a stage whose
    inputs need no gradient notes nothing (B has nothing to do there, W is the whole
    backward)."""

    class Split(nn.Module):  # like an LSTM's (output, (h, c))
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(6, 4))

        def forward(self, x):
            y = x @ self.weight.t()
            return y[:, :3], (y[:, 3:],)

    class Join(nn.Module):
        def forward(self, out):
            return out[0] * out[1][0]

    torch.manual_seed(0)
    layers = nn.Sequential(Split(), Join(), nn.Linear(3, 2)).double()
    reference = copy.deepcopy(layers)
    x = torch.randn(5, 4, dtype=torch.float64)
    g = torch.randn(5, 2, dtype=torch.float64)
    for needs_grad in (True, False):
        layers.zero_grad()
        reference.zero_grad()
        stage = Stage(1, 3, layers, torch.device("cpu"))
        stage.forward(0, x.requires_grad_(needs_grad), build_graph=True, split_backward=True)
        # internal: where W starts, which a Stage keeps in its private _saved
        assert len(stage._saved[0].weights.edges) == (3 if needs_grad else 0)
        stage.backward_input(0, (g,))
        stage.backward_weight(0)
        reference(x).backward(g)
        for p, q in zip(layers.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


class _Router(nn.Module):
    """A mixture-of-experts router as Hugging Face's return theirs: the logits, and the scores
    made from them (``direct``: plus a map of its own input, so that the scores reach a
    parameter other than through the logits)."""

    def __init__(self, direct: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6))
        self.extra = nn.Parameter(torch.randn(2, 6)) if direct else None

    def forward(self, x):
        logits = x @ self.weight.t()
        top, _ = torch.topk(logits, 2, dim=-1)
        scores = torch.softmax(top, dim=-1)
        if self.extra is not None:
            scores = scores + torch.tanh(x @ self.extra.t())
        return logits, scores


class _Weighted(nn.Module):
    """Uses the scores, and the logits only when ``both``."""

    def __init__(self, both: bool):
        super().__init__()
        self.both = both

    def forward(self, out):
        logits, scores = out
        y = scores.repeat(1, 3)
        return y + logits[:, :1] if self.both else y


@pytest.mark.parametrize("both", [False, True], ids=["scores", "logits-and-scores"])
@pytest.mark.parametrize("direct", [False, True], ids=["through-logits", "direct-too"])
def test_outputs_made_from_one_another_are_counted_once(both, direct):
    """The router's scores are made from its logits, so the gradient B finds at the logits
    already holds the scores': W starts from the logits alone (an edge less for B); where the
    scores also reach a parameter directly, the router's weights come from the stage's output.
    Either way B then W equals one backward (each gradient was twice its value before)."""
    torch.manual_seed(0)
    layers = nn.Sequential(_Router(direct), _Weighted(both), nn.Linear(6, 3)).double()
    reference = copy.deepcopy(layers)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 3, dtype=torch.float64)
    stage = Stage(1, 3, layers, torch.device("cpu"))
    stage.forward(0, x, build_graph=True, split_backward=True)
    assert len(stage._saved[0].weights.edges) == (1 if direct else 2)  # internal: why W is exact
    stage.backward_input(0, (g,))
    stage.backward_weight(0)
    reference(x.detach()).backward(g)
    for p, q in zip(layers.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_w_of_a_sub_sequence_on_a_first_stage_does_not_go_back_through_its_blocks():
    """A sub-sequence's layers run their cached forward, which runs no module hooks: the
    embedding's output is noted for W all the same, so W reaches its position table from
    there rather than by a whole backward again from the stage's output. Reads the stage's
    saved graph, as the first test does, since what W reaches is the point."""
    from gpipe.models.gpt import GPTConfig, build_gpt

    torch.manual_seed(0)
    gpt = build_gpt(GPTConfig(n_layer=1, d_model=16, n_head=2, seq_len=8, vocab_size=32))
    layers = nn.Sequential(*list(gpt)[:2]).double()  # the embedding and the block
    stage = Stage(0, 2, layers, torch.device("cpu"), seq_chunks=2)
    ids = torch.randint(0, 32, (3, 8))
    for unit in (0, 1):
        stage.forward(unit, ids[:, 4 * unit : 4 * unit + 4], build_graph=True, split_backward=True)
    stage.backward_input(1, (torch.randn(3, 4, 16, dtype=torch.float64),))
    reached = []
    for output in stage._saved[1].outputs:
        output.register_hook(reached.append)
    stage.backward_weight(1)
    assert reached == []
    assert all(p.grad is not None for p in layers.parameters())
