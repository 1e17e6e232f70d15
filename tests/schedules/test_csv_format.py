"""PyTorch's schedule files both ways: every gpipe schedule written and read back, read by
PyTorch's own loader, and files that cannot run refused with the rank, step and action."""

import csv

import pytest

from gpipe.cli import main
from gpipe.schedules import SCHEDULES, ScheduleError, build, from_csv, to_csv, traits

SIZES = [(1, 4), (2, 4), (2, 8), (4, 8), (3, 12)]


def _cases():
    for name in SCHEDULES:
        for k, m in SIZES:
            if traits(name).runs(k, m, 2) and not (traits(name).several_stages_per_rank and k < 2):
                yield name, k, m


@pytest.mark.parametrize("messages", [False, True])
def test_every_schedule_round_trips(tmp_path, messages):
    path = tmp_path / "schedule.csv"
    for name, k, m in _cases():
        schedule = build(name, k, m, 2)
        to_csv(schedule, path, messages=messages)
        back = from_csv(path)
        assert back.programs == schedule.programs, (name, k, m)
        assert back.stage_to_rank == schedule.stage_to_rank
        assert back.split_backward == schedule.split_backward
        assert (back.n_stages, back.n_microbatches, back.n_ranks) == (
            schedule.n_stages,
            schedule.n_microbatches,
            schedule.n_ranks,
        )


def _torch_loader():
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    multi = getattr(schedules, "PipelineScheduleMulti", None)
    if multi is None or not hasattr(multi, "_load_csv"):
        pytest.skip("this PyTorch has no schedule-file loader")
    return multi


def test_pytorchs_own_loader_reads_every_schedule(tmp_path):
    """PipelineScheduleMulti._load_csv parses each action and checks the order with
    PyTorch's validator (F before I or B before W), then infers each stage's rank."""
    multi = _torch_loader()
    path = tmp_path / "schedule.csv"
    for name, k, m in _cases():
        schedule = build(name, k, m, 2)
        to_csv(schedule, path)
        # PyTorch's loader is a private method of its schedule class: built bare (no stages,
        # no process group), it is given by hand the attributes the loader reads
        loader = multi.__new__(multi)
        loader.pipeline_order = {}
        loader.pp_group_size, loader._num_stages, loader._n_microbatches = (
            k,
            schedule.n_stages,
            m,
        )
        loader._stages = []
        loader._load_csv(str(path))
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        assert [[str(a) for a in loader.pipeline_order[r]] for r in range(k)] == rows, name
        assert [loader.stage_index_to_group_rank[s] for s in range(schedule.n_stages)] == list(
            schedule.stage_to_rank
        ), name


