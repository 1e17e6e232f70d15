"""The simulator: GPipe's analytic bubble and memory, communication, deadlock, speed, the CLI."""

import dataclasses
import itertools
import json
import sys
import time

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from gpipe.cli import main
from gpipe.planning.simulate import (
    Costs,
    analytic_bubble,
    closed_form_bubble,
    closed_form_peak,
    compare,
    predict,
    scenario,
    simulate,
    sub_sequence_costs,
)
from gpipe.runtime.timeline import Event
from gpipe.schedules import (
    SCHEDULES,
    Action,
    Kind,
    Placement,
    Schedule,
    ScheduleError,
    add_skips,
    forward_only,
    gpipe,
    traits,
    validate,
)

F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT
UNIT = Costs(forward=1.0, backward=1.0)


@given(st.integers(1, 16), st.integers(1, 64))
def test_uniform_gpipe_has_the_analytic_bubble(k, m):
    result = simulate(gpipe(k, m), UNIT)
    assert result.bubble == pytest.approx(analytic_bubble(k, m), abs=1e-9)


@given(
    st.integers(1, 8),
    st.integers(1, 16),
    st.floats(0.1, 10.0),
    st.floats(0.0, 10.0),
    st.floats(0.0, 10.0),
)
def test_gpipe_makespan_is_m_plus_k_minus_1_forwards_and_backwards(k, m, f, b, w):
    result = simulate(gpipe(k, m), Costs(forward=f, backward=b, weight=w))
    assert result.makespan == pytest.approx((m + k - 1) * (f + b + w), rel=1e-9)
    assert result.busy == pytest.approx([m * (f + b + w)] * k, rel=1e-9)


@given(st.integers(1, 16), st.integers(1, 64))
def test_gpipe_keeps_every_micro_batch_on_every_stage(k, m):
    assert simulate(gpipe(k, m), UNIT).peak_live == (m,) * k


def test_forward_only_keeps_one_micro_batch_per_stage():
    result = simulate(forward_only(3, 5), Costs(forward=1.0, backward=9.0, activation_bytes=4))
    assert result.peak_live == (1, 1, 1)
    assert result.makespan == 7
    assert result.peak_rank_activation_bytes == (4, 4, 4)


def test_latency_and_bandwidth_delay_each_message_between_ranks():
    # K=2, M=1: F on rank 0, message, F and B on rank 1, message, B on rank 0
    costs = Costs(forward=1.0, backward=2.0, latency=0.5, message_bytes=1000, bandwidth=4000)
    result = simulate(gpipe(2, 1), costs)
    assert result.makespan == pytest.approx(1 + 0.75 + 1 + 2 + 0.75 + 2)
    starts = {(r, str(a)): s for r, a, s, _ in result.events}
    assert starts == {(0, "0F0"): 0.0, (1, "1F0"): 1.75, (1, "1B0"): 2.75, (0, "0B0"): 5.5}


def test_messages_within_a_rank_are_free():
    first, second = gpipe(2, 1).programs  # 0F0 0SEND_F0 | 0RECV_B0 0B0, and stage 1's
    one_rank = validate(Schedule("one-rank", 2, 1, (first[:2] + second + first[2:],), (0, 0)))
    costs = Costs(forward=1.0, backward=1.0, latency=100.0, activation_bytes=[10, 20])
    result = simulate(one_rank, costs)
    assert result.makespan == 4
    assert result.peak_activation_bytes == (10, 20)
    assert result.peak_rank_activation_bytes == (30,)


def test_the_slowest_stage_sets_the_pace():
    # stage 1 takes 3 per pass: rank 0 forwards at 0-2, rank 1 forwards at 1-7 and backwards
    # at 7-13, rank 0 backwards at 10-11 and 13-14
    result = simulate(gpipe(2, 2), Costs(forward=[1, 3], backward=[1, 3]))
    assert result.makespan == 14
    assert result.busy == (4, 12)
    assert result.idle == (10, 2)
    assert result.bubble == pytest.approx(12 / 28)


