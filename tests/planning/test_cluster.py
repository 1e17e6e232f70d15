"""A cluster step predicted: the simulator's steady state extended exactly, memory and time
moving the right way with each setting, and layouts that cannot run refused in one line."""

import dataclasses
from pathlib import Path

import pytest

from gpipe.planning.cluster import predict
from gpipe.planning.cluster_layout import Layout
from gpipe.planning.cluster_search import Search, SearchSpace, estimate, search
from gpipe.planning.cluster_step import StepModel, kinds_per_stage
from gpipe.planning.hardware import parse_cluster
from gpipe.planning.hf_config import from_hf_config
from gpipe.planning.layer_costs import Work, attention_costs
from gpipe.planning.replay import simulate
from gpipe.planning.roofline import Link
from gpipe.planning.transformer import TransformerShape, gpt_shape
from gpipe.schedules import build

SHAPE = gpt_shape(16, 2048, 16, 51200)


def _layout(**changes) -> Layout:
    base = Layout(parse_cluster("64xA100-80GB"), 8, 2, 4, 320, 1, 2048, "1f1b", 1, "full")
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    "schedule, v", [("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1), ("zero-bubble-v", 2)]
)
def test_a_long_step_is_the_steady_state_extended(schedule, v):
    """M = 40 micro-batches on K = 4 are simulated at 8 and 12 and extended: the same step
    time and activations as simulating all 40."""
    layout = _layout(schedule=schedule, virtual_stages=v, stack="megatron-core")
    got = predict(SHAPE, layout)
    model = StepModel.of(SHAPE, layout)
    whole = simulate(build(schedule, 4, 40, v), model.costs(), data_parallel=8)
    optimizer = model.optimizer_seconds()
    assert got.step_time_s - optimizer == pytest.approx(whole.makespan, rel=1e-9)
    memory = model.peak_memory(list(whole.peak_rank_activation_bytes))
    assert got.memory.total == pytest.approx(memory.total, rel=1e-9)


@pytest.mark.parametrize("m", [16, 64])
def test_a_v_that_settles_late_is_simulated_until_it_does(monkeypatch, m):
    """A V on two processes whose first rounds run faster than its busiest process can keep
    up (the step grows by 0.252 s a round at 6 and 8 micro-batches, by 0.259 from 12 on):
    extended from its first rounds, the step came out 1.2 % short and its bubble negative.
    At M = 16 it is simulated whole; at M = 64 extended from where it settled."""
    import gpipe.planning.cluster as cluster  # to see whether the step was extended

    extended = []
    original = cluster._extended
    monkeypatch.setattr(cluster, "_extended", lambda *a: extended.append(a) or original(*a))
    shape = gpt_shape(64, 2048, 32, 51200)
    layout = Layout(parse_cluster("16xA100-80GB"), 2, 4, 2, 4 * m, 2, 2048, "zero-bubble-v", 2)
    got = predict(shape, layout)
    assert len(extended) == (m == 64)
    model = StepModel.of(shape, layout)
    whole = simulate(build("zero-bubble-v", 2, m, 2), model.costs(), data_parallel=2)
    assert got.step_time_s - model.optimizer_seconds() == pytest.approx(whole.makespan, rel=1e-9)
    assert got.bubble == pytest.approx(whole.bubble, abs=1e-9)
    assert got.bubble > 0


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 4), ("zero-bubble-v", 2)])
def test_one_process_s_long_step_is_extended_too(monkeypatch, schedule, v):
    """On K = 1 every micro-batch adds the same time from the second on: a step of many
    micro-batches (a search over a large batch on few GPUs) is extended, not simulated
    micro-batch by micro-batch, and comes out as the whole simulation."""
    import gpipe.planning.cluster as cluster

    extended = []
    original = cluster._extended
    monkeypatch.setattr(cluster, "_extended", lambda *a: extended.append(a) or original(*a))
    layout = _layout(data_parallel=32, stages=1, global_batch=32 * 40)
    layout = dataclasses.replace(layout, schedule=schedule, virtual_stages=v, recompute="none")
    got = predict(SHAPE, layout)
    assert extended
    model = StepModel.of(SHAPE, layout)
    whole = simulate(build(schedule, 1, 40, v), model.costs(), data_parallel=32)
    assert got.step_time_s - model.optimizer_seconds() == pytest.approx(whole.makespan, rel=1e-9)
    memory = model.peak_memory(list(whole.peak_rank_activation_bytes))
    assert got.memory.total == pytest.approx(memory.total, rel=1e-9)


