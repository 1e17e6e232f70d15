"""The planner's view of tensor parallelism (gpipe.planning.tensor_share): one rank's share
of a model, profiled, holds what a real Pipeline(tensor_parallel=T) rank holds."""

import pytest
import torch

from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss
from gpipe.planning.memory import plan, profile
from gpipe.planning.roofline import Link
from gpipe.planning.tensor_share import collectives, local_share

from ..workers import run
from . import tensor_memory_cases as cases


def _planned(tensor_parallel: int) -> list[float]:
    """Per pipeline rank, the planner's parameters, gradients and AdamW state (bytes)."""
    model = build_gpt(cases.CONFIG, device="meta")
    tokens = torch.zeros(2, cases.CONFIG.seq_len, dtype=torch.long, device="meta")
    prof = profile(local_share(model, tensor_parallel), tokens, target=tokens, loss_fn=lm_loss)
    result = plan(
        prof, cases.BALANCE, batch_size=cases.BATCH, chunks=cases.CHUNKS, optimizer="adamw"
    )
    return [r.param_bytes + r.state_bytes for r in result.ranks]


def test_planned_states_per_rank_match_a_real_tensor_parallel_run():
    """K = 2 x T = 2 on 4 processes against K = 2 on 2: the worst rank's parameters,
    gradients and AdamW state as planned are within 10% of those measured (DTensors counted
    by their local shards), and at most 0.55 of the unsplit run's worst rank."""
    split = run(cases.held_bytes, 4, (2,), threads=1)
    whole = run(cases.held_bytes, 2, (1,), threads=1)
    measured = {
        t: max(sum(v for k, v in r.items() if k != "stage") for r in got.values())
        for t, got in ((1, whole), (2, split))
    }
    assert measured[2] <= 0.55 * measured[1]
    planned = max(_planned(2))
    assert abs(planned - measured[2]) <= 0.10 * measured[2]
    assert abs(max(_planned(1)) - measured[1]) <= 0.10 * measured[1]


def test_a_share_splits_the_heads_and_mlp_and_keeps_norms_and_positions_whole():
    config = GPTConfig(n_layer=1, d_model=64, n_head=4, vocab_size=128, seq_len=16)
    share = local_share(build_gpt(config, device="meta"), 2)
    block = share[1]
    assert block.attn.q.weight.shape == (32, 64) and block.attn.q.bias.shape == (32,)
    assert block.attn.proj.weight.shape == (64, 32) and block.attn.proj.bias.shape == (64,)
    assert block.mlp.fc.weight.shape == (128, 64) and block.mlp.proj.weight.shape == (64, 128)
    assert block.ln1.weight.shape == (64,)
    assert share[0].token.weight.shape == (64, 64) and share[0].position.shape == (16, 64)
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    assert share(tokens).shape == (2, 16, 128)  # the head's logits gathered whole


def test_a_share_that_does_not_divide_the_heads_is_refused_naming_them():
    config = GPTConfig(n_layer=1, d_model=64, n_head=4, vocab_size=120, seq_len=16)
    with pytest.raises(ValueError, match="does not divide the 4 heads"):
        local_share(build_gpt(config, device="meta"), 3)


def test_each_block_all_reduces_twice_a_pass_and_the_head_gathers_its_logits():
    config = GPTConfig(n_layer=1, d_model=64, n_head=4, vocab_size=128, seq_len=16)
    found = collectives(build_gpt(config, device="meta"), 2)
    assert found.forward_reduce == ((64,), (64, 64), ())
    assert found.backward_reduce == ((), (64, 64), (64,))
    assert found.forward_gather == ((), (), (128,))
    link = Link(bandwidth=1e9, latency=0.0)
    forward, backward = found.seconds(1, 16, link, 2)
    assert forward == backward == pytest.approx(2 * link.ring(16 * 64 * 4, 2, passes=2))


class _Experts(torch.nn.Module):
    """Stacked experts as transformers 5 stores them: (experts, 2 x width, hidden) and
    (experts, hidden, width)."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.empty(4, 2 * 12, 8))
        self.down_proj = torch.nn.Parameter(torch.empty(4, 8, 12))

    def forward(self, x):
        gate, up = torch.nn.functional.linear(x, self.gate_up_proj[0]).chunk(2, dim=-1)
        return torch.nn.functional.linear(gate * up, self.down_proj[0])


def test_a_share_splits_stacked_experts_and_a_rowwise_map_takes_a_whole_input():
    """Stacked experts were left whole (every expert counted on every rank), and a rowwise
    map whose style splits its input (Phi-3's and OLMo 2's output maps, after gathering
    ones) got a split-width map fed the whole input, which no profile could run."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from gpipe.parallel.experts import ExpertsParallel

    layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), _Experts())
    tp_plan = {
        "0": ColwiseParallel(output_layouts=Replicate()),
        "1": RowwiseParallel(input_layouts=Replicate()),
        "2": ExpertsParallel(packed=["gate_up_proj"], rows=["down_proj"]),
    }
    share = local_share(layers, 2, tp_plan)
    assert share[1].weight.shape == (8, 8) and share[1].bias.shape == (8,)
    assert share[2].gate_up_proj.shape == (4, 12, 8) and share[2].down_proj.shape == (4, 8, 6)
    assert share(torch.zeros(3, 8, device="meta")).shape == (3, 8)
