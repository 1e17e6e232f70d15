"""Pipeline(data_parallel=D): replicas whose steps differ (a branch one skips, a share too
small for the schedule) and gpipe.parallel.replicas.shard."""

import pytest
import torch

from gpipe.parallel.replicas import shard

from ..workers import run
from . import replicas_cases as cases


def test_a_parameter_one_replica_did_not_use_is_summed_as_zeros_whole_or_sharded():
    """D = 2 x K = 2: replica 1 skips a branch that replica 0 takes; its buckets (one per
    parameter) start in the same order as replica 0's, and fully_shard reduces the skipped
    parameters too, so every gradient is one un-pipelined step's on the union."""
    results = run(cases.unused_parameters, 4, threads=1)
    for rank, r in results.items():
        assert r[None] == (4 if rank < 2 else 2), rank  # a bucket per parameter of the stage
        assert r["microbatches"] == (3 if rank % 2 == 0 else 2), rank


def test_a_share_too_small_for_the_schedule_stops_every_replica_and_the_next_step_runs():
    errors = run(cases.too_small_a_share, 4, threads=1)
    for key in ("rows", "microbatches"):
        refused = "schedule 'interleaved' runs at least 2 micro-batches on 2 processes"
        assert refused in errors[1][key], key  # replica 1's first stage, with the reason
        # replica 0's first stage at once, not after the timeout
        assert "ValueError: replica 1 refused its inputs this step" in errors[0][key], key
        assert errors[2][key].startswith("StageError: stage 1"), key  # its stage 0 stopped


def test_shard_cuts_any_payload_as_micro_batches_are_cut():
    x = torch.arange(5)
    assert [shard(x, r, 2).tolist() for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert shard(x, 0, 1).tolist() == x.tolist()
    batch = {"input_ids": x, "mask": x[None]}  # a leaf without the rows is kept whole
    part = shard(batch, 1, 2)
    assert part["input_ids"].tolist() == [3, 4] and part["mask"].tolist() == [x.tolist()]
    assert [t.tolist() for t in shard((x, x * 2), 1, 2)] == [[3, 4], [6, 8]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, 2), "replica must be an integer in [0, 2) for data_parallel=2, got 2"),
        ((-1, 2), "replica must be an integer in [0, 2) for data_parallel=2, got -1"),
        ((0, 0), "data_parallel must be a positive integer, got 0"),
        ((0, 6), "a mini-batch of 5 rows cannot give each of 6 replicas one"),
    ],
)
def test_shard_names_a_bad_argument(args, message):
    with pytest.raises(ValueError) as error:
        shard(torch.arange(5), *args)
    assert message in str(error.value)
