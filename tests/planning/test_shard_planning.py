"""Sharded replicas in the planner and the simulator: what a process holds of its parameters,
gradients and optimizer state over D replicas, and what gathering and reduce-scattering them
costs, each checked against its closed form by hand."""

import re

import pytest
import torch

from gpipe.cli import main
from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss
from gpipe.planning.memory import plan, profile
from gpipe.planning.shards import ReplicaStates, ring_seconds
from gpipe.planning.simulate import Costs, simulate
from gpipe.schedules import build

ADAM = 2  # tensors of optimizer state per parameter


@pytest.fixture(scope="module")
def gpt():
    """A 4-block GPT, profiled on the meta device, cut in two stages of three layers."""
    config = GPTConfig(n_layer=4, d_model=64, n_head=4, vocab_size=256, seq_len=32, tied=False)
    layers = build_gpt(config, device="meta")
    tokens = torch.zeros(2, 32, dtype=torch.int64, device="meta")
    return profile(layers, tokens, target=tokens, loss_fn=lm_loss)


def _plan(prof, **options):
    return plan(prof, [3, 3], batch_size=16, chunks=4, optimizer="adam", **options)


def _stage_bytes(prof, rank):
    """The rank's parameter bytes W, and its largest layer's (one fully_shard unit)."""
    layers = range(3 * rank, 3 * rank + 3)
    return sum(prof.param_bytes[i] for i in layers), max(prof.param_bytes[i] for i in layers)


def test_full_sharding_holds_one_replicas_share_between_steps(gpt):
    whole = _plan(gpt, data_parallel=2)
    full = _plan(gpt, data_parallel=2, shard="full")
    assert full.shard == "full" and full.data_parallel == 2
    for a, b in zip(whole.ranks, full.ranks, strict=True):
        assert b.held_bytes == pytest.approx(a.held_bytes / 2)  # (W + W + 2 W) / D
        assert a.held_bytes == a.param_bytes + a.state_bytes  # whole: always the same


def test_full_sharding_peaks_with_gathered_parameters_and_whole_gradients(gpt):
    """During the step: the shards, the whole parameters gathered beside them, the whole
    gradients accumulated over the micro-batches, optimizer state / D; the reduce-scatter
    copies one unit's gradients and returns its shard as the backward passes it."""
    full = _plan(gpt, data_parallel=2, shard="full")
    lazy = _plan(gpt, data_parallel=2, shard="full", reshard_after_forward=True)
    for rank, (r, s) in enumerate(zip(full.ranks, lazy.ranks, strict=True)):
        w, unit = _stage_bytes(gpt, rank)
        assert r.param_bytes == pytest.approx(w / 2 + w)
        assert r.state_bytes == pytest.approx(w + ADAM * w / 2)
        assert r.allreduce_bytes == pytest.approx(unit + unit / 2)
        during = max(r.activation_bytes, r.allreduce_bytes + r.last_graph_bytes)
        assert r.total_bytes == pytest.approx(r.param_bytes + r.state_bytes + during)
        assert s.param_bytes == pytest.approx(w / 2 + unit)  # one unit gathered at a time
        assert s.held_bytes == pytest.approx(r.held_bytes)
        assert s.total_bytes < r.total_bytes


def test_zero_stages_shard_the_optimizer_state_then_the_gradients(gpt):
    optimizer = _plan(gpt, data_parallel=2, shard="optimizer")
    gradients = _plan(gpt, data_parallel=2, shard="gradients")
    for rank, (o, g) in enumerate(zip(optimizer.ranks, gradients.ranks, strict=True)):
        w, _ = _stage_bytes(gpt, rank)
        assert o.held_bytes == pytest.approx(w + w + ADAM * w / 2)
        assert g.held_bytes == pytest.approx(w + w / 2 + ADAM * w / 2)
        # the gradients accumulate whole over the micro-batches either way
        assert o.param_bytes == g.param_bytes == pytest.approx(w)
        assert o.state_bytes == g.state_bytes == pytest.approx(w + ADAM * w / 2)
        assert o.allreduce_bytes == pytest.approx(w + w / 2)  # buckets and their shards