def test_a_deadlocking_schedule_raises():
    a = Action
    programs = (
        (a(0, Kind.RECV_B, 0), a(0, F, 0), a(0, Kind.SEND_F, 0), a(0, B, 0)),
        (a(1, Kind.RECV_F, 0), a(1, F, 0), a(1, B, 0), a(1, Kind.SEND_B, 0)),
    )
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 waits at 0RECV_B0, rank 1"):
        simulate(Schedule("stuck", 2, 1, programs, (0, 1)), UNIT)


def _names_and_sizes():
    return st.tuples(st.sampled_from(sorted(SCHEDULES)), st.integers(1, 6), st.integers(1, 12))


def _schedule(name: str, k: int, m: int) -> Schedule:
    try:
        return SCHEDULES[name](k, m)
    except ValueError:
        assume(False)
        raise


@given(_names_and_sizes(), st.floats(0.0, 0.5))
def test_every_schedule_runs_each_action_after_what_it_needs(case, latency):
    schedule = _schedule(*case)
    result = simulate(schedule, Costs(forward=1.0, backward=1.0, weight=0.5, latency=latency))
    end = {a: e for _, a, _, e in result.events}
    for rank, a, start, _ in result.events:
        assert schedule.stage_to_rank[a.stage] == rank
        needs = []
        if a.kind is F and a.stage > 0:
            needs.append(Action(a.stage - 1, F, a.microbatch))
        if a.kind is B:
            needs.append(Action(a.stage, F, a.microbatch))
            if a.stage < schedule.n_stages - 1:
                needs.append(Action(a.stage + 1, B, a.microbatch))
        if a.kind is W:
            needs.append(Action(a.stage, B, a.microbatch))
        for need in needs:
            assert start >= end[need] - 1e-9, f"{a} starts before {need} ends"
    per_rank: dict[int, list[tuple[float, float]]] = {}
    for rank, _, start, stop in result.events:
        per_rank.setdefault(rank, []).append((start, stop))
    for spans in per_rank.values():
        assert all(s1 >= e0 - 1e-9 for (_, e0), (s1, _) in itertools.pairwise(spans))
    assert sum(result.busy) == pytest.approx(schedule.n_stages * schedule.n_microbatches * 2.5)


@pytest.mark.skipif("1f1b" not in SCHEDULES, reason="1F1B is not registered")
@given(st.integers(1, 12), st.integers(1, 32))
def test_1f1b_keeps_k_minus_s_micro_batches_and_takes_as_long_as_gpipe(k, m):
    one_f_one_b = simulate(SCHEDULES["1f1b"](k, m), UNIT)
    assert one_f_one_b.peak_live == tuple(min(k - s, m) for s in range(k))
    assert one_f_one_b.makespan == pytest.approx(simulate(gpipe(k, m), UNIT).makespan)


def test_128_stages_and_1024_micro_batches_simulate_exactly():
    schedule = gpipe.__wrapped__(128, 1024)  # uncached: the schedule is large
    start = time.perf_counter()
    result = simulate(schedule, UNIT)
    seconds = time.perf_counter() - start
    print(
        f"simulate gpipe K=128 M=1024 ({sum(map(len, schedule.programs))} actions): {seconds:.3f} s"
    )
    assert result.makespan == (1024 + 127) * 2
    assert len(result.events) == 128 * 1024 * 2


def test_costs_reject_what_cannot_be_a_cost():
    with pytest.raises(ValueError, match=r"Costs.forward must be a finite number >= 0, got -1"):
        Costs(forward=-1, backward=1)
    with pytest.raises(ValueError, match=r"Costs.backward\[1\] must be .* got nan"):
        Costs(forward=1, backward=[1, float("nan")])
    with pytest.raises(ValueError, match="Costs.weight must be a number or a non-empty list"):
        Costs(forward=1, backward=1, weight=[])
    with pytest.raises(ValueError, match="Costs.bandwidth must be a positive number"):
        Costs(forward=1, backward=1, bandwidth=0)
    with pytest.raises(ValueError, match="Costs.latency must be a finite number >= 0"):
        Costs(forward=1, backward=1, latency="1")
    with pytest.raises(ValueError, match="Costs.forward has 3 values, but the schedule has 2"):
        simulate(gpipe(2, 2), Costs(forward=[1, 1, 1], backward=1))


