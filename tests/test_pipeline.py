"""Pipeline across real processes over gloo on loopback: the same promise as in one process,
and failures that end in errors naming the stage instead of hangs."""

import time

import pytest
import torch
from torch import nn

from gpipe import LaunchError, Pipeline, launch

from . import distributed_cases as cases
from . import lost_peer_cases
from .small_models import BALANCES
from .workers import run


@pytest.mark.parametrize("case", cases.EQUIVALENCE)
@pytest.mark.parametrize("k", sorted(BALANCES))
def test_every_split_and_mode_matches_unpipelined(k, case):
    """K = 1..4, each case (distributed_cases.EQUIVALENCE) on the module's shared processes."""
    assert run(cases.equivalence, k, (k, case), threads=1) == dict.fromkeys(range(k), case)


@pytest.fixture(scope="module")
def built_on_meta():
    """The pipeline of each K = 1..4 built on the meta device: each rank's parameters."""
    return {k: run(cases.meta_initialization, k, (k,), threads=1) for k in sorted(BALANCES)}


def test_parameter_names_are_those_of_the_full_sequential(built_on_meta):
    assert [built_on_meta[2][rank]["names"] for rank in range(2)] == [
        ["0.weight", "0.bias", "2.weight", "2.bias"],
        ["5.weight", "5.bias", "6.weight", "6.bias", "7.weight", "7.bias"],
    ]


def test_meta_initialization_does_not_depend_on_k(built_on_meta):
    def merged(k):
        state = {}
        for rank in range(k):
            state.update(built_on_meta[k][rank]["state"])
        return state

    one = merged(1)
    assert len(one) == 10
    for k in (2, 3, 4):
        other = merged(k)
        assert other.keys() == one.keys()
        assert all(torch.equal(other[name], one[name]) for name in one)


@pytest.mark.parametrize(
    ("how", "expected"), [("dies", "lost stage 1"), ("stalls", "timed out after 2 s")]
)
def test_a_failed_peer_ends_in_an_error_naming_the_stage(tmp_path, how, expected):
    report = tmp_path / "report.txt"
    start = time.monotonic()
    # the agent notices the failure after monitor_interval; stage 0 must have spoken by then
    # (a stalled stage 1 ends itself only after stage 0 has)
    interval = 8 if how == "dies" else 0.5
    with pytest.raises(LaunchError, match="rank 1"):
        launch(cases.failing_peer, 2, (how, str(report)), monitor_interval=interval)
    seconds, message = report.read_text().split("\n", 1)
    assert message.startswith("stage 0: ") and expected in message
    assert "gradients of micro-batch 1 from stage 1" in message
    assert float(seconds) < 5
    assert time.monotonic() - start < 60


@pytest.mark.parametrize(
    ("case", "nprocs", "stages", "waited"),
    [
        ("batch_norm", 2, {0: 0}, "the other replicas' BatchNorm statistics"),
        ("found_inf_stages", 3, {0: 0, 1: 1}, "loss scaling's found-inf flag from ranks [0, 1, 2]"),
        ("found_inf_replicas", 2, {0: 0}, "loss scaling's found-inf flag from ranks [0, 1]"),
        ("clipping", 3, {0: 0, 1: 1}, "the gradient norms of ranks [0, 1, 2]"),
        ("sends", 2, {1: 1}, "stage 0 to take micro-batch"),
    ],
)
def test_a_silent_peer_ends_every_wait_of_a_step_within_the_timeout(
    tmp_path, case, nprocs, stages, waited
):
    """Each collective of a step, and a send's completion: the ranks that wait (rank: its
    stage) raise StageError naming their stage and what they waited for, in time."""
    results = run(getattr(lost_peer_cases, case), nprocs, (str(tmp_path),))
    waiting = {rank: r for rank, r in results.items() if r}
    assert waiting.keys() == stages.keys()
    timeout = lost_peer_cases.TIMEOUT
    for rank, r in waiting.items():
        expected = f"StageError: stage {stages[rank]}: timed out after {timeout:g} s waiting for "
        assert r["error"].startswith(expected + waited), (rank, r["error"])
        assert r["seconds"] <= timeout + 2, (rank, r["seconds"])