def test_recomputation_trades_memory_for_time():
    none, selective, full = (
        predict(SHAPE, _layout(recompute=r)) for r in ("none", "selective", "full")
    )
    assert none.memory.activations > selective.memory.activations > full.memory.activations
    assert none.step_time_s < selective.step_time_s < full.step_time_s
    # recomputed FLOPs count in Megatron's TFLOP/s, not in MFU
    assert full.tflops_per_gpu / full.mfu > none.tflops_per_gpu / none.mfu


def test_flash_attention_keeps_no_scores_to_recompute():
    none, selective = (
        predict(SHAPE, _layout(recompute=r, stack="megatron-core")) for r in ("none", "selective")
    )
    assert none.memory.activations == selective.memory.activations
    assert none.step_time_s == pytest.approx(selective.step_time_s)
    # and so no recomputed FLOPs count in its TFLOP/s: the same rate at the same speed
    assert none.tflops_per_gpu == pytest.approx(selective.tflops_per_gpu)


def test_sharding_splits_the_optimizer_over_the_replicas():
    whole = predict(SHAPE, _layout())
    sharded = predict(SHAPE, _layout(shard="optimizer"))
    assert sharded.memory.optimizer == pytest.approx(whole.memory.optimizer / 8)
    assert sharded.memory.weights == whole.memory.weights


def test_tensor_parallelism_across_nodes_is_slower_than_within():
    within = predict(SHAPE, _layout(data_parallel=4, tensor_parallel=8, stages=2))
    across = predict(SHAPE, _layout(data_parallel=2, tensor_parallel=16, stages=2))
    assert across.tp_comm_s > 5 * within.tp_comm_s


def test_the_figures_are_consistent():
    p = predict(SHAPE, _layout())
    hardware, model = StepModel.of(SHAPE, p.layout).flops()
    assert p.tflops_per_gpu == pytest.approx(hardware / p.step_time_s / 64 / 1e12)
    assert p.mfu == pytest.approx(model / p.step_time_s / 64 / 312e12)
    assert p.memory_per_gpu_gib == pytest.approx(p.memory.gib()["total"])
    assert 0 < p.bubble < 0.3 and p.fits()  # the head makes the last stage the slowest


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"data_parallel": 4}, "D 4 x T 2 x K 4 = 32 GPUs, but the cluster has 64"),
        ({"global_batch": 300}, "--global-batch 300 does not divide into D 8 replicas"),
        ({"tensor_parallel": 32, "data_parallel": 1, "stages": 2}, "must divide the 16"),
        ({"stages": 32, "data_parallel": 1}, "32 pipeline stages"),
        ({"schedule": "interleaved", "virtual_stages": 2, "global_batch": 48}, "a multiple"),
        ({"shard": "optimizer", "data_parallel": 1, "stages": 32}, "32 pipeline stages"),
    ],
)
def test_a_layout_that_cannot_run_is_refused_in_one_line(changes, message):
    with pytest.raises(ValueError, match=message) as error:
        predict(SHAPE, _layout(**changes))
    assert "\n" not in str(error.value)


EVERY_SCHEDULE = ("gpipe", "1f1b", "zero-bubble", "interleaved", "interleaved-zero-bubble")
EVERY_SCHEDULE += ("looped-bfs", "zero-bubble-v", "dualpipe-v", "v-half", "v-min")


