"""Every schedule across real processes gives the loss and gradients of un-pipelined
training: K = 1..4, several micro-batch splits, all checkpoint modes."""

import pytest

from gpipe.schedules import SCHEDULES, build, to_csv, traits

from .. import distributed_cases, presplit_cases
from .. import schedule_cases as cases
from .. import two_per_rank_cases as two_per_rank
from ..small_models import BALANCES, UNET_BALANCES, mlp, unet
from ..workers import run


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("k", sorted(BALANCES))
def test_schedule_matches_unpipelined(schedule, k):
    results = run(cases.equivalence, k, (k, schedule), threads=1)
    assert all(n == 22 for n in results.values())


@pytest.mark.parametrize("k", sorted(BALANCES))
def test_interleaved_matches_unpipelined(k):
    results = run(cases.interleaved, k, (k,), threads=1)
    assert all(r["cases"] == 9 for r in results.values())
    assert [results[r]["stages"] for r in range(k)] == [[r, r + k] for r in range(k)]
    if k == 2:  # rank 0 holds layers 0-1 and 4-5 of the full Sequential, under their names
        assert results[0]["names"] == ["0.weight", "0.bias", "5.weight", "5.bias"]


@pytest.mark.parametrize("k", sorted(UNET_BALANCES))
def test_skips_across_stages_match_unpipelined_under_every_schedule(k):
    """Skips go straight from the stashing process to the popping one and back, under every
    schedule and checkpoint mode; every parameter of the model is compared on some rank."""
    results = run(cases.skips, k, (k,), threads=1)
    assert all(r["cases"] == 3 * 9 + 2 * 3 + 4 * 2 for r in results.values())
    compared = set().union(*(r["names"] for r in results.values()))
    assert compared == {name for name, _ in unet().named_parameters()}


@pytest.mark.parametrize("k", [2, 3])
def test_separate_envelopes_take_tensors_in_each_peers_send_order(k):
    """NCCL ignores tags: the CUDA path must receive tensors in the order each peer sent
    them, even where skips make that order differ from the order they are used."""
    results = run(cases.separate_envelopes, k, (k,), threads=1)
    assert all(n == 9 for n in results.values())


def test_layers_recomputed_selectively_under_every_schedule():
    results = run(distributed_cases.layer_checkpoint, 2, threads=1)
    assert results == {0: 8, 1: 8}


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("schedule", two_per_rank.TWO_PER_RANK)
def test_two_stages_per_process_match_unpipelined(schedule, k):
    """The V schedules (rank r holds stages r and 2K - 1 - r, the loss on rank 0) and the
    looped ones (r and r + K), float64, M from the fewest they take to 4K."""
    results = run(two_per_rank.equivalence, k, (k, schedule), threads=1)
    expected = 5 * (2 if schedule == "dualpipe-v" else 3)
    assert all(r["cases"] == expected for r in results.values())
    v = schedule in ("zero-bubble-v", "dualpipe-v")
    stages = [[r, 2 * k - 1 - r] if v else [r, r + k] for r in range(k)]
    assert [results[r]["stages"] for r in range(k)] == stages
    assert [r for r in range(k) if results[r]["last"]] == [0 if v else k - 1]


def test_memory_capped_v_schedules_match_unpipelined():
    """v-half and v-min, four stages on two processes in a V, float64, exact; v-min refuses
    a single micro-batch in one line that names its fewest."""
    results = run(two_per_rank.memory_capped, 2, (2,), threads=1)
    for r in range(2):
        assert results[r]["cases"] == 2 * (2 * 2 + 1)
        assert results[r]["stages"] == [r, 3 - r]
        assert results[r]["refused"] == (
            "schedule 'v-min' needs chunks of at least 2 for 2 processes, got chunks=1"
        )


@pytest.mark.parametrize("k", [2, 4])
def test_two_stages_per_process_carry_skips(k):
    results = run(two_per_rank.skips, k, (k,), threads=1)
    assert all(n == len(two_per_rank.TWO_PER_RANK) * 3 for n in results.values())


def test_messages_larger_than_a_pipe_both_ways_on_two_channels_do_not_deadlock():
    results = run(two_per_rank.large_messages, 2, threads=1)
    assert all(n == len(two_per_rank.TWO_PER_RANK) for n in results.values())


def test_two_stages_per_process_with_replicas():
    results = run(two_per_rank.data_parallel, 4, (2,), threads=1)
    assert all(n == 6 for n in results.values())


def test_a_schedule_read_from_a_pytorch_file_runs_exactly(tmp_path):
    path = tmp_path / "zbv.csv"
    to_csv(build("zero-bubble-v", 2, 4), path)
    results = run(two_per_rank.schedule_file, 2, (str(path),), threads=1)
    assert [results[r]["stages"] for r in (0, 1)] == [[0, 3], [1, 2]]
    assert results[0]["name"] == "csv:zbv.csv"
    errors = results[0]["errors"]
    assert "is for 4 micro-batches (chunks), the pipeline has 1" in errors["chunks"]
    assert "runs 4 micro-batches, but this step has 3" in errors["rows"]
    told = "stage 1: stopped waiting for activations of micro-batch 0 from stage 0: stage 0 "
    assert results[1]["errors"]["rows"].startswith(told + "failed: ValueError: schedule 'csv")


@pytest.mark.parametrize("k", [2])
def test_auto_runs_one_choice_on_every_rank_and_trains_exactly(k):
    results = run(cases.auto, k, (k,), threads=1)
    choices = {repr(r["choice"]) for r in results.values()}
    assert len(choices) == 1, choices
    name, chunks, balance, v = results[0]["choice"]
    assert traits(name).runs(k, chunks, v) and sum(balance) == len(mlp())
    assert len(balance) == k * traits(name).stages_per_rank(v)
    for r in results.values():
        errors = r["errors"]
        assert "schedule='auto' needs sample=, one mini-batch" in errors["sample"]
        assert "nothing fits in 1.00 KiB per process" in errors["budget"]


def test_microbatches_given_with_their_own_lengths_match_unpipelined_under_every_schedule():
    """``step(microbatches=...)``: 7, 31, 12 and 64 tokens in 2, 1, 3 and 1 rows, float64,
    every schedule, never and always; token means weighed by ``counts`` too."""
    results = run(presplit_cases.equivalence, 2, (2,), threads=1)
    assert all(n == 2 * len(SCHEDULES) + 1 for n in results.values())


def test_outputs_of_micro_batches_given_with_their_own_lengths_come_back_one_each():
    """``return_outputs=True`` with ``microbatches=`` of 7, 31, 12 and 64 tokens: a list of
    each one's outputs (they cannot be joined), on the rank of the last stage, under 1F1B
    and V-Half; a step with fewer of them than V-Min runs is refused on every process alike
    (each holds the list), asking for more micro-batches, not rows."""
    results = run(presplit_cases.outputs_and_refusals, 2, (2,), threads=1)
    for rank, last in ((0, False), (1, True)):
        found = results[rank]
        assert found["1f1b", "step"] is found["1f1b", "evaluate"] is last
        assert found["v-half", "step"] is found["v-half", "evaluate"] is (not last)
    refusal = (
        "ValueError: schedule 'v-min' runs at least 2 micro-batches on 2 processes, but this "
        "step has 1 (microbatches= lists that many): pass at least 2 micro-batches"
    )
    assert [results[rank]["refused"] for rank in (0, 1)] == [refusal, refusal]
