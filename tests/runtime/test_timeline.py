"""Timelines record what the runtime ran, and export to traces and charts that tools load."""

import json
import sys

import pytest
from torch.nn.functional import mse_loss

from gpipe import GPipe
from gpipe.runtime.timeline import Event, Recorder, merge, plot_gantt, to_chrome
from gpipe.schedules import Action, Kind, add_recompute, gpipe

from .. import distributed_cases as cases
from ..small_models import batch, mlp
from ..workers import run


def _traced_step(chunks: int = 4) -> list[Event]:
    pipe = GPipe(mlp(), [4, 4], devices=["cpu"] * 2, chunks=chunks, trace=True)
    x, y = batch(8)
    mse_loss(pipe(x), y).backward()
    return pipe.timeline()


def _except_last(k: int, m: int):
    """The GPipe schedule as the default checkpoint mode runs it: every micro-batch but the
    last recomputed ahead of its backward."""
    return add_recompute(gpipe(k, m), frozenset(range(m - 1)))


def _compute(events: list[Event], stage: int) -> list[tuple[str, int]]:
    return [(e.kind, e.microbatch) for e in events if e.stage == stage and e.is_compute]


def test_a_gpipe_step_records_every_pass_in_schedule_order():
    events = _traced_step()
    assert all(0 <= e.start <= e.end for e in events)
    assert {e.rank for e in events} == {0}
    for stage in range(2):
        expected = [(a.kind.value, a.microbatch) for a in _except_last(2, 4).compute_only(stage)]
        assert _compute(events, stage) == expected


def test_forward_and_its_backward_are_one_step_and_the_next_forward_starts_another():
    pipe = GPipe(mlp(), [4, 4], devices=["cpu"] * 2, chunks=2, trace=True)
    x, y = batch(4)
    mse_loss(pipe(x), y).backward()
    pipe(x)
    assert len(pipe.recorder) == 2
    # except_last: micro-batch 0 is recomputed (R) ahead of its backward
    assert {e.kind for e in pipe.recorder.events(0) if e.is_compute} == {"F", "R", "B"}
    assert {e.kind for e in pipe.timeline() if e.is_compute} == {"F"}


def test_timeline_without_trace_says_how_to_enable_it():
    pipe = GPipe(mlp(), [4, 4], devices=["cpu"] * 2)
    assert pipe.recorder is None
    with pytest.raises(RuntimeError, match="pass trace=True to GPipe"):
        pipe.timeline()


def test_recorder_keeps_only_the_last_steps():
    recorder = Recorder(rank=3, keep=2)
    for step in range(5):
        recorder.step()
        recorder.on_action(Action(0, Kind.FORWARD, step), 1.0, 2.0)
    recorder.step()
    recorder.step()  # a step that recorded nothing does not push out a recorded one
    assert len(recorder) == 2
    assert [e.microbatch for e in recorder.events(0)] == [4]
    assert recorder.events() == []
    with pytest.raises(IndexError, match=r"step must be an integer in \[-2, 2\), got -3"):
        recorder.events(-3)
    recorder.clear()
    assert len(recorder) == 1 and recorder.events() == []


def test_recorder_rejects_bad_arguments():
    with pytest.raises(ValueError, match="keep must be a positive integer, got 0"):
        Recorder(keep=0)
    with pytest.raises(ValueError, match="rank must be a non-negative integer, got -1"):
        Recorder(rank=-1)


def test_merge_orders_the_events_of_several_ranks_by_start():
    a = [Event(0, 0, "F", 0, 0.0, 1.0), Event(0, 0, "F", 1, 2.0, 3.0)]
    b = [Event(1, 1, "F", 0, 1.0, 2.0)]
    assert merge([a, b]) == [a[0], b[0], a[1]]


def test_chrome_trace_is_json_with_one_complete_event_per_action(tmp_path):
    events = _traced_step()
    path = tmp_path / "trace.json"
    trace = to_chrome(events, path)
    assert json.loads(path.read_text()) == trace
    assert trace["displayTimeUnit"] == "ms"
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(events)
    for e in complete:
        assert {"ph", "ts", "dur", "pid", "tid", "name"} <= e.keys()
        assert e["dur"] >= 0 and e["cat"] in ("compute", "comm")
    assert {e["name"] for e in complete} >= {"F0", "B3", "SEND_F0", "RECV_B2"}
    names = {
        (e["name"], e["tid"], e["args"]["name"])
        for e in trace["traceEvents"]
        if e["ph"] == "M" and "name" in e["args"]
    }
    assert names == {
        ("process_name", 0, "rank 0"),
        ("thread_name", 0, "stage 0"),
        ("thread_name", 1, "stage 1"),
    }


def test_predicted_events_go_to_processes_of_their_own():
    measured = [Event(r, r, "F", 0, 0.0, 1.0) for r in range(2)]
    predicted = [Event(r, r, "F", 0, 0.0, 0.5) for r in range(2)]
    trace = to_chrome(measured, predicted=predicted)["traceEvents"]
    pids = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert pids == {0: "rank 0", 1: "rank 1", 2: "predicted rank 0", 3: "predicted rank 1"}
    durations = {(e["pid"], e["dur"]) for e in trace if e["ph"] == "X"}
    assert durations == {(0, 1e6), (1, 1e6), (2, 5e5), (3, 5e5)}


def test_gantt_chart_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    events = _traced_step()
    predicted = [Event(0, e.stage, e.kind, e.microbatch, e.start, e.end) for e in events]
    path = plot_gantt(events, tmp_path / "gantt.png", predicted=predicted, title="GPipe K=2")
    assert path == tmp_path / "gantt.png"
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 1000


def test_gantt_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install 'gpipe-parallel\[plot\]'"):
        plot_gantt([], tmp_path / "gantt.png")


def test_pipeline_timeline_merges_the_events_of_every_rank():
    results = run(cases.traced, 2, threads=1)
    step, evaluate = results[0]["step"], results[0]["evaluate"]
    assert results[1]["step"] == step
    assert {e.rank for e in step} == {0, 1}
    for rank in range(2):
        assert {e.stage for e in step if e.rank == rank} == {rank}
        expected = [(a.kind.value, a.microbatch) for a in _except_last(2, 4).compute_only(rank)]
        assert _compute(step, rank) == expected
    assert {e.kind for e in evaluate if e.is_compute} == {"F"}
    assert {e.rank for e in evaluate} == {0, 1}
