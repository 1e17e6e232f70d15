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
        # a deadlock in the file's terms: its cells and steps, not the messages gpipe places
        ("0F0,0B0\n1B0,1F0\n", {}, "deadlocks: rank 0, step 1: 0B0 waits for 1B0 (rank 1, "
         "step 0); rank 1, step 0: 1B0 waits for 1F0 (rank 1, step 1)"),
        ("0F0,3F0,0F1,3F1,3B0,0B0,3B1,0B1\n1F0,2F0,2B0,1B0,1F1,2F1,2B1,1B1\n", {},
         "deadlocks: rank 0, step 3: 3F1 waits for 2F1 (rank 1, step 5); rank 1, step 2: 2B0 "
         "waits for 3B0 (rank 0, step 4)"),
        ("0F0,0I0,0W0\n1F0,1W0,1I0\n", {}, "deadlocks: rank 0, step 1: 0I0 waits for 1I0 "
         "(rank 1, step 2); rank 1, step 1: 1W0 waits for 1I0 (rank 1, step 2)"),
        ("0F0,0B0\n\n1F0,1B0\n", {}, "rank 1 (row 2) holds no actions: each row is one rank's "
         "program"),
        ("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n", {"n_ranks": 3},
         "the file has rows for 2 ranks, but the pipeline has 3 processes: rank 2 has no row"),
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


def test_a_file_as_editors_and_spreadsheets_save_it_reads_as_written(tmp_path, capsys):
    """A byte-order mark, Windows line endings, spaces around cells, empty cells at a row's
    end and blank lines after the last row: the same schedule, with no rank added for the
    blank lines (which left an idle rank that the simulator divided by)."""
    clean, saved = tmp_path / "clean.csv", tmp_path / "saved.csv"
    schedule = build("1f1b", 2, 3)
    to_csv(schedule, clean)
    rows = clean.read_text().splitlines()
    text = "\ufeff" + "\r\n".join(" " + row.replace(",", " , ") + ",," for row in rows)
    saved.write_bytes((text + "\r\n\r\n\r\n").encode())
    back = from_csv(saved)
    assert (back.n_ranks, back.programs, back.stage_to_rank) == (
        2,
        schedule.programs,
        schedule.stage_to_rank,
    )
    assert main(["simulate", "--schedule-csv", str(saved)]) == 0
    assert capsys.readouterr().out.startswith("2 ranks, 2 stages, 3 micro-batches")


def _pytorch_written(cls_name: str, k: int, m: int, path) -> dict[int, int]:
    """``cls_name`` of ``torch.distributed.pipelining`` on K ranks, M micro-batches, written
    by its own ``_dump_csv`` as rank 0 sees it (every rank's order); returns its stages'
    ranks. Its stages are stand-ins holding the attributes the schedule's order reads."""
    import types

    from torch import nn

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, cls_name, None)
    if cls is None or not hasattr(cls, "_dump_csv"):
        pytest.skip(f"this PyTorch has no {cls_name} that writes schedule files")
    n = 2 * k
    held = [0, n - 1] if "V" in cls_name else list(range(0, n, k))
    stages = [
        types.SimpleNamespace(
            num_stages=n,
            group_size=k,
            group_rank=0,
            stage_index=s,
            is_first=s == 0,
            is_last=s == n - 1,
            submod=nn.Linear(1, 1),
        )
        for s in held
    ]
    schedule = cls(stages, m)
    schedule._dump_csv(str(path))
    return dict(schedule.stage_index_to_group_rank)


@pytest.mark.parametrize(
    ("cls_name", "k", "m"),
    [
        ("ScheduleInterleaved1F1B", 2, 3),
        ("ScheduleLoopedBFS", 3, 7),
        ("ScheduleInterleavedZeroBubble", 2, 1),
        ("ScheduleZBVZeroBubble", 3, 5),
        ("ScheduleDualPipeV", 2, 4),
    ],
)
def test_files_pytorch_writes_itself_are_read_with_its_ranks(tmp_path, cls_name, k, m):
    """PyTorch's own ``_dump_csv``, micro-batch counts uneven to the ranks among them: empty
    cells for idle steps, I and W, DualPipeV's overlapped pairs."""
    path = tmp_path / "torch.csv"
    ranks = _pytorch_written(cls_name, k, m, path)
    schedule = from_csv(path)
    assert (schedule.n_ranks, schedule.n_stages, schedule.n_microbatches) == (k, 2 * k, m)
    assert list(schedule.stage_to_rank) == [ranks[s] for s in range(2 * k)]


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


def test_simulate_refuses_the_flags_a_schedule_file_fixes_rather_than_ignore_them(tmp_path, capsys):
    """The file sets K, M and the stages: --stages 8 beside it was ignored, silently."""
    path = tmp_path / "1f1b.csv"
    to_csv(build("1f1b", 2, 4), path)
    more = ["--stages", "8", "--chunks", "16", "--virtual-stages", "3", "--data-parallel", "2"]
    assert main(["simulate", "--schedule-csv", str(path), *more]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith(
        "fixes the ranks, stages and micro-batches (and simulates one replica): drop --stages, "
        "--chunks, --virtual-stages, --data-parallel\n"
    ), err
    assert main(["simulate", "--schedule-csv", str(path), "--stages", "2"]) == 2
    assert "drop --stages\n" in capsys.readouterr().err


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
