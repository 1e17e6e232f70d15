"""`gpipe bench`: the report's structure on a tiny run, its arithmetic on made-up timings,
and clear errors for bad options. No timing is asserted: figures depend on the machine."""

import contextlib
import io
import json

import pytest

from gpipe.bench.contenders import K, contenders
from gpipe.bench.measure import build_all, timing_pass
from gpipe.bench.report import NOT_MEASURED, figures, markdown, targets
from gpipe.bench.run import FEWEST_REPEATS, BenchOptions, caveats
from gpipe.bench.workloads import get_workload
from gpipe.cli import main
from gpipe.schedules import SCHEDULES

from ..workers import run


def _has_torchgpipe() -> bool:
    try:
        import torchgpipe  # noqa: F401
    except ImportError:
        return False
    return True


def _bench(out, *args: str) -> tuple[dict, str]:
    """A tiny ``gpipe bench`` of every schedule without re-materialization, one step each:
    the command's ``main`` in this process, whose contenders' processes start as a command's
    do (forked from this process's forkserver), without a fresh interpreter and forkserver
    that import torch and gpipe again for each of the module's two reports."""
    argv = ["bench", "--size", "tiny", "--repeats", "1", "--warmup", "0", "--modes", "never"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main([*argv, "--out", str(out), *args])
    assert code == 0, printed.getvalue()[-3000:]
    return json.loads((out / "bench.json").read_text()), printed.getvalue()


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """Timing and memory on the GPT, of the baselines and two schedules with their PyTorch
    counterparts (the memory pass, fresh processes per contender, is most of the cost; every
    contender is timed on the other workloads by ``timed_report``)."""
    out = tmp_path_factory.mktemp("bench")
    chosen = ["--schedules", ",".join(MEASURED), "--skip", ",".join(UNMEASURED)]
    report, stdout = _bench(out, "--workload", "gpt", "--chunks", "2,4", "--memory-chunks", "4",
                            *chosen)  # fmt: skip
    return out, report, stdout


@pytest.fixture(scope="module")
def timed_report(tmp_path_factory):
    """Every contender timed at M = 4 on the other three workloads, no memory pass."""
    out = tmp_path_factory.mktemp("timed")
    report, _ = _bench(out, "--workload", "mlp,cnn,mlp64", "--chunks", "4",
                       "--memory-chunks", "0", "--no-plots")  # fmt: skip
    return report


MEASURED = ("gpipe", "dualpipe-v")
UNMEASURED = ("pytorch/Schedule1F1B",)  # in the list whatever the schedules


def test_every_contender_is_timed_and_measured(tiny_report):
    _, report, _ = tiny_report
    every = contenders(MEASURED, ("never",))
    names = [c.name for c in every if c.name not in UNMEASURED]
    assert len(names) == 4 + len(MEASURED) + 1 + 2 + 1  # PyTorch's GPipe and DualPipeV
    assert set(report["workloads"]) == {"gpt"}
    for w in report["workloads"].values():
        skipped = set(w["skipped"])
        assert skipped == (set() if _has_torchgpipe() else {"torchgpipe"})
        rows = w["chunks"]["2"]["contenders"]
        # dualpipe-v and its PyTorch counterpart take 2K = 4 micro-batches and more
        not_run = {"gpipe/dualpipe-v/never", "pytorch/ScheduleDualPipeV"}
        assert set(w["chunks"]["2"]["not_run"]) == not_run
        assert set(rows) | skipped | not_run == set(names)
        assert set(w["chunks"]["4"]["contenders"]) | skipped == set(names)
        assert set(w["memory"]) | skipped == set(names)
        for name, row in rows.items():
            assert row["seconds"]["median"] > 0 and row["seconds"]["n"] == 1, name
            assert row["samples_per_s"] > 0 and row["tokens_per_s"] >= row["samples_per_s"]
            assert row["over_ideal"] > 0 and row["over_naive_ideal"] > 0, name
            assert -0.5 < row["bubble"] < 1, name
        for name, mem in w["memory"].items():
            assert len(mem["rss_peak"]) == K and min(mem["rss_peak"]) > 0, name
            assert all(p >= s for p, s in zip(mem["rss_peak"], mem["rss_start"], strict=True))
            assert len(mem["activations"]) == K, name
            # every stage holds something for backward, and saved tensors are part of it
            assert all(a >= s > 0 for a, s in zip(mem["activations"], mem["saved"], strict=True))
        assert w["chunks"]["2"]["ideal"] > 0 and w["chunks"]["2"]["naive_ideal"] > 0


def test_pipelines_are_compared_with_their_pytorch_counterpart(timed_report):
    expected = {
        "gpipe/gpipe/never": "pytorch/ScheduleGPipe",
        "gpipe/1f1b/never": "pytorch/Schedule1F1B",
        "gpipe/zero-bubble/never": "pytorch/Schedule1F1B",
        "gpipe/interleaved/never": "pytorch/ScheduleInterleaved1F1B",
        "gpipe/interleaved-zero-bubble/never": "pytorch/ScheduleInterleavedZeroBubble",
        "gpipe/looped-bfs/never": "pytorch/ScheduleLoopedBFS",
        "gpipe/zero-bubble-v/never": "pytorch/ScheduleZBVZeroBubble",
        "gpipe/dualpipe-v/never": "pytorch/ScheduleDualPipeV",
    }
    rows = timed_report["workloads"]["mlp"]["chunks"]["4"]["contenders"]
    for name, counterpart in expected.items():
        row = rows[name]
        assert row["counterpart"] == counterpart
        theirs = rows[counterpart]["seconds"]["median"]
        assert row["over_counterpart"] == pytest.approx(row["seconds"]["median"] / theirs)
    assert rows["at-once"]["counterpart"] is None and rows["at-once"]["schedule_bubble"] is None


def test_the_report_is_written_as_markdown_and_plots(tiny_report):
    out, report, stdout = tiny_report
    text = (out / "bench.md").read_text()
    for name in report["workloads"]["gpt"]["chunks"]["4"]["contenders"]:
        assert f"| {name} |" in text
    assert "Not run at this M: gpipe/dualpipe-v/never (dualpipe-v takes at least 4" in text
    assert "## Targets" in text and "Machine:" in text
    for name in ("gpt",):
        for kind in ("step-time", "memory"):
            png = out / f"bench-{name}-{kind}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every target is listed; those at M = 8 cannot be judged, and the report says so
    unmeasured = [t for t in report["targets"] if t["met"] is None]
    assert all(t["figure"] == NOT_MEASURED for t in unmeasured)
    assert {t["target"] for t in unmeasured} >= {
        t["target"] for t in report["targets"] if "M=8" in t["target"]
    }
    assert text.count("| not measured |") == len(unmeasured) > 0
    assert "written:" in stdout
    # one measured step: said at the start, at the end and in the report, not called a median
    note = "1 measured step(s) per contender: a figure is the median of 7 or more"
    assert stdout.count(note) == 2 and f"**Note**: {note}" in text
    assert report["caveats"][0].startswith(note)


def test_the_other_workloads_are_timed_for_every_contender(timed_report):
    names = {c.name for c in contenders(modes=("never",))}
    assert len(names) == 4 + len(SCHEDULES) + 1 + 7 + 1  # the seven PyTorch schedules
    assert set(timed_report["workloads"]) == {"mlp", "cnn", "mlp64"}
    for w in timed_report["workloads"].values():
        rows = w["chunks"]["4"]["contenders"]
        assert set(rows) | set(w["skipped"]) == names
        assert all(row["seconds"]["median"] > 0 for row in rows.values())
        assert w["memory"] == {}


def _fake_timing(names, chunks, wall, cpu):
    """Both processes report the same step times; CPU time split evenly between them."""
    run = {
        "seconds": {n: list(wall[n]) for n in names},
        "cpu": {n: [c / K for c in cpu[n]] for n in names},
    }
    return [{"skipped": {}, "chunks": {str(chunks): run}} for _ in range(K)]


def test_ideal_ratios_and_bubble_follow_their_definitions():
    workload = get_workload("mlp", "tiny")
    chosen = [
        c
        for c in contenders(("gpipe",), ("never",))
        if c.name in ("accumulation", "at-once", "gpipe/gpipe/never", "pytorch/ScheduleGPipe")
    ]
    names = [c.name for c in chosen]
    wall = {
        "accumulation": [4.0, 4.0, 5.0],
        "at-once": [2.0, 2.2, 2.4],
        "gpipe/gpipe/never": [3.0, 2.7, 3.3],
        "pytorch/ScheduleGPipe": [3.0, 3.0, 3.0],
    }
    cpu = {n: [w * K * 0.75 for w in wall[n]] for n in names}  # a quarter of the time idle
    timing = _fake_timing(names, 4, wall, cpu)
    out = figures(workload, chosen, timing, {}, [4], None)
    at = out["chunks"]["4"]
    assert at["ideal"] == pytest.approx(2.2 * 5 / 4)
    assert at["naive_ideal"] == pytest.approx(4.0 * 5 / (4 * 2))
    row = at["contenders"]["gpipe/gpipe/never"]
    assert row["over_ideal"] == pytest.approx(3.0 / 2.75)
    assert row["over_counterpart"] == pytest.approx(1.0)
    assert row["over_counterpart_per_cycle"]["median"] == pytest.approx(1.0)
    assert row["over_counterpart_per_cycle"]["min"] == pytest.approx(0.9)
    # per cycle 3.0 / 2.0, 2.7 / 2.2 and 3.3 / 2.4: the median is the last
    assert row["over_at_once_per_cycle"]["median"] == pytest.approx(3.3 / 2.4)
    assert at["contenders"]["at-once"]["over_at_once_per_cycle"] is None
    assert row["bubble"] == pytest.approx(0.25)
    assert row["schedule_bubble"] == pytest.approx(1 / 5)
    assert row["samples_per_s"] == pytest.approx(workload.batch / 3.0)
    judged = targets({"mlp": out}, None)
    assert judged[0] == {
        "target": "mlp, M=4: gpipe/gpipe/never / pytorch/ScheduleGPipe <= 1.03 per cycle",
        "figure": "1.000 (per cycle 1.000)",
        "met": True,
    }
    assert [t["met"] for t in judged[1:]] == [None] * 9  # nothing at M = 8, no memory pass


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "resnet"], "--workload: unknown 'resnet'; expected mlp, gpt, cnn, mlp64"),
        (["--chunks", "0"], "--chunks must be positive integers, got '0'"),
        (["--chunks", "two"], "--chunks must be a comma list of integers, got 'two'"),
        (["--schedules", "gpipe,pipedream"], "--schedules: unknown 'pipedream'"),
        (["--skip", "deepspeed"], "--skip: 'deepspeed' names no contender"),
        (["--repeats", "0"], "--repeats must be a positive integer, got 0"),
        (["--memory-chunks", "-1"], "--memory-chunks must be 0 (no memory pass) or more, got -1"),
        (["--memory-jobs", "0"], "--memory-jobs must be a positive integer, got 0"),
    ],
)
def test_bad_options_are_one_line_errors(capsys, args, message):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_pytorchs_1f1b_is_not_run_below_its_stages_where_gpipes_runs():
    """``gpipe bench`` times M = 1 by default (the seeds' baseline): PyTorch's Schedule1F1B
    refuses fewer micro-batches than stages, which ended the whole run at its build."""
    by_name = {c.name: c for c in contenders(("1f1b",), ("never",))}
    assert by_name["gpipe/1f1b/never"].not_run_at(1) is None
    theirs = by_name["pytorch/Schedule1F1B"]
    assert (
        theirs.not_run_at(1)
        == f"pytorch/Schedule1F1B takes at least {K} micro-batches on 2 processes"
    )
    assert theirs.not_run_at(K) is None
    assert by_name["pytorch/ScheduleGPipe"].not_run_at(1) is None