def test_the_unsharded_plan_is_unchanged(gpt):
    one = _plan(gpt)
    assert ReplicaStates().states(8.0, 2.0).messages == 0.0
    for rank, r in enumerate(one.ranks):
        w, _ = _stage_bytes(gpt, rank)
        assert (r.param_bytes, r.state_bytes, r.held_bytes) == (w, 3 * w, 4 * w)
        assert r.shard is None and r.allreduce_bytes == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shard": "full"}, r"shard='full' .* needs data_parallel > 1, got data_parallel=1"),
        ({"shard": "zero3", "data_parallel": 2}, "shard must be one of None, 'optimizer'"),
        ({"reshard_after_forward": True, "data_parallel": 2}, "only shard='full' gathers"),
    ],
)
def test_plan_refuses_sharding_it_cannot_count(gpt, options, message):
    with pytest.raises(ValueError, match=message):
        _plan(gpt, **options)


# K = 2, M = 2 under gpipe, F = 1 and B = 2 per stage, a message between the stages 0.25 s:
# 9.5 s alone. Each stage's 4 bytes of gradients (and of parameters) over a ring of D = 2 at
# 1 byte/s with 0.25 s latency: gather or reduce-scatter 1/2 x 4 + 0.25 = 2.25 s, all-reduce
# twice that.
COSTS = Costs(forward=1.0, backward=2.0, grad_bytes=4.0, bandwidth=1.0, latency=0.25)
RING = 0.5 * 4.0 / 1.0 + 0.25


def _simulated(**options):
    return simulate(build("gpipe", 2, 2), COSTS, overlap=False, **options)


def test_ring_collectives_take_their_closed_forms():
    assert ring_seconds(4.0, 2, 1.0, 0.25) == RING
    assert ring_seconds(4.0, 2, 1.0, 0.25, passes=2) == 2 * RING
    assert ring_seconds(6.0, 4, 2.0, 0.5) == 3 / 4 * 6 / 2 + 3 * 0.5
    assert ring_seconds(4.0, 1, 1.0, 0.25) == 0.0


def test_full_sharding_costs_the_gather_more_than_the_all_reduce():
    """Unsharded: 9.5 + 2 x 2.25 (the all-reduce after rank 0's last backward). Full: each
    stage gathers before its first forward, rank 1 after rank 0's forward reaches it, so the
    pipeline runs 2 x 2.25 later; the reduce-scatter is half the all-reduce: 9.5 + 3 x 2.25,
    one gather more than unsharded."""
    alone = _simulated()
    whole = _simulated(data_parallel=2)
    full = _simulated(data_parallel=2, shard="full")
    assert alone.makespan == 9.5
    assert whole.makespan == 9.5 + 2 * RING and whole.allreduce_exposed == (2 * RING,) * 2
    assert full.gather_exposed == (RING, RING)
    assert full.allreduce_exposed == (RING, RING)
    assert full.makespan == 9.5 + 3 * RING == whole.makespan + RING
    assert full.busy == whole.busy  # messages are waited for, not worked
    assert whole.gather_exposed == (0.0, 0.0)


def test_resharding_after_forward_gathers_for_every_action():
    """Every F and B gathers again: each rank waits before its F0, F1, B1 and B0. Six of
    those lie on the path to the end (rank 0's F0, rank 1's four, rank 0's B0), then the
    reduce-scatter: 9.5 + 7 x 2.25."""
    lazy = _simulated(data_parallel=2, shard="full", reshard_after_forward=True)
    assert lazy.gather_exposed == (4 * RING, 4 * RING)
    assert lazy.makespan == 9.5 + 6 * RING + RING


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_zero_stages_reduce_scatter_then_gather_the_updated_parameters(shard):
    """A reduce-scatter and a gather after the step: the all-reduce's traffic and latencies."""
    zero = _simulated(data_parallel=2, shard=shard)
    assert zero.allreduce_exposed == (2 * RING, 2 * RING)
    assert zero.makespan == _simulated(data_parallel=2).makespan
    assert zero.gather_exposed == (0.0, 0.0)


def test_simulate_refuses_sharding_without_replicas():
    with pytest.raises(ValueError, match="needs data_parallel > 1"):
        _simulated(shard="full")
    with pytest.raises(ValueError, match="only shard='full' gathers"):
        _simulated(data_parallel=2, reshard_after_forward=True)


