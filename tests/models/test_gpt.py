"""The reference GPT: configuration, shapes, causality, initialization and tied weights."""

import math

import pytest
import torch

from gpipe.models import (
    PRESETS,
    Block,
    Embedding,
    GPTConfig,
    Head,
    build_gpt,
    config_from_preset,
    count_parameters,
    generate,
    lm_loss,
    sync_tied_grads_,
    tie_,
    tied_weights,
)
from gpipe.runtime.partitions import layer_seed, materialize

TINY = PRESETS["tiny"]


def tokens(batch: int, length: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"d_model": 30, "n_head": 4}, r"d_model must be divisible by n_head.*d_model=30"),
        ({"n_layer": 0}, r"n_layer must be a positive integer, got 0"),
        ({"vocab_size": 2.5}, r"vocab_size must be a positive integer, got 2.5"),
        ({"seq_len": True}, r"seq_len must be a positive integer, got True"),
        ({"d_ff": -1}, r"d_ff must be a positive integer, got -1"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0"),
        ({"dropout": "0.1"}, r"dropout must be a number"),
        ({"tied": 1}, r"tied must be a bool, got 1"),
    ],
)
def test_bad_config_is_explained(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**fields)


def test_d_ff_defaults_to_four_times_d_model():
    assert GPTConfig(d_model=64, n_head=2).ff_dim == 256
    assert GPTConfig(d_model=64, n_head=2, d_ff=100).ff_dim == 100
    assert config_from_preset("small", d_model=64).ff_dim == 256


def test_config_round_trips_through_a_dict():
    config = GPTConfig(n_layer=3, d_model=48, n_head=3, dropout=0.1, tied=False)
    assert GPTConfig.from_dict(config.to_dict()) == config


def test_from_dict_refuses_unknown_keys():
    with pytest.raises(ValueError, match=r"no fields \['n_embd'\].*expected some of"):
        GPTConfig.from_dict({"n_layer": 2, "n_embd": 64})


def test_presets_and_their_errors():
    assert config_from_preset("tiny", n_layer=3) == GPTConfig(
        n_layer=3, d_model=32, n_head=2, seq_len=32
    )
    with pytest.raises(ValueError, match=r"unknown preset 'huge'.*'small'"):
        config_from_preset("huge")
    with pytest.raises(ValueError, match=r"no fields \['layers'\]"):
        config_from_preset("tiny", layers=3)
    assert 0.9e9 < count_parameters(PRESETS["1b"]) < 1.1e9