def _refuse(w, chunks, x, y):
    raise ValueError(f"no {chunks} here")


def _refuse_on_rank_0(w, chunks, x, y):
    raise RuntimeError("rank 0 only")


def _build_some(chunks: int) -> tuple[list[str], dict[str, str]]:
    """``build_all`` over a contender every process refuses, one the first process alone
    builds and refuses, and two that build."""
    import torch
    import torch.distributed as dist

    from gpipe.bench.contenders import Contender
    from gpipe.comm.process_group import init_process_group

    init_process_group(torch.device("cpu"))
    every = {c.name: c for c in contenders(("gpipe",), ("never",))}
    chosen = [
        Contender("refused", "gpipe", False, _refuse),
        every["at-once"],
        Contender("refused-alone", "baseline", True, _refuse_on_rank_0),
        every["gpipe/gpipe/never"],
    ]
    spec = {"workload": "mlp64", "size": "tiny"}
    runners, failed = build_all(chosen, spec, chunks)
    dist.barrier()
    return list(runners), failed


def test_a_contender_that_fails_to_build_is_left_out_and_the_others_are_built():
    """One library's refusal is a line in the report, not the end of a run of hours: every
    process leaves the failed contender out, agreed, and builds the others."""
    for rank, (built, failed) in run(_build_some, K, (2,), threads=1).items():
        assert built == ["at-once", "gpipe/gpipe/never"], rank
        assert failed == {
            "refused": "failed to build: ValueError: no 2 here",
            "refused-alone": "failed to build: RuntimeError: rank 0 only",
        }, rank


