"""`gpipe plan --suggest`: its choice fits and is no slower than anything it lists or leaves
out, under the planner and the simulator; counted and timed costs; bad input in one line."""

import functools
import re

import pytest
import torch
from torch import nn

from gpipe.cli import main
from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss
from gpipe.planning.balancing import partition
from gpipe.planning.memory import plan, profile
from gpipe.planning.simulate import Costs, simulate
from gpipe.planning.suggest import (
    LayerCosts,
    candidates,
    chunk_choices,
    evaluate,
    flop_costs,
    search,
    timed_costs,
)
from gpipe.runtime.partitions import stage_bounds
from gpipe.schedules import SCHEDULES, get_schedule, traits

# Four blocks (six layers with the embedding and the head) and 8 rows: every schedule and
# mode still has candidates, on 1 to 6 processes and 1 to 8 micro-batches (and interleaved
# v=3 on 2), in a grid of 333 that every search walks, 56% of six blocks and 16 rows' 591.
MODEL = ["--n-layer", "4", "--d-model", "64", "--n-head", "2", "--vocab-size", "500",
         "--seq-len", "64", "--batch-size", "8"]  # fmt: skip
GPT = GPTConfig(n_layer=4, d_model=64, n_head=2, vocab_size=500, seq_len=64)
BATCH = 8


@pytest.fixture(scope="module")
def gpt():
    """The model of MODEL, profiled and costed on the meta device."""
    layers = build_gpt(GPT, device="meta")
    tokens = torch.zeros(2, GPT.seq_len, dtype=torch.int64, device="meta")
    prof = profile(layers, tokens, target=tokens, loss_fn=lm_loss)
    return prof, flop_costs(layers, tokens, target=tokens, loss_fn=lm_loss)


def _table(out: str) -> list[dict[str, str]]:
    lines = out.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("stages"))
    names = re.split(r"\s{2,}", lines[start].strip())
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[start + 1 :]]
    return [dict(zip(names, row, strict=True)) for row in rows if not row[0].startswith("fast")]


def _simulated(prof, costs, row) -> tuple[float, float]:
    """A listed row's step time and peak memory, from the simulator and the planner alone."""
    k, m = int(row["stages"]), int(row["chunks"])
    name, *virtual = row["schedule"].split(" v=")
    v = int(virtual[0]) if virtual else 1
    rows = BATCH / m
    per_layer = [costs.forward(i, rows) for i in range(len(costs))]
    cut = partition(per_layer, k * v)
    forward = [sum(per_layer[a:b]) for a, b in stage_bounds(cut)]
    make = get_schedule(name)
    schedule = make(k * v, m) if v == 1 else make(k * v, m, k)
    step = simulate(schedule, Costs(forward, forward, forward), row["checkpoint"]).makespan
    memory = plan(
        prof,
        cut,
        batch_size=BATCH,
        chunks=m,
        schedule=name,
        checkpoint=row["checkpoint"],
        n_ranks=k,
    )
    return step, memory.peak_bytes


