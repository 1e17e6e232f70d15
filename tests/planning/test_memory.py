"""The memory planner: its predictions against what a run holds, measured in real processes,
and its accounting of parameters and optimizer state against real optimizers."""

import functools
import threading

import pytest
import torch
from torch import nn

from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss
from gpipe.planning.memory import (
    OPTIMIZER_STATES,
    ActivationMeter,
    plan,
    profile,
    sub_sequence_carry,
)
from gpipe.runtime.partitions import stage_bounds
from gpipe.schedules import Placement, traits

from .. import distributed_cases as cases
from ..workers import run


@functools.cache
def _profiled(name: str):
    """A memory workload's model and mini-batch, and its meta profile on 4 rows: profiled
    once per module, as every case that plans for the workload plans from the same one."""
    model, x, y, loss_fn = cases.memory_workload(name, device="meta")
    prof = profile(model, x[:4].to("meta"), target=y[:4].to("meta"), loss_fn=loss_fn)
    return model, x, prof


@pytest.fixture(scope="module", params=["mlp", "gpt", "unet"])
def measured(request):
    return request.param, run(cases.measured_memory, 2, (request.param,), threads=1)


@pytest.mark.parametrize("schedule", cases.MEMORY_SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_predicted_activations_match_a_measured_step(measured, schedule, checkpoint):
    """Profiled on the meta device (no memory, no compute), predicted for each process."""
    name, by_rank = measured
    model, x, prof = _profiled(name)
    predicted = plan(
        prof,
        cases.memory_balance(len(model), schedule),
        batch_size=x.size(0),
        chunks=8,
        schedule=schedule,
        checkpoint=checkpoint,
        n_ranks=2,
    )
    # at a V's turn (stages 1 and 2 on process 1) under re-materialization, the planner may
    # be off by the one tensor the two stages hand each other
    turn = 0.0
    if traits(schedule).placement is Placement.V and checkpoint != "never":
        start, stop = stage_bounds(cases.memory_balance(len(model), schedule))[2]
        turn = prof.held(start, stop, x.size(0) // 8)[1]
    for rank in (0, 1):
        got = by_rank[rank][f"{schedule}/{checkpoint}"]
        want = predicted.ranks[rank].activation_bytes
        print(f"{name} {schedule}/{checkpoint} rank {rank}: {want:.0f} predicted, {got} measured")
        # exact for the MLP and the GPT; skips shared within a process are approximated
        if abs(want - got) > turn:
            assert want == pytest.approx(got, rel=0.10 if name == "unet" else 0.01)


def test_predicted_activations_of_sub_sequences_match_a_measured_step():
    """seq_chunks=4: profiled on one sub-sequence, with the keys and values each one carries
    to the next (what a re-materialized one keeps beside its input), predicted per process
    for gpipe, 1F1B, zero-bubble and zero-bubble-v in every mode, against a measured step."""
    measured = run(cases.measured_sub_sequence_memory, 2, threads=1)
    model = build_gpt(GPTConfig(**cases.SUB_SEQUENCE_GPT), device="meta")
    sub_sequence = torch.zeros(4, 256 // 4, dtype=torch.int64, device="meta")
    prof = profile(model, sub_sequence, target=sub_sequence, loss_fn=lm_loss)
    carry = sub_sequence_carry(model, sub_sequence)
    # each block hands on its keys and values: 2 x 64 tokens x 64 wide, float32, per row
    assert carry == [0.0, *[2 * 64 * 64 * 4.0] * 4, 0.0]
    for key, _ in measured[0].items():
        schedule, checkpoint = key.split("/")
        predicted = plan(
            prof,
            cases.SUB_SEQUENCE_BALANCES[schedule],
            n_ranks=2,
            batch_size=8,
            chunks=4,
            schedule=schedule,
            checkpoint=checkpoint,
            seq_chunks=4,
            carry_bytes=carry,
        )
        for rank in (0, 1):
            want = predicted.ranks[rank].activation_bytes
            assert want == pytest.approx(measured[rank][key], rel=0.01), (key, rank)
    with pytest.raises(ValueError, match="with re-materialization needs carry_bytes="):
        plan(prof, [3, 3], batch_size=8, chunks=4, schedule="1f1b", seq_chunks=4)


def test_recomputation_holds_a_fraction_of_the_activations():
    prof = _profiled("gpt")[2]
    kept = {
        mode: plan(prof, [3, 3], batch_size=32, chunks=8, checkpoint=mode).ranks[0]
        for mode in ("never", "always")
    }
    assert kept["always"].activation_bytes < 0.25 * kept["never"].activation_bytes
    assert kept["always"].peak_live == kept["never"].peak_live == 8


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZER_STATES))
def test_optimizer_state_is_counted_as_the_optimizer_allocates_it(optimizer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adagrad": lambda p: torch.optim.Adagrad(p),
        "rmsprop": lambda p: torch.optim.RMSprop(p),
        "adam": lambda p: torch.optim.Adam(p),
        "adamw": lambda p: torch.optim.AdamW(p),
    }[optimizer]
    opt = make(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    state = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # Adam's step counters are scalars
    )
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    prof = profile(model, torch.randn(2, 16))
    predicted = plan(prof, [1, 1], batch_size=2, chunks=1, optimizer=optimizer)
    assert sum(r.state_bytes for r in predicted.ranks) == state + grads
    assert sum(r.param_bytes for r in predicted.ranks) == grads
    assert sum(r.params for r in predicted.ranks) == 16 * 32 + 32 + 32 * 4 + 4


def test_a_meta_profile_matches_a_real_one():
    config = GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=32)
    tokens = torch.randint(0, 256, (4, 32))
    real = profile(build_gpt(config), tokens, target=tokens, loss_fn=lm_loss)
    meta = profile(
        build_gpt(config, device="meta"),
        tokens.to("meta"),
        target=tokens.to("meta"),
        loss_fn=lm_loss,
    )
    for start, stop in [(0, 1), (0, 4), (1, 3), (3, 4)]:
        assert meta.held(start, stop, 8) == real.held(start, stop, 8)


