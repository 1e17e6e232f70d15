"""Pipeline(tensor_parallel=T): each stage's layers split over T ranks by DTensor styles, with
the losses, gradients and weights of the unsplit model (float64, real processes over gloo)."""

import pytest
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel

from gpipe.parallel.tensor import resolve_plan
from gpipe.schedules import SCHEDULES

from ..workers import run
from . import tensor_cases as cases


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_at_two_tensor_ranks_matches_the_unsplit_model(schedule):
    """T = 2 x K = 2, checkpoint never and always, embedding and head tied across stages:
    the loss, every gathered gradient and the norm equal one step of the unsplit model;
    two AdamW steps leave every weight within 1e-12 of its."""
    results = run(cases.exactness, 4, ((schedule,),), threads=1)
    for r in results.values():
        assert r["cases"] == 2
        assert r["split"] > 0  # some gradients are DTensors on every rank


def test_data_tensor_and_pipeline_together_on_eight_processes():
    """D = 2 x T = 2 x K = 2: replicas whole, and sharded over the data dimension (2-D)."""
    results = run(cases.data_tensor_pipeline, 8, threads=1)
    for r in results.values():
        assert r["whole"] == r["sharded"] == 2
        assert r["split"] > 0


def test_tensor_parallel_composes_with_the_other_options():
    """Uneven and pre-split micro-batches, evaluate, forward_only, seq_chunks; DeferredBatchNorm
    between split layers; bfloat16 autocast with a GradScaler and clipping; greedy generation."""
    results = run(cases.compositions, 4, threads=1)
    assert all(
        r == {"uneven": True, "presplit": True, "forward_only": True, "seq_chunks": True}
        for r in results.values()
    )
    assert all(run(cases.batch_norm, 4, threads=1).values())
    gaps = run(cases.mixed_precision, 4, threads=1)
    assert all(gap < 0.05 for gap in gaps.values()), gaps
    tokens = run(cases.generation, 4, threads=1)
    assert len({repr(t) for t in tokens.values()}) == 1  # every rank returns the same


def test_the_tensor_ranks_of_a_stage_draw_alike_when_processes_are_seeded_apart():
    """Dropout in a step and sampling in generate: different draws on the T ranks of a stage
    would make their whole copies part (each rank's own gradients, its own tokens)."""
    results = run(cases.ranks_draw_alike, 4, threads=1)
    for tensor_rank_1, tensor_rank_0 in ((1, 0), (3, 2)):
        assert results[tensor_rank_1] == results[tensor_rank_0]
    assert results[0]["sampled"] == results[2]["sampled"]  # every rank returns the same


def test_the_loss_over_logits_split_by_vocabulary_equals_the_unsplit_models():
    results = run(cases.vocabulary_parallel_loss, 4, threads=1)
    assert all(r == {"1f1b": True, "zero-bubble": True} for r in results.values())


def test_bad_tensor_parallel_input_is_refused_in_one_line():
    errors = run(cases.bad_inputs, 4, threads=1)
    assert len({tuple(e.values()) for e in errors.values()}) == 1  # every rank alike
    e = errors[0]
    assert all("\n" not in message for message in e.values())
    assert "tensor_parallel=4 does not divide the 2 heads of 1.attn.q" in e["heads"]
    assert "tensor_parallel=2 does not divide the 63 vocabulary of 0.token" in e["vocabulary"]
    assert "world size 4 is not pipeline x data_parallel x tensor_parallel" in e["world"]
    assert "tp_plan['9.mlp.fc'] names no module of the model" in e["no module"]
    assert "tp_plan['1.mlp.fc'] must be one of ['colwise', 'rowwise', 'sequence']" in e["style"]
    assert "got 'diagonal'" in e["style"]
    assert "tensor_parallel must be a positive integer, got 0" in e["size"]
    assert "loss_parallel=True splits the logits" in e["loss parallel alone"]
    assert "splits the copies of a weight tied across stages differently" in e["tie split unlike"]
    assert "0.token.weight: split along dim 0, 3.proj.weight: whole" in e["tie split unlike"]
    assert (
        "tp_plan splits 0 and 1, which share a parameter within one stage"
        in (e["shared in a stage"])
    )
    assert "applies to nn.Linear and nn.Embedding, and 1.ln1 is a LayerNorm" in e["layer type"]


def test_pytorchs_own_styles_are_checked_as_their_names_are():
    """ColwiseParallel() is checked as "colwise" is: a width T does not divide, a module it
    cannot split (each rank failed its own way at the first step, or while splitting)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = nn.Sequential(nn.Linear(16, 31), nn.ReLU(), nn.Linear(31, 16), nn.LayerNorm(16))
    for plan in ({"0": ColwiseParallel(), "2": RowwiseParallel()}, {"0": "colwise"}):
        with pytest.raises(ValueError, match="does not divide the 31 output features of 0"):
            resolve_plan(plan, model, 2)
    with pytest.raises(ValueError, match=r"ColwiseParallel\(\) applies to nn.Linear and nn.Emb"):
        resolve_plan({"3": ColwiseParallel()}, model, 2)


def test_a_model_without_a_plan_is_told_how_to_give_one_in_its_own_names():
    model = nn.Sequential(nn.Embedding(3, 4), nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match=r"config's base_model_tp_plan\); pass tp_plan=\{'1\.0'"):
        resolve_plan(None, model, 2)


def test_a_per_head_norm_left_whole_beside_maps_split_by_heads_is_refused():
    """Its gradient would be each rank's share of it (it sees only that rank's heads): the
    plan must sum it over the ranks, as Qwen3's does and some families' plans forget to."""
    from torch import nn

    from gpipe.parallel.summed_gradients import SummedGradients
    from gpipe.parallel.tensor import resolve_plan

    class Attention(nn.Module):
        head_dim = 4

        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(8, 8)
            self.q_norm = nn.RMSNorm(4)
            self.out_norm = nn.RMSNorm(8)  # as wide as the whole: not one head's

    model = nn.Sequential(Attention())
    refusal = "tp_plan splits 0.q by heads but leaves 0.q_norm whole, whose parameters are one"
    with pytest.raises(ValueError, match=refusal) as caught:
        resolve_plan({"0.q": "colwise"}, model, 2)
    assert "\n" not in str(caught.value) and "SummedGradients()" in str(caught.value)
    summed = resolve_plan({"0.q": "colwise", "0.q_norm": SummedGradients()}, model, 2)
    assert set(summed.styles) == {"0.q", "0.q_norm"}
    gathered = {"0.q": ColwiseParallel(output_layouts=Replicate())}  # the norm sees every head
    assert set(resolve_plan(gathered, model, 2).styles) == {"0.q"}