@pytest.mark.parametrize(
    ("text", "options", "message"),
    [
        ("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n2F0\n", {"n_ranks": 2},
         "the file has a row for rank 2, but the pipeline has 2 processes"),
        ("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n", {"n_microbatches": 1},
         "rank 0, step 1: 0F1 names micro-batch 1, but there are 1"),
        ("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n", {"n_stages": 1},
         "rank 1, step 0: 1F0 names stage 1, but there are 1"),
        ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", {}, "rank 0 lacks 0B1"),
        ("0F0,0B0\n1B0,1F0\n", {}, "deadlocks: rank 0, step 1: 0B0 waits for 1SEND_B0; "
         "rank 1, step 0: 1B0 waits for 1F0"),
        ("0F0,0B0\n1F0,1X0\n", {}, "rank 1, step 1: '1X0' is not an action"),
        ("0F0,0B0,0F0\n1F0,1B0\n", {}, "rank 0, step 2 holds 0F0 (a forward), which runs the "
         "forward of stage 0, micro-batch 0 again: step 0 holds 0F0 (a forward)"),
        ("0F0,0B0\n0F1,1F0,1B0\n", {}, "rank 1, step 0: 0F1: stage 0 is run by rank 0 too"),
        # a stage number of 10^10 named at once, not a list of 10^10 stages built first
        ("9999999999F0\n", {}, "no rank runs stage 0"),
    ],
)  # fmt: skip
def test_bad_files_name_the_rank_step_and_action(tmp_path, text, options, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_csv(path, **options)


def test_older_files_write_the_input_half_as_b_before_its_w(tmp_path):
    """PyTorch's older files (its test artifacts among them) wrote the input half of a split
    backward as B, with the W of the same stage and micro-batch after it: read as I."""
    path = tmp_path / "older.csv"
    for name, k, m in _cases():
        schedule = build(name, k, m, 2)
        if not schedule.split_backward:
            continue
        to_csv(schedule, path)
        path.write_text(path.read_text().replace("I", "B"))
        assert from_csv(path).programs == schedule.programs, (name, k, m)
    path.write_text(
        "0F0,0F1,2F0,,2F1,2B0,2W0,2B1,2W1,0B0,0W0,0B1,0W1\n,1F0,1F1,3F0,3B0,3F1,3B1,"
        "3W0,1B0,3W1,1B1,1W0,1W1\n"
    )
    schedule = from_csv(path)
    assert schedule.split_backward and schedule.n_stages == 4
    assert [str(a) for a in schedule.compute_only(0)[4:7]] == ["2B0", "2W0", "2B1"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0F0,0W0,0B0\n", "rank 0, step 2 holds 0B0 (a whole backward: input and weight "
         "gradients), which runs the weight gradients of stage 0, micro-batch 0 again: step 1 "
         "holds 0W0 (weight gradients)"),
        ("0F0,0B0,0W0,0W0\n", "rank 0, step 3 holds 0W0 (weight gradients), which runs the "
         "weight gradients of stage 0, micro-batch 0 again: step 2 holds 0W0 (weight gradients)"),
        ("0F0,0I0,0B0,0W0\n", "rank 0, step 2 holds 0B0 (input gradients, as 0W0 follows), "
         "which runs the input gradients of stage 0, micro-batch 0 again: step 1 holds 0I0 "
         "(input gradients)"),
        ("0F0,0B0,0B0\n", "rank 0, step 2 holds 0B0 (a whole backward), which runs the backward "
         "of stage 0, micro-batch 0 again: step 1 holds 0B0 (a whole backward)"),
    ],
)  # fmt: skip
def test_a_real_duplicate_names_what_each_step_holds(tmp_path, text, message):
    path = tmp_path / "twice.csv"
    path.write_text(text)
    with pytest.raises(ScheduleError) as caught:
        from_csv(path)
    assert str(caught.value) == f"{path}: {message}"


def test_simulate_writes_and_reads_schedule_files(tmp_path, capsys):
    path = tmp_path / "zbv.csv"
    args = ["simulate", "--schedule", "zero-bubble-v", "--stages", "2", "--chunks", "4"]
    assert main([*args, "--dump-csv", str(path)]) == 0
    assert path.read_text().splitlines()[0].startswith("0F0,0F1,0F2,3F0,3I0,3W0")
    named = capsys.readouterr().out.splitlines()[-1].split()
    assert main(["simulate", "--schedule-csv", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 ranks, 4 stages, 4 micro-batches")
    assert out.splitlines()[-1].split()[1:3] == named[1:3]  # the makespan and bubble
    path.write_text("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n")
    assert main(["simulate", "--schedule-csv", str(path)]) == 2
    assert "rank 0 lacks 0B1" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["1f1b", "zero-bubble-v"])
def test_a_sequence_pipelined_schedule_is_refused_rather_than_written_as_micro_batches(
    tmp_path, name
):
    """Its units (sub-sequence j of micro-batch i is unit i x S + j) would come back as M x S
    micro-batches of their own, which a pipeline would run whole."""
    from gpipe.schedules.seq_chunked import seq_chunked

    schedule = seq_chunked(name, 4 if name == "zero-bubble-v" else 2, 3, 2)
    path = tmp_path / "schedule.csv"
    with pytest.raises(ValueError, match="no sub-sequences: .* seq_chunks=2; write one without"):
        to_csv(schedule, path)
    assert not path.exists()
