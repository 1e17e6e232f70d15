"""One source of truth: the page's JavaScript, run in node on a grid of (schedule, K, M, v,
costs, checkpoint), gives action for action the programs of ``gpipe.schedules``'s generators
and the times, bubble and memory of ``gpipe.planning.simulate``, and draws messages that agree."""

import itertools
import json
import math
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpipe.planning.bubbles import split_costs
from gpipe.planning.simulate import (
    Costs,
    closed_form_bubble,
    closed_form_peak,
    scenario,
    simulate,
)
from gpipe.runtime.recompute import should_checkpoint
from gpipe.schedules import SCHEDULES, Placement, build, from_csv, to_csv, traits
from gpipe.view import asset_path
from gpipe.view.page import costs_json, schedule_json

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(
    NODE is None, reason="node is not installed, so the page's JavaScript cannot run here"
)
RUNNER = Path(__file__).with_name("view_parity.js")
SCRIPTS = ("schedule.js", "simulate.js")
COMPUTE = ("F", "B", "W", "R")
MODES = ("never", "except_last", "always")


def _costs(kind: str, k: int, m: int = 1) -> Costs:
    if kind == "tokens":  # micro-batches of packed sequences, each costing as its tokens
        rng = random.Random(m)
        tokens = [rng.choice((50, 120, 300, 1000)) for _ in range(m)]
        return Costs(
            forward=1.0,
            backward=2.0,
            weight=0.5,
            latency=0.05,
            message_bytes=1.0,
            activation_bytes=10.0,
        ).with_tokens(tokens)
    if kind == "unit":
        return Costs(forward=1.0, backward=1.0, weight=1.0)
    if kind == "links":
        return Costs(
            forward=1.0,
            backward=2.0,
            weight=0.5,
            latency=0.1,
            message_bytes=3e6,
            bandwidth=1e7,
            activation_bytes=1e8,
        )
    if kind == "no-weight":
        return Costs(forward=1.5, backward=2.5, message_bytes=2.0, activation_bytes=7.0)
    rng = random.Random(k)  # uneven ranks, one value each

    def draw(low: float, high: float) -> list[float]:
        return [round(rng.uniform(low, high), 3) for _ in range(k)]

    return Costs(
        forward=draw(0.5, 2),
        backward=draw(0.5, 3),
        weight=draw(0, 1),
        latency=0.05,
        message_bytes=5.0,
        activation_bytes=draw(10, 100),
    )


def _grid() -> list[dict]:
    cases = []
    for name, k, m, costs, mode in itertools.product(
        sorted(SCHEDULES), (1, 2, 3, 4), (1, 2, 3, 4, 6, 8),
        ("unit", "links", "no-weight", "uneven", "tokens"), MODES,
    ):  # fmt: skip
        for v in (1, 2, 3) if traits(name).placement is Placement.LOOPED else (2,):
            cases.append(
                {
                    "schedule": name,
                    "stages": k,
                    "chunks": m,
                    "virtual_stages": v,
                    "costs": costs,
                    "checkpoint": mode,
                }
            )
    return cases