def _llama_405b() -> TransformerShape:
    return from_hf_config(
        Path(__file__).resolve().parents[2] / "benchmarks/cluster/llama-3.1-405b.json"
    )


@pytest.fixture(scope="module")
def llama_search():
    """Llama 3.1 405B at 8,192 tokens on 1,024 H100s, T = 8 and K = 16 pinned (the search
    of the worked example in docs/planning.md, narrowed to be quick): the default search,
    and the search of the schedules given."""
    shape, cluster = _llama_405b(), parse_cluster("1024xH100-SXM")

    def run(*schedules: str) -> Search:
        space = SearchSpace(tensor_parallel=[8], stages=[16], micro_batches=(1,))
        if schedules:
            space = dataclasses.replace(space, schedules=schedules)
        return search(shape, cluster, 512, 8192, space)

    return run


@pytest.mark.parametrize("schedule", EVERY_SCHEDULE)
def test_the_search_finds_a_layout_as_fast_as_any_schedule_pinned(llama_search, schedule):
    """The search leaves out only schedules another dominates: its fastest is at least as
    fast as the fastest of any schedule a user could pin. Here V-Half, holding half of
    1F1B's activations, fits without recomputation and beats every schedule that must
    recompute."""
    default = llama_search()
    pinned = llama_search(schedule)
    assert default.best and pinned.best
    assert default.best[0].step_time_s <= pinned.best[0].step_time_s * (1 + 1e-9)
    if schedule == "v-half":
        assert default.best[0].layout.schedule == "v-half"


@pytest.mark.parametrize("schedule", ["v-half", "v-min"])
def test_a_capped_v_is_estimated_near_its_simulation(llama_search, schedule):
    """V-Half and V-Min have no closed-form bubble; the search's estimate simulates their
    order at the layout's costs, so it ranks them near where the simulator puts them (a
    looped formula would promise half their bubble and crowd out the layouts simulated)."""
    best = llama_search(schedule).best[0]
    assert estimate(_llama_405b(), best.layout).step_s == pytest.approx(best.step_time_s, rel=0.05)


# Mistral 7B's shapes, over a sliding window of 4,096 tokens on every block or none
MISTRAL = TransformerShape("mistral", 32, 4096, 32, 8, 128, 14336, 32000, gated=True)
MISTRAL_SWA = dataclasses.replace(MISTRAL, windows=(4096,) * 32)


def _long(seq_len: int = 32768, **changes) -> Layout:
    base = Layout(parse_cluster("8xH100-SXM"), 1, 8, 1, 8, 1, seq_len, "1f1b", 1, "full")
    return dataclasses.replace(base, **changes)


def test_a_sliding_window_makes_a_long_sequence_cheaper_by_its_flops():
    """At 32,768 tokens a window of 4,096 counts ``2 w - w^2 / s`` = 7,680 keys a query
    (0.234 of the square) and FlashAttention runs the band's 3,840 and an edge block's 64
    instead of the triangle's 16,384 and 64 (0.237): the step is faster, and its model
    FLOPs fall by the keys no longer counted, 0.581 of the full model's."""
    s, tokens, q_v = 32768, 8 * 32768, 2 * 4096
    full, swa = predict(MISTRAL, _long()), predict(MISTRAL_SWA, _long())
    assert swa.step_time_s < 0.75 * full.step_time_s
    (hw_full, model_full), (hw_swa, model_swa) = (
        StepModel.of(shape, _long()).flops() for shape in (MISTRAL, MISTRAL_SWA)
    )
    saved = tokens * 32 * 2 * (s - 7680) * q_v  # one forward's
    assert model_full - model_swa == pytest.approx(3 * saved, rel=1e-12)
    assert hw_full - hw_swa == pytest.approx(4 * saved, rel=1e-12)  # full recomputation
    assert model_swa / model_full == pytest.approx(0.5811, abs=1e-4)
    # the attention core's forward: FlashAttention's executed products in the ratio of keys
    layout = _long()
    core = _attention_forward(MISTRAL, layout, None), _attention_forward(MISTRAL, layout, 4096)
    assert core[1] / core[0] == pytest.approx((3840 + 64) / (16384 + 64), rel=1e-12)