def test_costs_round_trip_through_a_file(tmp_path):
    costs = Costs(forward=[1, 2], backward=3, weight=0.5, latency=0.1, activation_bytes=[5, 6])
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs.to_dict()))
    assert Costs.from_file(path) == costs
    path.write_text('{"forward": 1}')
    with pytest.raises(ValueError, match=r"missing cost fields \['backward'\]"):
        Costs.from_file(path)
    path.write_text('{"forward": 1, "backward": 1, "speed": 2}')
    with pytest.raises(ValueError, match=r"unknown cost fields \['speed'\]"):
        Costs.from_file(path)
    path.write_text('{"forward": 1, "backward": -2}')
    with pytest.raises(ValueError, match="costs.json: Costs.backward must be"):
        Costs.from_file(path)


def test_compare_notes_schedules_that_reject_the_sizes(monkeypatch):
    def picky(n_stages: int, n_microbatches: int) -> Schedule:
        raise ValueError("needs an even number of stages")

    monkeypatch.setitem(SCHEDULES, "picky", picky)
    rows = compare(["gpipe", "picky"], 3, 4, UNIT)
    assert rows[0]["schedule"] == "gpipe"
    assert rows[0]["bubble"] == pytest.approx(analytic_bubble(3, 4))
    assert rows[0]["peak_live"] == 4
    assert rows[1] == {"schedule": "picky", "note": "skipped: needs an even number of stages"}


def test_predict_replays_a_schedule_with_measured_means():
    measured = [
        Event(s, s, k, mb, 0.0, duration)
        for s in range(2)
        for mb in range(2)
        for k, duration in (("F", 1.0), ("B", 2.0), ("SEND_F", 0.5))
    ]
    predicted = predict(gpipe(2, 2), measured)
    assert len(predicted) == 8
    assert max(e.end for e in predicted) == (2 + 2 - 1) * 3
    assert [e.start for e in predicted] == sorted(e.start for e in predicted)


def test_cli_prints_a_table_of_every_schedule(capsys):
    assert main(["simulate", "--stages", "4", "--chunks", "8"]) == 0
    out = capsys.readouterr().out
    gpipe_row = next(line for line in out.splitlines() if line.startswith("gpipe "))
    # makespan (M+K-1)(F+B+W) = 33, bubble and its formula 3/11, 8 held, 8 live per stage
    assert gpipe_row.split() == ["gpipe", "33", "27.3%", "27.3%", "8", "8", "8", "8", "8"]
    assert all(name in out for name in SCHEDULES)
    zbv_row = next(line for line in out.splitlines() if line.startswith("zero-bubble-v "))
    # F = B = W = 1 a process, half of it a stage: 3 x 0.5 idle beside 8 x 3 of work
    assert zbv_row.split()[2:5] == ["5.9%", "5.9%", "4"]