@pytest.mark.parametrize("tied", [True, False])
def test_meta_count_equals_materialized_count(tied):
    config = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=50, tied=tied)
    meta = build_gpt(config, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    every = sum(p.numel() for p in build_gpt(config).parameters())
    assert count_parameters(config, tied_once=False) == every
    expected = every - 50 * 32 if tied else every
    assert count_parameters(config) == expected


def test_layers_and_shapes():
    model = build_gpt(TINY)
    assert len(model) == TINY.n_layer + 2
    assert isinstance(model[0], Embedding)
    assert all(isinstance(layer, Block) for layer in model[1:-1])
    assert isinstance(model[-1], Head)
    x = tokens(3, 20)
    hidden = model[0](x)
    assert hidden.shape == (3, 20, TINY.d_model)
    assert model[1](hidden).shape == hidden.shape
    assert model(x).shape == (3, 20, TINY.vocab_size)


def test_no_parameter_is_shared_between_layers():
    model = build_gpt(TINY)
    owners = [{id(p) for p in layer.parameters()} for layer in model]
    assert sum(len(o) for o in owners) == len(set().union(*owners))


def test_a_later_token_does_not_change_earlier_logits():
    torch.manual_seed(0)
    model = build_gpt(TINY).eval()
    x = tokens(2, 16)
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    before, after = model(x), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_embedding_refuses_sequences_longer_than_seq_len():
    with pytest.raises(ValueError, match=r"33 tokens.*seq_len 32"):
        Embedding(TINY)(tokens(1, 33))


def test_tied_copies_start_equal_whatever_the_global_seed():
    layers = list(build_gpt(TINY, device="meta"))
    first, last = 0, len(layers) - 1
    for index, seed in ((first, 1), (last, 2)):
        layers[index].to_empty(device="cpu")
        torch.manual_seed(seed)
        layers[index].reset_parameters()
    torch.testing.assert_close(layers[last].proj.weight, layers[first].token.weight, rtol=0, atol=0)
    assert tied_weights(layers) == [(first, "token.weight", last, "proj.weight")]


def test_materialize_keeps_the_init_of_every_layer():
    """materialize() calls every module's reset_parameters, parents first: PyTorch's default
    init of the leaves must not overwrite the layer's own."""
    direct = build_gpt(TINY, device="meta")
    for index, layer in enumerate(direct):
        layer.to_empty(device="cpu")
        torch.manual_seed(layer_seed(3, index))
        layer.reset_parameters()
    meta = build_gpt(TINY, device="meta")
    staged = [materialize(layer, i, torch.device("cpu"), seed=3) for i, layer in enumerate(meta)]
    for a, b in zip(direct, staged, strict=True):
        for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(staged[-1].proj.weight, staged[0].token.weight, rtol=0, atol=0)


def test_materialize_gives_gpt2_init():
    layer = materialize(build_gpt(TINY, device="meta")[1], 1, torch.device("cpu"), seed=0)
    for projection in (layer.attn.q, layer.attn.k, layer.attn.v):
        assert abs(projection.weight.std().item() - 0.02) < 0.006
        assert not projection.bias.any()
    residual = 0.02 / math.sqrt(2 * TINY.n_layer)
    assert abs(layer.mlp.proj.weight.std().item() - residual) < 0.002
    assert torch.equal(layer.ln1.weight, torch.ones(TINY.d_model))


def test_reset_parameters_is_deterministic_under_a_seed():
    block = Block(TINY)
    states = []
    for _ in range(2):
        torch.manual_seed(7)
        block.reset_parameters()
        states.append({k: v.clone() for k, v in block.state_dict().items()})
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=0, atol=0)


def test_untied_head_is_independent_of_the_embedding():
    config = GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16, tied=False)
    model = build_gpt(config)
    assert not torch.equal(model[-1].proj.weight, model[0].token.weight)
    assert tied_weights(model) == []


def test_loss_at_init_is_about_uniform():
    torch.manual_seed(0)
    model = build_gpt(TINY)
    x = tokens(4, 32)
    loss = lm_loss(model(x), tokens(4, 32, seed=1))
    assert abs(loss.item() - math.log(256)) < 0.3


def test_tied_grads_are_summed_and_training_lowers_the_loss():
    torch.manual_seed(0)
    model = build_gpt(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = tokens(8, 32) % 16  # a small alphabet, learnable in a few steps
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        expected = model[0].token.weight.grad + model[-1].proj.weight.grad
        sync_tied_grads_(model[0], model[-1])
        torch.testing.assert_close(model[0].token.weight.grad, expected)
        torch.testing.assert_close(model[-1].proj.weight.grad, expected)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    torch.testing.assert_close(model[-1].proj.weight, model[0].token.weight)


def test_tie_copies_the_embedding_into_the_head():
    embedding, head = Embedding(TINY), Head(TINY)
    with torch.no_grad():
        embedding.token.weight.add_(1)
    tie_(embedding, head)
    assert torch.equal(head.proj.weight, embedding.token.weight)
    assert head.proj.weight is not embedding.token.weight


def test_generate_appends_tokens_deterministically():
    torch.manual_seed(0)
    model = build_gpt(TINY).eval()
    prompt = tokens(1, 5)
    runs = [
        generate(
            model, prompt, 40, TINY.seq_len, top_k=10, generator=torch.Generator().manual_seed(3)
        )
        for _ in range(2)
    ]
    assert runs[0].shape == (1, 45)
    assert torch.equal(runs[0][:, :5], prompt)
    assert int(runs[0].max()) < TINY.vocab_size
    assert torch.equal(runs[0], runs[1])


def test_generate_crops_the_context_to_seq_len():
    seen = []

    def model(x):
        seen.append(x.shape[1])
        return torch.zeros(1, x.shape[1], 4)

    generate(model, torch.zeros(1, 3, dtype=torch.long), 5, seq_len=4)
    assert seen == [3, 4, 4, 4, 4]
    with pytest.raises(ValueError, match="temperature must be positive, got 0"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 1, 4, temperature=0)