def test_the_meter_counts_each_storage_once_and_leaves_out_parameters():
    layer = nn.Sequential(nn.Linear(8, 8, bias=False))
    x = torch.randn(4, 8, requires_grad=True)
    with ActivationMeter(layer) as meter:
        y = layer(x)
        z = y * y  # saves y twice: one storage
    assert meter.peak == 2 * 4 * 8 * 4  # x (input, saved) and y (output, saved)
    assert meter.saved_peak == meter.peak
    del z


def test_the_meter_sees_layers_run_on_other_threads():
    """GPipe runs partitions on worker threads, where a saved-tensor hook installed by the
    caller would see nothing: each stage's meter must count what its layers save there."""
    from gpipe import GPipe

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)))
    x = torch.randn(16, 8)

    def peaks(run) -> list[int]:
        meters = [ActivationMeter(model[0:2]), ActivationMeter(model[2:4])]
        with meters[0], meters[1]:
            out = run(x)
        out.sum().backward()
        return [m.saved_peak for m in meters]

    plain = peaks(model)
    # two distinct CPU devices: the first partition gets a worker thread of its own
    pipe = GPipe(model, [2, 2], devices=["cpu:0", "cpu"], chunks=4, checkpoint="never")
    ran_on = []
    hook = model[0].register_forward_hook(lambda *_: ran_on.append(threading.current_thread()))
    piped = peaks(pipe)
    hook.remove()
    assert ran_on and all(t is not threading.main_thread() for t in ran_on)
    assert plain[0] > 0 and plain[1] > 0
    assert piped == plain  # no re-materialization: all 4 micro-batches held, as one batch


def test_replicas_each_hold_their_share_and_the_all_reduce_buckets():
    prof = _profiled("gpt")[2]
    alone = plan(prof, [3, 3], batch_size=16, chunks=4, checkpoint="always")
    shared = plan(prof, [3, 3], batch_size=32, chunks=4, checkpoint="always", data_parallel=2)
    for one, two in zip(alone.ranks, shared.ranks, strict=True):
        assert two.activation_bytes == one.activation_bytes  # 16 of the 32 rows each
        assert two.allreduce_bytes == one.param_bytes  # a copy of every gradient
        assert 0 < two.last_graph_bytes <= two.activation_bytes
        during = max(two.activation_bytes, two.allreduce_bytes + two.last_graph_bytes)
        assert two.total_bytes == pytest.approx(one.param_bytes + one.state_bytes + during)
        assert one.allreduce_bytes == 0 and one.total_bytes < two.total_bytes
    with pytest.raises(ValueError, match="data_parallel must be a positive integer, got 0"):
        plan(prof, [3, 3], batch_size=8, chunks=2, data_parallel=0)
    with pytest.raises(ValueError, match="batch_size 2 cannot give each of 4 replicas a row"):
        plan(prof, [3, 3], batch_size=2, chunks=2, data_parallel=4)


def test_bad_plans_are_named():
    prof = profile(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), torch.randn(2, 4))
    with pytest.raises(ValueError, match="optimizer must be one of"):
        plan(prof, [1, 1], batch_size=2, chunks=1, optimizer="lion")
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        plan(prof, [1, 1], batch_size=0, chunks=1)
    with pytest.raises(ValueError, match="balance"):
        plan(prof, [1, 2], batch_size=2, chunks=1)
    with pytest.raises(ValueError, match="checkpoint is not one of"):
        plan(prof, [1, 1], batch_size=2, chunks=1, checkpoint="sometimes")


@pytest.fixture(scope="module")
def measured_layers():
    return run(cases.measured_layer_memory, 2, ("mlp",), threads=1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_layers_recomputed_selectively_hold_what_the_planner_says(measured_layers, schedule):
    """Recomputing every layer holds less than every other one, which holds less than none.
    The planner adds what one recomputed layer holds again inside its backward, which the
    meter cannot see (it happens inside torch.utils.checkpoint): measured <= predicted <=
    measured + that."""
    from gpipe.runtime.recompute import Layers

    model, x, prof = _profiled("mlp")
    balance = cases.memory_balance(len(model), schedule)
    rows = x.size(0) // 8
    for rank in (0, 1):
        got = [measured_layers[rank][f"{schedule}/every-{k}"] for k in (1, 2)]
        assert got[0] < got[1]
        for k, measured in zip((1, 2), got, strict=True):
            predicted = plan(
                prof,
                balance,
                batch_size=x.size(0),
                chunks=8,
                schedule=schedule,
                checkpoint=Layers(every=k),
                n_ranks=2,
            ).ranks[rank]
            start = sum(balance[:rank])
            picked = frozenset(i for i in range(start, start + balance[rank]) if i % k == 0)
            again = prof.held(start, start + balance[rank], rows, picked)[3]
            assert measured <= predicted.activation_bytes <= measured + again + 1, (rank, k)