def test_simulate_cli_prints_the_gathers(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(
        '{"forward": 1, "backward": 2, "grad_bytes": 4, "bandwidth": 1, "latency": 0.25}'
    )
    args = ["simulate", "--stages", "2", "--chunks", "2", "--schedule", "gpipe"]
    assert main([*args, "--costs", str(costs), "--data-parallel", "2", "--shard", "full"]) == 0
    out = capsys.readouterr().out
    assert "2 replicas sharded full" in out
    header, row = out.splitlines()[1:3]
    assert re.split(r"\s{2,}", header)[1:4] == [
        "makespan",
        "gather exposed",
        "reduce-scatter exposed",
    ]
    assert re.split(r"\s+", row)[1:4] == ["16.25", "2.25", "2.25"]  # 9.5 + 3 x 2.25, as above
    for more, message in [
        ([], "--shard full splits each stage over its replicas: it needs --data-parallel 2"),
        (["--data-parallel", "2", "--html", str(tmp_path / "page.html")], "--shard: the page"),
    ]:
        assert main([*args, "--shard", "full", *more]) == 2
        assert message in capsys.readouterr().err
    assert main([*args, "--data-parallel", "2", "--reshard-after-forward"]) == 2
    assert "--reshard-after-forward frees what --shard full gathers" in capsys.readouterr().err


PLAN = ["plan", "--d-model", "64", "--n-head", "4", "--vocab-size", "256", "--seq-len", "32",
        "--n-layer", "4", "--stages", "2", "--chunks", "4", "--batch-size", "16"]  # fmt: skip


def test_plan_cli_adds_what_is_held_between_steps(capsys):
    assert main([*PLAN, "--device-memory", "1GiB", "--data-parallel", "2", "--shard", "full"]) == 0
    out = capsys.readouterr().out
    assert "adam, sharded full over 2 replicas" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("rank"))
    assert "reduce-scatter" in header and "held between steps" in header
    assert "held between steps: parameters, gradients and optimizer state" in out
    assert main([*PLAN, "--shard", "full"]) == 2
    assert "--shard full splits each stage over its replicas" in capsys.readouterr().err
    assert main([*PLAN, "--shard", "zero3"]) == 2
    assert "invalid choice: 'zero3'" in capsys.readouterr().err


def _suggested(capsys, memory: str, *more: str) -> tuple[int, str]:
    # one tensor rank: splitting the layers over more would fit them too
    code = main([*PLAN[:-4], "--batch-size", "16", "--stages", "2", "--schedule", "1f1b",
                 "--suggest", "--device-memory", memory, "--data-parallel", "2",
                 "--tensor-parallel", "1", *more])  # fmt: skip
    return code, capsys.readouterr().out


def test_suggest_shards_what_does_not_fit_whole(capsys):
    full = _plan_bytes(capsys, "full")
    whole = _plan_bytes(capsys, "none")
    assert full < whole
    budget = f"{int((full + whole) / 2)}"  # fits sharded only
    code, out = _suggested(capsys, budget, "--checkpoint", "never", "--chunks", "4")
    assert code == 0, out
    header = next(line for line in out.splitlines() if line.startswith("stages"))
    assert "shard" in header.split()
    assert out.splitlines()[-1].endswith("--data-parallel 2 --shard full")
    code, out = _suggested(capsys, budget, "--checkpoint", "never", "--chunks", "4",
                           "--shard", "none")  # fmt: skip
    assert code == 1 and "nothing fits" in out


def _plan_bytes(capsys, shard: str) -> float:
    """The largest total of the 1f1b, never, 4-chunk plan's table."""
    main([*PLAN, "--schedule", "1f1b", "--checkpoint", "never", "--data-parallel", "2",
          "--device-memory", "1GiB", "--shard", shard])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    header = re.split(r"\s{2,}", lines[1].strip())
    rows = [
        dict(zip(header, re.split(r"\s{2,}", line.strip()), strict=True)) for line in lines[2:4]
    ]
    return max(float(row["total"].removesuffix(" MiB")) for row in rows) * 2**20