def _page_simulates(payload: dict) -> list:
    """What the page's own scripts compute for ``payload``'s cases, run by node."""
    done = subprocess.run(
        [NODE, str(RUNNER)],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def runs() -> list[tuple[dict, dict]]:
    """Each case with what the page's scripts computed for it, all in one node process."""
    cases = _grid()
    payload = {
        "scripts": [str(asset_path(name)) for name in SCRIPTS],
        "cases": [
            {**c, "costs": costs_json(_costs(c["costs"], c["stages"], c["chunks"]))} for c in cases
        ],
    }
    found = _page_simulates(payload)
    results = found
    assert len(results) == len(cases)
    return list(zip(cases, results, strict=True))


def _label(case: dict) -> str:
    return "{schedule} K={stages} M={chunks} v={virtual_stages} {costs} {checkpoint}".format(**case)


def _kind(name: str) -> str:
    """``F`` of ``1F0``, ``RECV_B`` of ``0RECV_B3``, ``SEND_SKIP`` of ``0SEND_SKIP3@2``."""
    match = re.fullmatch(r"\d+([A-Z_]+?)\d+(@\d+)?", name)
    assert match is not None, name
    return match.group(1)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


def test_the_grid_covers_every_schedule_and_checkpoint_mode(runs):
    played = {(c["schedule"], c["checkpoint"]) for c, js in runs if "error" not in js}
    assert played == set(itertools.product(SCHEDULES, MODES))
    assert sum("error" in js for _, js in runs) > 0  # interleaved's M % K rule is covered


def test_programs_are_the_python_generators_action_for_action(runs):
    for case, js in runs:
        costs = _costs(case["costs"], case["stages"], case["chunks"])
        try:
            schedule, _ = scenario(
                case["schedule"], case["stages"], case["chunks"], costs, case["virtual_stages"]
            )
        except ValueError as exc:
            assert js == {"error": str(exc)}, _label(case)
            continue
        assert "error" not in js, (_label(case), js)
        python = [[str(a) for a in program] for program in schedule.programs]
        assert js["programs"] == python, _label(case)
        assert js["stage_to_rank"] == list(schedule.stage_to_rank), _label(case)
        assert js["split_backward"] == schedule.split_backward, _label(case)


def test_simulated_times_bubble_and_memory_are_the_python_simulators(runs):
    for case, js in runs:
        if "error" in js:
            continue
        label = _label(case)
        costs = _costs(case["costs"], case["stages"], case["chunks"])
        schedule, split = scenario(
            case["schedule"], case["stages"], case["chunks"], costs, case["virtual_stages"]
        )
        result = simulate(schedule, split, case["checkpoint"])
        # the programs simulated: with R actions where the checkpoint mode recomputes
        assert js["simulated"] == [[str(a) for a in p] for p in result.schedule.programs], label
        for rank in range(schedule.n_ranks):
            python = [(str(a), s, e) for r, a, s, e in result.events if r == rank]
            page = [(n, s, e) for n, s, e in js["spans"][rank] if _kind(n) in COMPUTE]
            assert [n for n, _, _ in page] == [n for n, _, _ in python], label
            for (name, s1, e1), (_, s2, e2) in zip(page, python, strict=True):
                assert _close(s1, s2) and _close(e1, e2), (label, name, (s1, e1), (s2, e2))
        assert _close(js["makespan"], result.makespan), label
        assert js["busy"] == pytest.approx(result.busy, rel=1e-12, abs=1e-12), label
        assert js["idle"] == pytest.approx(result.idle, rel=1e-12, abs=1e-12), label
        assert _close(js["bubble"], result.bubble), label
        assert tuple(js["peak_live"]) == result.peak_live, label
        for page, python in (
            (js["peak_activation_bytes"], result.peak_activation_bytes),
            (js["peak_rank_activation_bytes"], result.peak_rank_activation_bytes),
            (js["memory_top"], result.peak_rank_activation_bytes),  # the chart's top
        ):
            assert page == pytest.approx(python, rel=1e-12, abs=1e-9), label


def test_the_closed_forms_are_the_python_ones(runs):
    """Bubble and peak memory by formula, every schedule's (the V ones included) played."""
    with_forms = set()
    for case, js in runs:
        costs = _costs(case["costs"], case["stages"], case["chunks"])
        if "error" in js:
            continue
        label = _label(case)
        v = traits(case["schedule"]).stages_per_rank(case["virtual_stages"])
        peak = closed_form_peak(case["schedule"], case["stages"], case["chunks"], v)
        assert js["closed_form_peak"] == (None if peak is None else list(peak)), label
        if len(set(costs.microbatch_scale)) > 1:  # uneven micro-batches: no formula holds
            assert js["closed_form"] is None, label
            continue
        if isinstance(costs.forward, tuple):
            continue
        python = closed_form_bubble(
            case["schedule"],
            case["stages"],
            case["chunks"],
            v,
            costs.forward,
            costs.backward,
            costs.weight,
        )
        assert (js["closed_form"] is None) == (python is None), label
        if python is not None:
            assert _close(js["closed_form"], python), label
            with_forms.add(case["schedule"])
    assert with_forms == set(SCHEDULES)


def test_messages_and_recomputations_drawn_agree_with_the_simulators_model(runs):
    """Every action's span starts when its rank gets to it; a send arrives after the link's
    delay, a receive ends when its message is there; an R runs before the backward of each
    micro-batch ``should_checkpoint`` picks, and of no other."""
    for case, js in runs:
        if "error" in js:
            continue
        label = _label(case)
        costs = _costs(case["costs"], case["stages"], case["chunks"])
        schedule, split = scenario(
            case["schedule"], case["stages"], case["chunks"], costs, case["virtual_stages"]
        )
        schedule = simulate(schedule, split, case["checkpoint"]).schedule  # R actions included
        wire = costs.latency + costs.message_bytes / costs.bandwidth
        rank_of = schedule.stage_to_rank
        arrival = {}
        for rank, spans in enumerate(js["spans"]):
            for action, (name, start, end) in zip(schedule.programs[rank], spans, strict=True):
                if action.kind.value.startswith("SEND"):
                    to = action.stage + (1 if action.kind.value == "SEND_F" else -1)
                    delay = 0.0 if rank_of[to] == rank_of[action.stage] else wire
                    assert _close(end - start, delay), (label, name)
                    arrival[(to, action.kind.value[-1], action.microbatch)] = end
        for rank, spans in enumerate(js["spans"]):
            clock = 0.0
            for action, (name, start, end) in zip(schedule.programs[rank], spans, strict=True):
                assert name == str(action), label
                assert _close(start, clock), (label, name, start, clock)
                kind = action.kind.value
                if kind.startswith("RECV"):
                    got = arrival[(action.stage, kind[-1], action.microbatch)]
                    assert _close(end, max(start, got)), (label, name)
                clock = start if kind.startswith("SEND") else end
        recomputes = {
            (a.stage, a.microbatch) for p in schedule.programs for a in p if a.kind.value == "R"
        }
        picked = {
            (s, i)
            for s in range(schedule.n_stages)
            for i in range(schedule.n_microbatches)
            if schedule.backward
            and should_checkpoint(case["checkpoint"], i, schedule.n_microbatches)
        }
        assert recomputes == picked, label


def test_schedules_given_as_data_with_skips_and_recomputation_simulate_alike():
    """What a measured run hands the page: skip actions (``0SEND_SKIP3@2``) and R actions
    included, simulated as gpipe.planning.simulate does."""
    from gpipe.schedules import add_recompute, add_skips
    from gpipe.view.page import schedule_json

    costs = Costs(
        forward=1.0, backward=2.0, weight=0.5, latency=0.3, message_bytes=2.0, activation_bytes=10.0
    )
    cases, schedules = [], []
    for name, k, m in [("gpipe", 3, 4), ("1f1b", 4, 5), ("zero-bubble", 3, 3)]:
        routes = tuple((s, d) for s in range(k) for d in range(s + 2, k))
        schedule = add_recompute(add_skips(SCHEDULES[name](k, m), routes), frozenset({0, 2}))
        schedules.append(schedule)
        cases.append(
            {
                "schedule_data": schedule_json(schedule),
                "costs": costs_json(costs),
                "checkpoint": "never",
            }
        )
    payload = {"scripts": [str(asset_path(name)) for name in SCRIPTS], "cases": cases}
    found = _page_simulates(payload)
    for schedule, js in zip(schedules, found, strict=True):
        assert "error" not in js, js
        result = simulate(schedule, costs)
        assert js["simulated"] == [[str(a) for a in p] for p in schedule.programs]
        for rank in range(schedule.n_ranks):
            python = [(str(a), s, e) for r, a, s, e in result.events if r == rank]
            page = [(n, s, e) for n, s, e in js["spans"][rank] if _kind(n) in COMPUTE]
            assert [n for n, _, _ in page] == [n for n, _, _ in python], schedule.name
            assert all(
                _close(a[1], b[1]) and _close(a[2], b[2]) for a, b in zip(page, python, strict=True)
            )
        assert _close(js["makespan"], result.makespan)
        assert js["peak_activation_bytes"] == pytest.approx(result.peak_activation_bytes)


def test_a_schedule_from_a_file_plays_as_the_python_simulator_says(tmp_path):
    """``gpipe view --schedule-csv``: the file's schedule with each rank's costs cut into its
    stages, as ``gpipe simulate --schedule-csv`` does."""
    cases, expected = [], []
    for name, k, m in (("zero-bubble-v", 2, 4), ("interleaved", 2, 4), ("dualpipe-v", 3, 6)):
        path = tmp_path / f"{name}.csv"
        to_csv(build(name, k, m, 2), path)
        schedule = from_csv(path)
        for kind, mode in (("uneven", "always"), ("links", "never"), ("unit", "except_last")):
            costs = _costs(kind, k)
            cases.append(
                {
                    "schedule_data": schedule_json(schedule),
                    "split": True,
                    "costs": costs_json(costs),
                    "checkpoint": mode,
                }
            )
            expected.append(
                (f"{name} {kind} {mode}", simulate(schedule, split_costs(schedule, costs), mode))
            )
    payload = {"scripts": [str(asset_path(name)) for name in SCRIPTS], "cases": cases}
    found = _page_simulates(payload)
    for (label, result), js in zip(expected, found, strict=True):
        assert "error" not in js, (label, js)
        assert _close(js["makespan"], result.makespan) and _close(js["bubble"], result.bubble), (
            label
        )
        assert js["simulated"] == [[str(a) for a in p] for p in result.schedule.programs], label
        assert js["peak_rank_activation_bytes"] == pytest.approx(
            result.peak_rank_activation_bytes, rel=1e-12, abs=1e-9
        ), label
