"""`gpipe bench`: the report's structure on a tiny run, its arithmetic on made-up timings,
and clear errors for bad options. No timing is asserted: figures depend on the machine."""

import contextlib
import io
import json

import pytest

from gpipe.bench.contenders import K, contenders
from gpipe.bench.report import NOT_MEASURED, figures, targets
from gpipe.bench.workloads import get_workload
from gpipe.cli import main
from gpipe.schedules import SCHEDULES


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
        assert row["schedule_bubble"] > 0
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