def _timing(chunk_counts, names_at):
    """Fake per-process timings where ``names_at[m]`` ran at M = m, one cycle each."""
    runs = {
        str(m): {
            "seconds": {n: [1.0] for n in names},
            "cpu": {n: [1.0] for n in names},
            "not_run": {},
        }
        for m, names in zip(chunk_counts, names_at, strict=True)
    }
    return [{"skipped": {}, "chunks": runs} for _ in range(K)]


def test_each_schedule_is_labelled_with_its_own_bubble_or_none():
    """The report's "bubble (schedule)" is the schedule's own closed form for equal stages;
    zero-bubble's and the V schedules' depend on the F, B and W times, which the bench does
    not know, so they have none (n/a), not gpipe's (K-1)/(M+K-1)."""
    workload = get_workload("mlp", "tiny")
    names = ["gpipe/gpipe/never", "gpipe/interleaved/never", "gpipe/zero-bubble/never",
             "gpipe/zero-bubble-v/never"]  # fmt: skip
    chosen = [c for c in contenders(tuple(SCHEDULES), ("never",)) if c.name in names]
    rows = figures(workload, chosen, _timing([4], [names]), {}, [4], None)["chunks"]["4"]
    bubbles = {n: row["schedule_bubble"] for n, row in rows["contenders"].items()}
    assert bubbles == {
        "gpipe/gpipe/never": pytest.approx(1 / 5),
        "gpipe/interleaved/never": pytest.approx(1 / 9),  # v = 2 stages per process
        "gpipe/zero-bubble/never": None,
        "gpipe/zero-bubble-v/never": None,
    }
    report = {"command": "gpipe bench", "machine": {}, "workloads": {"mlp": {
        **figures(workload, chosen, _timing([4], [names]), {}, [4], None)}},
        "settings": {"threads": 1, "warmup": 0, "repeats": 1}, "targets": []}  # fmt: skip
    text = markdown(report)
    assert "| gpipe/zero-bubble/never |" in text and "% (n/a) |" in text
    assert "% (20.0%) |" in text