def test_bad_inputs_are_named():
    errors = run(cases.bad_inputs, 2)
    both = {key: (errors[0][key], errors[1][key]) for key in errors[0]}
    for key in ("balance", "chunks", "checkpoint", "schedule", "reduction", "no_loss"):
        assert both[key][0] == both[key][1], key
    assert "balance has 1 partitions but the process group has 2" in both["balance"][0]
    assert "chunks must be a positive integer, got 0" in both["chunks"][0]
    assert "checkpoint is not one of" in both["checkpoint"][0]
    assert (
        "schedule must be one of ['1f1b', 'dualpipe-v', 'gpipe', 'interleaved', "
        "'interleaved-zero-bubble', 'looped-bfs', 'v-half', 'v-min', 'zero-bubble', "
        "'zero-bubble-v'], got 'fastest'" in both["schedule"][0]
    )
    assert "loss_reduction must be 'mean' or 'sum'" in both["reduction"][0]
    assert "step() needs a loss_fn" in both["no_loss"][0]
    first, last = both["non_scalar_loss"]
    assert last.startswith("ValueError: loss_fn must return a scalar tensor, got (4, 4)")
    assert last.endswith("[raised in pipeline stage 1, forward of micro-batch 0]")
    # stage 1 raised and went on: stage 0 times out, or sees stage 1 drop that pipeline
    assert first.startswith("StageError: stage 0: ") and "from stage 1" in first
    first, last = both["not_a_tensor"]
    assert "inputs must hold a tensor with a batch dimension (dim 0)" in first
    assert last.startswith("StageError: stage 1: ") and "stage 0" in last
    first, last = both["targets_rows"]
    assert "targets have 3 rows but inputs have 4" in last


def test_without_a_process_group_the_error_says_how_to_get_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="run under torchrun or gpipe.launch"):
        Pipeline(nn.Sequential(nn.Linear(2, 2)), [1])


def test_stages_reading_different_text_refuse_to_train():
    errors = run(cases.different_text, 2)
    assert errors[0] == errors[1]
    assert errors[0].startswith("StageError: stage 1: reads different training data")


def test_balance_none_is_measured_on_the_first_rank_and_shared():
    results = run(cases.balanced_by_time, 2, threads=1)
    for rank in (0, 1):
        assert results[rank]["timed"] == [1, 5]  # the slow layer alone; an even cut is [3, 3]
        assert results[rank]["untimed"] == [3, 3]  # no sample: even by layer count
        assert results[rank]["rng_untouched"]


def test_deferred_batch_norm_tracks_statistics_once_per_step_on_every_stage():
    results = run(cases.deferred_batch_norm, 2, threads=1)
    assert results == {0: 4 * 3 * 2, 1: 4 * 3 * 2}


@pytest.mark.parametrize(("d", "world"), [(2, 4), (2, 2), (1, 2)])
def test_data_parallel_replicas_give_the_gradients_of_one_step_on_their_union(d, world):
    """D x K processes: every replica's shard, even or not, summed exactly as one un-pipelined
    step on the union; deferred BatchNorm statistics are the global mini-batch's."""
    results = run(cases.data_parallel, world, (d,), threads=1)
    for rank, r in results.items():
        # 12 steps, and 3 buffers of each BatchNorm held here (one per stage at K = 2)
        assert r["cases"] == 12 + (3 if world // d == 2 else 6), rank
        if d > 1:  # the last backward is whole: every bucket starts during it
            assert r["buckets"] >= 1 and r["early"] == r["buckets"], r
            assert r["small"] == (r["held"], r["held"]), r  # one bucket per parameter


def test_data_parallel_bad_inputs_are_named():
    errors = run(cases.data_parallel_bad_inputs, 2)
    for rank in (0, 1):
        e = errors[rank]
        assert "data_parallel=3 does not divide the world size 2" in e["divides"]
        assert "pass group or data_parallel, not both" in e["both"]
        assert "data_parallel must be a positive integer, got 0" in e["type"]
        assert "bucket_bytes must be a positive number of bytes or None" in e["bucket"]
    # the replica with bad input raises its own error, the other stops at once with a
    # ValueError saying so (not a timeout)
    assert "ValueError: inputs has an empty batch" in errors[1]["empty"]
    assert "ValueError: replica 1 refused its inputs this step" in errors[0]["empty"]
    assert "counts must not be negative, got -2 for row 1" in errors[1]["counts"]
    assert "ValueError: another replica refused its counts" in errors[0]["counts"]
    assert errors[0]["after"] == errors[1]["after"] == "ok"  # and the next step runs