def _attention_forward(shape: TransformerShape, layout: Layout, window: int | None) -> float:
    """The attention core's forward seconds on one GPU of the layout's group."""
    device, t = layout.cluster.device, layout.tensor_parallel
    link = Link.of_group(device, t)
    work = Work(device, t, layout.micro_batch, layout.seq_len, link, layout.recompute)
    return attention_costs(shape, work, window)[0]


@pytest.mark.parametrize("stack", ["megatron-core", "megatron-2021"])
def test_a_window_as_long_as_the_sequence_costs_exactly_full_attention(stack):
    windowed = dataclasses.replace(MISTRAL, windows=(4096,) * 13 + (8192,) * 19)
    for recompute in ("none", "selective", "full"):
        layout = _long(4096, recompute=recompute, stack=stack, global_batch=16)
        assert predict(windowed, layout) == predict(MISTRAL, layout)


def test_unfused_attention_computes_and_keeps_the_whole_square_under_a_window():
    """The unfused products and softmax run over every score and mask those outside the
    window: the same time and memory, though fewer FLOPs count."""
    layout = _long(8192, stack="megatron-2021", recompute="selective", global_batch=16)
    full, swa = predict(MISTRAL, layout), predict(MISTRAL_SWA, layout)
    assert (swa.step_time_s, swa.memory) == (full.step_time_s, full.memory)
    assert swa.mfu < full.mfu


def test_gemma_2s_alternate_windows_fall_where_their_blocks_do():
    """Gemma 2's window on its even blocks: cut in two stages of 13, the first holds 7 of
    them, the second 6, and each stage costs its blocks of each kind."""
    gemma = TransformerShape("gemma-2", 26, 2304, 8, 4, 256, 9216, 256000, gated=True)
    gemma = dataclasses.replace(gemma, tied=True, windows=(4096, None) * 13)
    kinds = kinds_per_stage(gemma, 2)
    assert kinds == {(False, None): [6, 7], (True, None): [0, 0], (False, 4096): [7, 6]}
    layout = _long(16384, stages=2, tensor_parallel=4)
    model = StepModel.of(gemma, layout)
    full = StepModel.of(dataclasses.replace(gemma, windows=()), layout)
    per_block = (full.stages[0].forward - model.stages[0].forward) / 7
    assert per_block > 0
    assert full.stages[1].forward - model.stages[1].forward == pytest.approx(6 * per_block)
    assert model.flops()[1] < full.flops()[1]


def test_a_step_is_simulated_whole_where_another_pair_would_cost_more(monkeypatch):
    """The late-settling V of the test above at M = 16: its pairs at 4 and 6 micro-batches do
    not settle, and the next pair (8 and 10: 18 micro-batches) costs more than the whole step,
    so the step is simulated whole at 16 (it was simulated at 8 and 10 first, then whole:
    the search's V-Half and V-Min on 32 processes built and replayed 128 and 160 micro-batches
    before the whole 256). The step is the whole simulation's."""
    import gpipe.planning.cluster as cluster  # to see which lengths it simulates

    lengths = []
    original = cluster.build
    monkeypatch.setattr(
        cluster, "build", lambda s, k, n, v: lengths.append(n) or original(s, k, n, v)
    )
    shape = gpt_shape(64, 2048, 32, 50304)  # not the test above's: a step it has not cached
    layout = Layout(parse_cluster("16xA100-80GB"), 2, 4, 2, 64, 2, 2048, "zero-bubble-v", 2)
    got = predict(shape, layout)
    assert lengths == [4, 6, 16]
    model = StepModel.of(shape, layout)
    whole = simulate(build("zero-bubble-v", 2, 16, 2), model.costs(), data_parallel=2)
    assert got.step_time_s - model.optimizer_seconds() == pytest.approx(whole.makespan, rel=1e-9)