def _size(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_the_choice_fits_and_is_no_slower_than_what_it_lists(capsys, gpt):
    assert main(["plan", *MODEL, "--suggest", "--device-memory", "64MiB", "--top", "8"]) == 0
    out = capsys.readouterr().out
    rows = _table(out)
    assert 2 <= len(rows) <= 8
    prof, costs = gpt
    times = []
    for row in rows:
        step, peak = _simulated(prof, costs, row)
        assert peak <= 64 * 2**20, row
        assert _size(row["peak memory"]) == pytest.approx(peak, rel=0.01)
        assert row["fits"].startswith("yes")
        times.append(step)
    assert times[0] == min(times)
    assert times == sorted(times)
    for row, step in zip(rows, times, strict=True):
        assert float(row["relative time"]) == pytest.approx(step / times[0], abs=0.006)
    best = rows[0]
    assert f"fastest: --stages {best['stages']} --chunks {best['chunks']}" in out


def test_nothing_faster_fits_among_all_it_searched(gpt):
    prof, costs = gpt
    everything = [
        evaluate(
            prof,
            costs,
            stages=k,
            chunks=m,
            schedule=s,
            checkpoint=c,
            virtual_stages=v,
            batch_size=BATCH,
        )
        for k, m, s, c, v in candidates(len(prof), BATCH)
    ]
    device = sorted(c.peak_bytes for c in everything)[len(everything) // 3]  # a third fit
    found = search(prof, costs, batch_size=BATCH, device_bytes=device)
    fitting = [c for c in everything if c.peak_bytes <= device]
    assert found.fits == len(fitting) and found.searched == len(everything)
    assert 0 < len(fitting) < len(everything)
    assert found.fitting[0].step_time == min(c.step_time for c in fitting)
    assert found.least.peak_bytes == min(c.peak_bytes for c in everything)
    # each one left out is matched in time, processes and memory by one listed
    for c in fitting:
        assert any(
            k.step_time <= c.step_time and k.stages <= c.stages and k.peak_bytes <= c.peak_bytes
            for k in found.fitting
        )
    # and none listed is matched so by another listed
    for a in found.fitting:
        others = [b for b in found.fitting if b is not a]
        assert not any(
            b.step_time <= a.step_time and b.stages <= a.stages and b.peak_bytes <= a.peak_bytes
            for b in others
        )


def test_the_grid_and_its_bounds():
    assert chunk_choices(32) == [1, 2, 4, 8, 16, 32]
    assert chunk_choices(12) == [1, 2, 4, 8, 12]
    grid = candidates(6, 16, max_stages=4)
    assert {g[0] for g in grid} == {1, 2, 3, 4}
    assert {g[1] for g in grid} == {1, 2, 4, 8, 16}
    assert {g[3] for g in grid} == {"always", "except_last", "never"}
    interleaved = [g for g in grid if g[2] == "interleaved"]
    assert interleaved and all(
        k >= 2 and m % k == 0 and v == 2 and k * v <= 6 for k, m, _, _, v in interleaved
    )
    assert all(v == 1 for _, _, s, _, v in grid if not traits(s).several_stages_per_rank)
    assert {s for _, _, s, _, v in grid if v == 2} == {
        s for s in SCHEDULES if traits(s).several_stages_per_rank
    }
    assert all(m >= 2 * k for k, m, s, _, _ in grid if s == "dualpipe-v")
    pinned = candidates(6, 16, stages=[2], chunks=[8], schedules=["1f1b"], checkpoints=["never"])
    assert pinned == [(2, 8, "1f1b", "never", 1)]
    assert candidates(3, 16, max_stages=8) and max(g[0] for g in candidates(3, 16)) == 3


def test_pinned_options_are_kept(capsys):
    args = ["plan", *MODEL, "--suggest", "--device-memory", "1GiB", "--stages", "2",
            "--schedule", "interleaved", "--virtual-stages", "3"]  # fmt: skip
    assert main(args) == 0
    rows = _table(capsys.readouterr().out)
    assert rows and all(r["stages"] == "2" and r["schedule"] == "interleaved v=3" for r in rows)


def test_flops_are_counted_per_row_on_the_meta_device():
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    costs = flop_costs(layers, torch.zeros(8, 16, device="meta"))
    assert costs.per_row == (2 * 16 * 32, 0, 2 * 32 * 4)
    assert costs.fixed == (0, 0, 0) and costs.unit == "FLOP"
    assert costs.forward(0, 3) == 3 * 2 * 16 * 32
    deeper = costs.repeat(1, 3)
    assert deeper.per_row == (2 * 16 * 32, 0, 0, 0, 2 * 32 * 4)


def test_timed_costs_fit_a_fixed_cost_and_a_cost_per_row(monkeypatch):
    """Layer times of 3 + 2 r and 6 r seconds (forward and backward, r rows) are a forward
    of 1 + 2r/3 and 2r."""
    calls = []

    def times(module, sample, *, timeout, device):
        calls.append(sample.size(0))
        return [3.0 + 2.0 * sample.size(0), 6.0 * sample.size(0)]

    monkeypatch.setattr("gpipe.planning.suggest.layer_times", times)
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    costs = timed_costs(layers, torch.randn(8, 4), device="cpu")
    assert calls == [4, 4, 8]  # a warm-up, then half the rows and all of them
    assert costs.fixed == pytest.approx((1.0, 0.0))
    assert costs.per_row == pytest.approx((2 / 3, 2.0))
    assert costs.unit == "s" and costs.source == "timed on cpu"


def test_timed_costs_of_a_real_model_are_seconds():
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    costs = timed_costs(layers, torch.randn(8, 16), timeout=0.2, device="cpu")
    assert len(costs) == 3
    assert all(0 <= c < 1 for c in costs.fixed + costs.per_row)
    assert costs.forward(0, 8) > 0


def test_measure_times_the_layers_and_prints_seconds(capsys, monkeypatch):
    """The command's own timing, on a tenth of its default second: what is checked is that
    it times and prints seconds, not how long it takes to (CPU the suite has little of)."""
    monkeypatch.setattr("gpipe.cli.plan.timed_costs", functools.partial(timed_costs, timeout=0.1))
    args = ["plan", *MODEL, "--suggest", "--device-memory", "1GiB", "--measure",
            "--stages", "2", "--checkpoint", "never"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "time: timed on cpu" in out
    rows = _table(out)
    assert rows and all(re.fullmatch(r"[\d.e-]+ s", r["step time"]) for r in rows)


def test_layer_costs_must_match_the_profile(gpt):
    prof, _ = gpt
    with pytest.raises(ValueError, match="costs have 2 layers, the profile 6"):
        search(prof, LayerCosts((0, 0), (1, 1), "FLOP", "x"), batch_size=8, device_bytes=1e9)


def test_nothing_fits_in_one_line_and_exit_code_1(capsys):
    assert main(["plan", *MODEL, "--suggest", "--device-memory", "1MiB"]) == 1
    out = capsys.readouterr().out.strip()
    assert "\n" not in out
    assert re.fullmatch(
        r"nothing fits in 1\.00 MiB per process: of \d+ configurations searched, the least "
        r"memory is [\d.]+ MiB \(--stages \d .*--checkpoint \w+\)",
        out,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--suggest"], "--suggest needs --device-memory"),
        (["--suggest", "--device-memory", "1GiB", "--max-layers"], "leave out --max-layers"),
        (["--suggest", "--device-memory", "1GiB", "--balance", "4,4"], "--balance time, even"),
        (["--suggest", "--device-memory", "1GiB", "--chunks", "32"], "more than --batch-size"),
        (["--suggest", "--device-memory", "1GiB", "--virtual-stages", "1"], "at least 2"),
        (["--suggest", "--device-memory", "1GiB", "--max-stages", "0"], "--max-stages must be"),
        (["--suggest", "--device-memory", "1GiB", "--stages", "9"], "no configuration to"),
        (["--measure"], "--measure needs --suggest"),
        (["--top", "3"], "--top needs --suggest"),
        (["--balance", "time"], "--balance time needs a run to time, or --suggest"),
    ],
)
def test_bad_input_ends_in_one_line_and_exit_code_2(capsys, args, message):
    assert main(["plan", *MODEL, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_evaluate_takes_a_cut_of_ones_own(gpt):
    prof, costs = gpt
    mine = evaluate(
        prof,
        costs,
        stages=2,
        chunks=4,
        schedule="1f1b",
        checkpoint="always",
        batch_size=BATCH,
        balance=[2, 4],
    )
    assert mine.balance == (2, 4)
    expected = plan(
        prof, [2, 4], batch_size=BATCH, chunks=4, schedule="1f1b", checkpoint="always", n_ranks=2
    )
    assert mine.peak_bytes == expected.peak_bytes
    with pytest.raises(ValueError, match="balance must be 'time', 'params' or 'even'"):
        evaluate(
            prof,
            costs,
            stages=2,
            chunks=4,
            schedule="1f1b",
            checkpoint="never",
            batch_size=BATCH,
            balance="fast",
        )