def test_the_markdown_lists_contenders_that_ran_at_some_micro_batch_counts_only():
    """A contender that failed at one M and ran at another has an empty cell, not a
    KeyError after the run."""
    workload = get_workload("mlp", "tiny")
    chosen = [c for c in contenders(("gpipe",), ("never",)) if c.name in ("at-once", "full-batch")]
    timing = _timing([2, 4], [["at-once"], ["at-once", "full-batch"]])
    w = figures(workload, chosen, timing, {}, [2, 4], None)
    report = {"command": "gpipe bench", "machine": {}, "workloads": {"mlp": w},
              "settings": {"threads": 1, "warmup": 0, "repeats": 1}, "targets": []}  # fmt: skip
    lines = markdown(report).splitlines()
    assert "| full-batch |  | 1.000 |" in lines


def test_fewer_than_seven_repeats_and_more_threads_than_cores_are_said():
    """BENCHMARKS.md's figures are medians of 7 or more repeats: a run of fewer says that its
    "medians" are a check, and so does one that asks for more threads than there are cores."""
    assert caveats(BenchOptions(repeats=FEWEST_REPEATS, threads=1), cores=2) == []
    few, crowded = caveats(BenchOptions(repeats=1, threads=4), cores=2)
    assert few.startswith("1 measured step(s) per contender: a figure is the median of 7")
    assert crowded.startswith(f"{K} processes of 4 thread(s) each want {K * 4} cores, but")
    assert caveats(BenchOptions(repeats=9, threads=1), cores=1) == [
        f"{K} processes of 1 thread(s) each want {K} cores, but this machine has 1: the "
        "processes take turns, and the times measure that"
    ]


def test_an_out_folder_that_cannot_be_made_is_refused_before_measuring(tmp_path, capsys):
    """The report is written after hours of measuring: a --out under a file is refused at
    once, in one line, with nothing run."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "results"
    assert main(["bench", "--no-plots", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        f"gpipe: error: --out {out}: Not a directory; expected a folder"
    ), captured.err
    assert captured.out == ""


def test_the_report_goes_to_the_current_folder_by_default(tmp_path, monkeypatch, capsys):
    """Not into the repository's committed results (the README's quick check would write
    tiny-run figures over them): ``bench-results`` where the command runs, checked first."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench-results").write_text("")  # a file in the way: refused before measuring
    assert main(["bench", "--no-plots"]) == 2
    assert "--out bench-results: " in capsys.readouterr().err


def _time_none(spec: dict) -> dict:
    import torch

    from gpipe.comm.process_group import init_process_group

    init_process_group(torch.device("cpu"))
    return timing_pass(spec)


def test_a_micro_batch_count_where_no_contender_runs_times_nothing():
    """Only dualpipe-v chosen, at M = 2 where it does not run: nothing to take turns
    over (it divided by zero), and the other M still timed."""
    spec = {"workload": "mlp64", "size": "tiny", "chunks": [2, 4], "warmup": 0, "repeats": 1,
            "schedules": ["dualpipe-v"], "modes": ["never"],
            "contenders": ["gpipe/dualpipe-v/never"]}  # fmt: skip
    for rank, found in run(_time_none, K, (spec,), threads=1).items():
        assert found["chunks"]["2"]["seconds"] == {}, rank
        assert list(found["chunks"]["2"]["not_run"]) == ["gpipe/dualpipe-v/never"], rank
        assert len(found["chunks"]["4"]["seconds"]["gpipe/dualpipe-v/never"]) == 1, rank