def test_cli_reads_costs_and_reports_bad_input_in_one_line(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text('{"forward": 1, "backward": 1, "activation_bytes": 1048576}')
    assert main(["simulate", "--stages", "2", "--chunks", "2", "--schedule", "gpipe",
                 "--costs", str(costs)]) == 0  # fmt: skip
    assert "2.0 MiB" in capsys.readouterr().out
    costs.write_text('{"forward": [1, 2, 3], "backward": 1}')
    for bad in (["--bogus"], ["--stages", "0"], ["--schedule", "gpipe,nope"],
                ["--costs", str(costs)], ["--costs", str(tmp_path / "none.json")]):  # fmt: skip
        assert main(["simulate", *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gpipe: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("name", "v"), [("v-half", 3), ("v-min", 1), ("zero-bubble-v", 4), ("dualpipe-v", 3)]
)
def test_cli_refuses_stages_per_process_that_a_v_named_does_not_hold(capsys, name, v):
    """A V holds two stages per process whatever --virtual-stages says: another number is
    refused naming the flag, what was given and what a V takes, not silently ignored."""
    assert main(["simulate", "--schedule", name, "--virtual-stages", str(v)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert (
        f"--schedule {name} places two stages per process in a V: --virtual-stages is 2, got {v}"
        in err
    )
    assert main(["simulate", "--schedule", name, "--virtual-stages", "2"]) == 0
    capsys.readouterr()


def test_cli_refuses_virtual_stages_for_schedules_of_one_stage_per_process(capsys):
    """`--schedule 1f1b --virtual-stages 3` printed 1F1B's row as if the flag meant nothing."""
    argv = ["simulate", "--stages", "4", "--chunks", "8", "--virtual-stages", "3"]
    assert main([*argv, "--schedule", "gpipe,1f1b"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--virtual-stages 3: --schedule gpipe,1f1b places one stage per process" in err
    assert main([*argv, "--schedule", "1f1b,interleaved"]) == 0  # interleaved's
    capsys.readouterr()
    one = ["simulate", "--stages", "4", "--chunks", "8", "--virtual-stages", "1"]
    assert main([*one, "--schedule", "gpipe"]) == 0  # 1 is what they run: as gpipe train
    capsys.readouterr()


def test_cli_virtual_stages_named_beside_a_looped_schedule_are_its(capsys):
    """--virtual-stages 4 is interleaved's when it is named beside a V: both run, the V on
    its two, rather than the V's refusal ending the comparison."""
    argv = ["simulate", "--stages", "4", "--chunks", "8", "--virtual-stages", "4"]
    assert main([*argv, "--schedule", "interleaved,zero-bubble-v"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line]
    assert "interleaved" in rows and "zero-bubble-v" in rows


def test_cli_virtual_stages_of_every_schedule_unnamed_are_the_looped_ones(capsys):
    """With no --schedule, --virtual-stages 3 is the looped schedules', beside the V's two
    and one of the others: every schedule runs (no row skipped), and its peak live column
    has one entry per stage, 2 processes x its stages per process."""
    assert main(["simulate", "--stages", "2", "--chunks", "6", "--virtual-stages", "3"]) == 0
    lines = map(str.split, capsys.readouterr().out.splitlines())
    rows = {cells[0]: cells[1:] for cells in lines if cells and cells[0] in SCHEDULES}
    assert list(rows) == list(SCHEDULES)
    assert not [name for name, cells in rows.items() if cells[0] == "skipped:"]
    per_process = {Placement.ONE_PER_RANK: 1, Placement.LOOPED: 3, Placement.V: 2}
    peaks = {name: len(cells[4:]) for name, cells in rows.items()}
    assert peaks == {name: 2 * per_process[traits(name).placement] for name in SCHEDULES}


def test_cli_exits_2_saying_why_when_every_schedule_named_is_skipped(capsys):
    """v-min on 4 processes needs 3 micro-batches: with 1, nothing is simulated, which is an
    error in one line on stderr; beside a schedule that runs, it is a row of the table."""
    assert main(["simulate", "--schedule", "v-min", "--chunks", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith(
        "gpipe: error: --schedule v-min: v-min needs at least 3 micro-batches for 4 ranks"
    )
    assert main(["simulate", "--schedule", "v-min,gpipe", "--chunks", "1"]) == 0
    assert "v-min     skipped: v-min needs at least 3" in capsys.readouterr().out


def test_cli_counts_one_stage_and_one_micro_batch_in_the_singular(capsys):
    assert main(["simulate", "--stages", "1", "--chunks", "1", "--schedule", "gpipe"]) == 0
    assert capsys.readouterr().out.startswith("1 stage, 1 micro-batch, costs ")


def test_cli_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timelines.png"
    assert main(["simulate", "--stages", "3", "--chunks", "4", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["simulate", "--plot", str(tmp_path / "t.png")]) == 2
    assert "pip install 'gpipe-parallel[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists()


@given(k=st.integers(1, 8), v=st.integers(1, 4), groups=st.integers(1, 6))
def test_interleaved_divides_the_bubble_by_v(k, v, groups):
    """Equal costs split over v stages per rank: bubble (K-1)/v / (M + (K-1)/v)."""
    m = k * groups
    schedule, costs = scenario("interleaved", k, m, Costs(forward=1.0, backward=2.0), v)
    assert schedule.n_stages == k * v
    assert list(schedule.stage_to_rank) == [s % k for s in range(k * v)]
    expected = (k - 1) / v / (m + (k - 1) / v)
    assert simulate(schedule, costs).bubble == pytest.approx(expected, abs=1e-9)


def test_a_skip_over_a_slow_link_delays_the_stage_that_pops_it():
    """K=3, M=1: stage 0 sends a skip straight to stage 2; a big one arrives after the
    regular chain does, and stage 2 waits for it."""
    routes = ((0, 2),)
    cheap = Costs(forward=1.0, backward=1.0, latency=0.25, bandwidth=1000.0)
    costly = dataclasses.replace(cheap, skip_bytes={(0, 2): 4000})
    plain = simulate(add_skips(gpipe(3, 1), routes), cheap)
    slow = simulate(add_skips(gpipe(3, 1), routes), costly)
    starts = {str(a): s for _, a, s, _ in slow.events}
    assert starts["2F0"] == pytest.approx(1 + 4.25)  # the skip, not the chain (2.5)
    assert starts["0B0"] == pytest.approx(starts["2B0"] + 1 + 4.25)  # its gradient comes back
    assert slow.makespan > plain.makespan


@given(_names_and_sizes())
def test_skips_keep_every_schedule_valid_and_are_held_where_they_arrive(case):
    schedule = _schedule(*case)
    k = schedule.n_stages
    assume(k >= 2)
    routes = tuple((s, d) for s in range(k) for d in range(s + 1, k))
    with_skips = validate(add_skips(schedule, routes))
    costs = Costs(forward=1.0, backward=1.0, activation_bytes=10.0, skip_bytes={(0, k - 1): 5})
    result = simulate(with_skips, costs)
    plain = simulate(schedule, dataclasses.replace(costs, skip_bytes={}))
    assert result.peak_live == plain.peak_live
    last = result.peak_activation_bytes[-1]
    # its skips, for each micro-batch, unless they come from its own rank (a V's first stage)
    copied = schedule.stage_to_rank[0] != schedule.stage_to_rank[-1]
    assert last == plain.peak_activation_bytes[-1] * (15 / 10 if copied else 1)


def test_skip_bytes_read_from_a_file_and_refuse_bad_routes(tmp_path):
    costs = Costs(forward=1, backward=1, skip_bytes={(0, 2): 8.0})
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs.to_dict()))
    assert '"0->2": 8.0' in path.read_text()
    assert Costs.from_file(path) == costs
    with pytest.raises(ValueError, match="source < destination.*got '2->1'"):
        Costs(forward=1, backward=1, skip_bytes={"2->1": 1})
    with pytest.raises(ValueError, match="route 0->5, but the schedule has 3 stages"):
        simulate(gpipe(3, 2), Costs(forward=1, backward=1, skip_bytes={(0, 5): 1}))


def test_checkpoint_never_is_the_default_and_changes_nothing():
    costs = Costs(forward=1.0, backward=2.0, activation_bytes=10, message_bytes=1)
    for name in SCHEDULES:
        schedule, cost = scenario(name, 2, 4, costs)
        assert simulate(schedule, cost, "never") == simulate(schedule, cost)


@pytest.mark.parametrize(
    ("mode", "makespan", "stage0_r", "stage0_b"),
    [
        ("always", 8, [(2, 3), (6, 7)], [(5, 6), (7, 8)]),
        ("except_last", 7, [(5, 6)], [(4, 5), (6, 7)]),
    ],
)
def test_a_recomputed_micro_batch_runs_its_forward_again_ahead_of_its_gradient(
    mode, makespan, stage0_r, stage0_b
):
    """K = 2, M = 2, F = B = 1: a recomputed micro-batch's R (cost F) runs before its
    gradient arrives, where stage 0 would otherwise wait (recomputing inside B would take
    one more unit); between its forward and its R it keeps message_bytes (1), then its
    graph (10)."""
    costs = Costs(forward=1.0, backward=1.0, activation_bytes=10, message_bytes=1)
    result = simulate(gpipe(2, 2), costs, checkpoint=mode)
    assert result.makespan == makespan
    for kind, want in ((Kind.RECOMPUTE, stage0_r), (B, stage0_b)):
        assert [(s, e) for r, a, s, e in result.events if r == 0 and a.kind is kind] == want
    assert result.peak_live == (2, 2)
    assert result.peak_activation_bytes == (11, 11)  # one graph rebuilt, one input kept
    assert result.peak_rank_activation_bytes == (11, 11)
    assert result.checkpoint == mode


@given(_names_and_sizes(), st.sampled_from(["always", "except_last"]), st.floats(0.1, 3.0))
def test_recomputation_costs_one_forward_per_recomputed_micro_batch(case, mode, f):
    schedule = _schedule(*case)
    k, m = schedule.n_stages, schedule.n_microbatches
    plain = simulate(schedule, Costs(forward=f, backward=1.0, weight=0.5))
    result = simulate(schedule, Costs(forward=f, backward=1.0, weight=0.5), checkpoint=mode)
    recomputed = m if mode == "always" else m - 1
    assert sum(result.busy) == pytest.approx(sum(plain.busy) + k * recomputed * f)
    assert result.peak_live == plain.peak_live
    assert result.makespan >= plain.makespan - 1e-9


@given(st.sampled_from(["gpipe", "1f1b"]), st.integers(1, 6), st.integers(1, 12))
def test_always_recomputing_holds_one_graph_and_the_other_inputs(name, k, m):
    """Without a split backward a graph lives from its recomputation to the end of its B."""
    costs = Costs(forward=1.0, backward=2.0, activation_bytes=100, message_bytes=3)
    result = simulate(SCHEDULES[name](k, m), costs, checkpoint="always")
    assert result.peak_activation_bytes == tuple(100 + (n - 1) * 3 for n in result.peak_live)
    assert result.peak_rank_activation_bytes == result.peak_activation_bytes


def test_forward_only_recomputes_nothing_and_a_bad_mode_is_named():
    costs = Costs(forward=1.0, backward=9.0, activation_bytes=4)
    assert simulate(forward_only(3, 5), costs, "always").makespan == 7
    with pytest.raises(ValueError, match="checkpoint is not one of .* got 'sometimes'"):
        simulate(gpipe(2, 2), costs, "sometimes")


COST = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.floats(0.05, 3.0))


@given(
    st.sampled_from(sorted(SCHEDULES)),
    st.integers(1, 5),
    st.integers(1, 24),
    st.integers(1, 3),
    COST.filter(bool),
    COST.filter(bool),
    COST,
)
def test_each_schedule_has_its_own_closed_form_bubble_and_the_simulator_gives_it(
    name, k, m, v, f, b, w
):
    closed = closed_form_bubble(name, k, m, v, f, b, w)
    assume(closed is not None)
    schedule, costs = scenario(name, k, m, Costs(forward=f, backward=b, weight=w), v)
    assert simulate(schedule, costs).bubble == pytest.approx(closed, abs=1e-9)


@given(
    st.sampled_from(sorted(SCHEDULES)),
    st.integers(1, 5),
    st.integers(1, 24),
    st.integers(1, 4),
    COST.filter(bool),
    COST.filter(bool),
    COST,
    st.sampled_from([1.0, 3.0]),
)
def test_each_schedule_has_its_peak_memory_in_closed_form_and_the_simulator_gives_it(
    name, k, m, v, f, b, w, nbytes
):
    """Per rank, under any costs: the order of a rank's actions alone sets what it holds."""
    try:
        schedule, costs = scenario(name, k, m, Costs(f, b, w, activation_bytes=nbytes), v)
    except ValueError:
        assert closed_form_peak(name, k, m, v) is None
        return
    per_rank = schedule.n_stages // k
    closed = closed_form_peak(name, k, m, per_rank)
    got = simulate(schedule, costs).peak_rank_activation_bytes
    assert got == pytest.approx([x * nbytes for x in closed], abs=1e-9)


def test_closed_form_bubbles_where_they_hold_and_none_where_not():
    assert closed_form_bubble("gpipe", 4, 8) == closed_form_bubble("1f1b", 4, 8) == 3 / 11
    assert closed_form_bubble("interleaved", 4, 8, 2) == 3 / 19
    assert closed_form_bubble("interleaved", 4, 6, 2) is None  # M not a multiple of K
    assert closed_form_bubble("zero-bubble", 4, 8, 1, 1, 1, 1) == 3 / 27
    assert closed_form_bubble("zero-bubble", 4, 3, 1, 1, 1, 1) is None  # M < K
    assert closed_form_bubble("zero-bubble", 4, 8, 1, 1, 1, 2) is None  # W > F, B
    # ZB-V, F = B = W: half a B per rank of the V, 3 x 0.5 idle beside 8 x 3 of work
    assert closed_form_bubble("zero-bubble-v", 4, 8, 2, 1, 1, 1) == 1.5 / 25.5
    assert closed_form_bubble("zero-bubble-v", 4, 6, 2, 1, 1, 1) is None  # M < 2K - 1
    assert closed_form_bubble("zero-bubble-v", 4, 8, 2, 2, 1, 1) is None  # F > B
    assert closed_form_bubble("dualpipe-v", 4, 8, 2, 1, 1, 1) == 1.5 / 25.5
    assert closed_form_bubble("dualpipe-v", 4, 8, 2, 1, 2, 1) is None  # B > F
    with pytest.raises(ValueError, match="schedule must be one of"):
        closed_form_bubble("nope", 4, 8)
    with pytest.raises(ValueError, match="virtual_stages must be a positive integer, got 0"):
        closed_form_bubble("interleaved", 4, 8, 0)


def test_closed_form_peaks_rank_by_rank():
    assert closed_form_peak("gpipe", 4, 8) == (8, 8, 8, 8)
    assert closed_form_peak("1f1b", 4, 8) == (4, 3, 2, 1)
    assert closed_form_peak("interleaved", 4, 8, 2) == (5.5, 4.5, 3.5, 2.5)
    assert closed_form_peak("interleaved-zero-bubble", 4, 8, 2) == (5.5, 5, 4.5, 4)
    # ZB-V's busiest rank holds what 1F1B's does; DualPipeV half a micro-batch more
    assert closed_form_peak("zero-bubble-v", 4, 3) == (2, 2.5, 3, 3)
    assert closed_form_peak("zero-bubble-v", 4, 8) == (4, 4, 4, 4)
    assert closed_form_peak("dualpipe-v", 4, 8) == (4.5,) * 4
    assert closed_form_peak("dualpipe-v", 4, 7) is None  # it needs M >= 2K
    assert closed_form_peak("interleaved", 4, 6, 2) is None  # M in rounds of K


@pytest.mark.parametrize(
    ("overlap", "bucket_bytes", "exposed"),
    [(False, None, 4.0), (True, None, 4.0), (False, 1.0, 4.0), (True, 1.0, 2.5)],
)
def test_replicas_add_their_gradient_all_reduce_to_the_step(overlap, bucket_bytes, exposed):
    """K = 2, M = 4, F = 1, B = 2: each stage's 4 gradient bytes over a ring of 2 replicas at
    1 byte/s take 2 x 1/2 x 4 = 4 s. In one bucket (the default for so few bytes) they start
    when the last backward ends, overlapped or not; in four 1-byte buckets, overlapped, the
    buckets are ready 0.5, 1, 1.5 and 2 s into that backward and take 1 s each, one after
    the other: the last ends 4.5 s after the backward began, 2.5 s after it ended."""
    costs = Costs(forward=1.0, backward=2.0, grad_bytes=4.0, bandwidth=1.0)
    alone = simulate(gpipe(2, 4), costs)
    result = simulate(
        gpipe(2, 4), costs, data_parallel=2, overlap=overlap, bucket_bytes=bucket_bytes
    )
    assert result.allreduce_exposed == (exposed, exposed)
    assert result.makespan == alone.makespan + exposed
    assert simulate(gpipe(2, 4), costs, data_parallel=1).allreduce_exposed == (0.0, 0.0)
    with pytest.raises(ValueError, match="data_parallel must be a positive integer, got 0"):
        simulate(gpipe(2, 4), costs, data_parallel=0)


def test_cli_adds_the_all_reduce_of_replicas(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text('{"forward": 1, "backward": 2, "grad_bytes": 4, "bandwidth": 1}')
    args = ["simulate", "--stages", "2", "--chunks", "4", "--costs", str(costs)]
    assert main([*args, "--schedule", "gpipe", "--data-parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 replicas" in out
    row = next(line for line in out.splitlines() if line.startswith("gpipe "))
    assert row.split()[:3] == ["gpipe", "19", "4"]  # 15 alone, 4 s of all-reduce exposed
    assert main([*args, "--data-parallel", "0"]) == 2
    assert "--data-parallel must be a positive integer, got 0" in capsys.readouterr().err


def test_layers_recomputed_selectively_lengthen_every_backward():
    plain = simulate(gpipe(2, 3), Costs(forward=1.0, backward=2.0))
    again = simulate(gpipe(2, 3), Costs(forward=1.0, backward=2.0, recompute=0.5))
    assert again.makespan == pytest.approx(plain.makespan + 4 * 0.5)  # (M + K - 1) backwards
    assert sum(again.busy) == pytest.approx(sum(plain.busy) + 2 * 3 * 0.5)


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("s", [2, 4])
def test_sub_sequences_shrink_fill_and_drain_and_1f1b_holds_k_minus_1_plus_s_units(k, s):
    """Micro-batches as S sub-sequences (Pipeline(seq_chunks=S)): units of 1/S a micro-batch,
    so fill and drain take (K - 1) of them, and 1F1B's first stage holds K - 1 + S units."""
    m, f, b = 8, 1.0, 2.0
    costs = Costs(forward=f, backward=b, activation_bytes=1e6)
    rows = {r["schedule"]: r for r in compare(["gpipe", "1f1b"], k, m, costs, seq_chunks=s)}
    for row in rows.values():
        assert row["makespan"] == pytest.approx(m * (f + b) + (k - 1) * (f + b) / s)
        assert row["closed_form_bubble"] is None and row["closed_form_peak"] is None
    whole = {r["schedule"]: r for r in compare(["1f1b"], k, m, costs)}["1f1b"]
    assert rows["1f1b"]["bubble"] < whole["bubble"]
    held = (k - 1 + s) / s
    assert rows["1f1b"]["peak_live_per_stage"][0] == pytest.approx(held)
    assert rows["1f1b"]["peak_activation_bytes"] == pytest.approx(held * 1e6)
    assert rows["gpipe"]["peak_live_per_stage"] == [m] * k


def test_sub_sequence_costs_cut_each_micro_batch_and_the_others_are_noted():
    costs = Costs(forward=2, backward=4, activation_bytes=[8.0, 4.0], message_bytes=6.0)
    cut = sub_sequence_costs(costs.with_tokens([1, 3]), 2, 2)
    assert cut.microbatch_scale == (0.25, 0.25, 0.75, 0.75)
    assert cut.activation_bytes == (4.0, 2.0) and cut.message_bytes == 3.0
    assert cut.forward == 2 and cut.backward == 4  # a micro-batch's, scaled per unit
    (row,) = compare(["interleaved"], 2, 4, costs, seq_chunks=2)
    assert "seq_chunks runs with the schedules" in row["note"]


def test_cli_simulates_sub_sequences_and_refuses_what_does_not_show_them(tmp_path, capsys):
    assert main(["simulate", "--stages", "2", "--chunks", "8", "--schedule", "1f1b",
                 "--seq-chunks", "4"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "8 micro-batches, each as 4 sub-sequences" in out
    row = next(line for line in out.splitlines() if line.startswith("1f1b "))
    assert row.split()[-2:] == ["1.25", "1"]  # micro-batches' worth held, per stage
    for bad, words in (
        (["--seq-chunks", "0"], "--seq-chunks must be a positive integer, got 0"),
        (["--seq-chunks", "2", "--html", str(tmp_path / "p.html")], "with --html yet"),
    ):
        assert main(["simulate", *bad]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
