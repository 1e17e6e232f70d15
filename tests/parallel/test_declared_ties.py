"""Ties a model declares by name (the reference GPT's embedding and head, separate Parameters
that start equal) go through the one tied-weights mechanism, ``gpipe.parallel.ties``: on
different stages or on one, each counted once and their gradients summed."""

import torch

from gpipe.models import GPTConfig, build_gpt, sync_tied_grads_, tied_weights
from gpipe.parallel.ties import Tie, counted, declared_ties

TINY = GPTConfig(n_layer=2, d_model=16, n_head=2, vocab_size=32, seq_len=8)


def _names(layers):
    return [(f"{e}.{a}", f"{h}.{b}") for e, a, h, b in tied_weights(layers)]


def test_the_gpt_declares_its_embedding_and_head_tied_across_stages_or_within_one():
    layers = build_gpt(TINY, device="meta")
    shape = (TINY.vocab_size, TINY.d_model)
    assert declared_ties(layers, [2, 2], _names(layers)) == [
        Tie(((0, ("0.token.weight",)), (1, ("3.proj.weight",))), shape)
    ]
    assert declared_ties(layers, [4], _names(layers)) == [
        Tie(((0, ("0.token.weight", "3.proj.weight")),), shape)
    ]


def test_a_declared_tie_on_one_stage_counts_once():
    layers = build_gpt(TINY, device="meta")
    (tie,) = declared_ties(layers, [4], _names(layers))
    params = dict(layers.named_parameters())
    kept = counted([tie], params)
    assert any(p is layers[0].token.weight for p in kept)
    assert all(p is not layers[-1].proj.weight for p in kept)
    assert len(kept) == len(params) - 1


def test_the_gpt_sums_its_copies_through_the_ties_mechanism():
    """``sync_tied_grads_`` is ``sum_local``: a copy without a gradient gets the other's."""
    torch.manual_seed(0)
    layers = build_gpt(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    layers(tokens).square().mean().backward()
    a, b = layers[0].token.weight, layers[-1].proj.weight
    only = b.grad.clone()
    a.grad = None
    sync_tied_grads_(layers[0], layers[-1])
    torch.testing.assert_close(a.grad, only)
    torch.testing.assert_close(b.grad, only)
