"""The page as a file: self-contained, carrying its settings and a measured step, written by
``gpipe view``, ``gpipe simulate --html`` and ``gpipe train --trace``; bad input is one line
and exit code 2."""

import json
import re

import pytest
from torch.nn.functional import mse_loss

from gpipe import GPipe
from gpipe.cli import main
from gpipe.planning.simulate import Costs, measured_costs
from gpipe.runtime.timeline import Event
from gpipe.schedules import build, gpipe, interleaved, to_csv
from gpipe.view import LIMITS, Measured, Settings, page_data, render, write
from gpipe.view.page import asset

from ..small_models import batch, mlp


def data_of(page: str) -> dict:
    """The JSON the page reads at start."""
    match = re.search(r'<script type="application/json" id="gpipe-data">(.*?)</script>', page, re.S)
    assert match is not None
    return json.loads(match.group(1))


def traced_step(chunks: int = 4) -> list[Event]:
    pipe = GPipe(mlp(), [4, 4], devices=["cpu"] * 2, chunks=chunks, trace=True)
    x, y = batch(8)
    mse_loss(pipe(x), y).backward()
    return pipe.timeline()


def test_the_page_is_one_file_that_needs_no_network():
    page = render()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", page)
    assert "<script src" not in page and "<link" not in page
    for name in ("schedule.js", "simulate.js", "controls.js", "lanes.js", "app.js", "view.css"):
        assert asset(name) in page  # inline, exactly the files the parity test runs
    assert "@" + "DATA@" not in page and "@" + "CSS@" not in page


def test_the_page_starts_where_its_settings_say():
    costs = Costs(forward=[1, 2, 3], backward=2, weight=0.5, latency=0.1, bandwidth=1e9)
    data = data_of(render(Settings(3, 6, "zero-bubble", 2, "always", costs)))
    assert data["limits"] == LIMITS
    assert data["settings"] == {
        "stages": 3,
        "chunks": 6,
        "schedule": "zero-bubble",
        "virtual_stages": 2,
        "checkpoint": "always",
        "costs": costs.to_dict(),
    }
    assert data["measured"] is None
    assert data_of(render())["settings"]["costs"]["bandwidth"] is None  # unlimited; JSON has no inf


def test_neither_data_nor_title_can_end_their_elements():
    events = [Event(0, 0, "F", 0, 0.0, 1.0), Event(0, 0, "</script><b>", 0, 1.0, 2.0)]
    page = render(measured=Measured(gpipe(1, 1), events), title="</title><b>")
    assert "</script><b>" not in page and "</title><b>" not in page
    assert "&lt;/title&gt;&lt;b&gt;" in page
    assert data_of(page)["measured"]["events"][1] == [0, 0, "</script><b>", 0, 1.0, 2.0]


def test_a_measured_step_carries_its_schedule_events_and_mean_costs():
    events = traced_step()
    schedule = gpipe(2, 4)
    data = page_data(measured=Measured(schedule, events, "except_last"))
    measured = data["measured"]
    assert measured["schedule"]["programs"] == [[str(a) for a in p] for p in schedule.programs]
    assert measured["schedule"]["stage_to_rank"] == [0, 1]
    assert len(measured["events"]) == len(events)
    mean = measured_costs(schedule, events).to_dict()
    assert measured["costs"] == {**mean, "bandwidth": None}
    assert measured["checkpoint"] == "except_last"
    # Leaving the measured run, the controls start at its shape.
    assert (data["settings"]["stages"], data["settings"]["chunks"]) == (2, 4)
    assert data["settings"]["checkpoint"] == "except_last"


def test_an_interleaved_measured_step_starts_the_controls_at_its_v():
    schedule = interleaved(4, 2, 2)
    events = [Event(0, 0, "F", 0, 0.0, 1.0)]
    settings = page_data(measured=Measured(schedule, events))["settings"]
    assert (settings["stages"], settings["virtual_stages"], settings["schedule"]) == (
        2,
        2,
        "interleaved",
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stages": 0}, "stages must be a whole number from 1 to 32, got 0"),
        ({"chunks": 1000}, "chunks must be a whole number from 1 to 128, got 1000"),
        ({"schedule": "nope"}, "schedule: schedule must be one of"),
        ({"schedule": "interleaved", "chunks": 6}, "needs chunks a multiple of stages"),
        ({"checkpoint": "sometimes"}, "checkpoint: checkpoint is not one of"),
        ({"virtual_stages": 0}, "virtual_stages must be a whole number from 1 to 8"),
        ({"costs": Costs(forward=[1, 2], backward=1)}, "Costs.forward has 2 values"),
        (
            {"chunks": 4, "costs": Costs(forward=1, backward=1, microbatch_scale=[1, 2])},
            "Costs.microbatch_scale has 2 factors, but the schedule has 4 micro-batches",
        ),
        (
            {"stages": 32, "chunks": 128, "schedule": "interleaved", "virtual_stages": 3},
            "more than the page draws",
        ),
    ],
)
def test_settings_the_page_cannot_play_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Settings(**kwargs)


def test_gpipe_view_writes_the_page_and_prints_its_path(tmp_path, capsys):
    out = tmp_path / "page.html"
    costs = tmp_path / "costs.json"
    costs.write_text('{"forward": [1, 2], "backward": 2, "activation_bytes": 1e6}')
    args = ["view", "--stages", "2", "--chunks", "4", "--schedule", "interleaved",
            "--virtual-stages", "3", "--checkpoint", "always", "--costs", str(costs),
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == str(out.resolve())
    settings = data_of(out.read_text())["settings"]
    assert (settings["schedule"], settings["virtual_stages"], settings["checkpoint"]) == (
        "interleaved",
        3,
        "always",
    )
    assert settings["costs"]["forward"] == [1, 2]


def test_gpipe_view_and_simulate_html_take_each_micro_batchs_tokens(tmp_path, capsys):
    """``--microbatch-tokens`` sets M and each micro-batch's cost factor, its tokens over
    the mean, as ``gpipe simulate`` counts them; the page starts with them."""
    out = tmp_path / "page.html"
    assert main(["view", "--stages", "2", "--microbatch-tokens", "100,300,200,200",
                 "--out", str(out)]) == 0  # fmt: skip
    settings = data_of(out.read_text())["settings"]
    assert settings["chunks"] == 4
    assert settings["costs"]["microbatch_scale"] == [0.5, 1.5, 1.0, 1.0]
    args = ["simulate", "--stages", "2", "--microbatch-tokens", "100,300,200,200",
            "--schedule", "1f1b", "--html", str(tmp_path / "sim.html")]  # fmt: skip
    assert main(args) == 0
    costs = data_of((tmp_path / "sim.html").read_text())["settings"]["costs"]
    assert costs["microbatch_scale"] == [0.5, 1.5, 1.0, 1.0]
    capsys.readouterr()
    assert main(["view", "--chunks", "3", "--microbatch-tokens", "1,2", "--out", str(out)]) == 2
    assert "--chunks 3 but --microbatch-tokens lists 2" in capsys.readouterr().err


def test_gpipe_view_plays_a_schedule_file_with_the_files_shape(tmp_path, capsys):
    path = tmp_path / "zbv.csv"
    to_csv(build("zero-bubble-v", 3, 6), path)
    out = tmp_path / "page.html"
    args = ["view", "--schedule-csv", str(path), "--checkpoint", "always", "--out", str(out)]
    assert main(args) == 0
    data = data_of(out.read_text())
    fixed = data["fixed"]
    assert (fixed["name"], fixed["n_microbatches"], len(fixed["programs"])) == ("csv:zbv.csv", 6, 3)
    assert fixed["stage_to_rank"] == [0, 1, 2, 2, 1, 0]
    assert (data["settings"]["stages"], data["settings"]["chunks"]) == (3, 6)
    assert data["settings"]["checkpoint"] == "always"
    capsys.readouterr()
    # the file fixes the shape: flags that would set it are refused, not ignored
    fixing = ["--stages", "8", "--schedule", "1f1b", "--virtual-stages", "3"]
    assert main([*args, *fixing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith(
        f"--schedule-csv {path} fixes the ranks, stages and schedule: drop --stages, "
        "--schedule, --virtual-stages\n"
    ), err
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], *lines[2:]]) + "\n")  # rank 1's actions lost
    assert main(["view", "--schedule-csv", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpipe: error: --schedule-csv: ") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stages", "0"], "--stages must be a whole number from 1 to 32, got 0"),
        (["--chunks", "-1"], "--chunks must be a whole number from 1 to 128, got -1"),
        (["--schedule", "nope"], "argument --schedule: invalid choice: 'nope'"),
        (["--checkpoint", "nope"], "argument --checkpoint: invalid choice: 'nope'"),
        (["--schedule", "interleaved", "--chunks", "6"],
         "--schedule interleaved needs --chunks a multiple of --stages, got 6 and 4"),
        (["--virtual-stages", "9"], "--virtual-stages must be a whole number from 1 to 8"),
        (["--schedule", "v-min", "--virtual-stages", "3"],
         "--schedule v-min places two stages per process in a V: --virtual-stages is 2, got 3"),
        (["--out", "/no/such/folder/page.html"], "--out /no/such/folder/page.html: "),
        (["--costs", "/no/such/costs.json"], "--costs /no/such/costs.json: "),
    ],
)  # fmt: skip
def test_gpipe_view_reports_bad_input_in_one_line_naming_the_option(capsys, args, message):
    assert main(["view", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpipe: error: ") and err.count("\n") == 1, err
    assert message in err


def test_gpipe_simulate_html_writes_the_page_of_its_case(tmp_path, capsys):
    out = tmp_path / "sim.html"
    args = ["simulate", "--stages", "3", "--chunks", "6", "--schedule", "1f1b,gpipe",
            "--html", str(out)]  # fmt: skip
    assert main(args) == 0
    assert f"page: {out}" in capsys.readouterr().out
    settings = data_of(out.read_text())["settings"]
    assert (settings["stages"], settings["chunks"], settings["schedule"]) == (3, 6, "1f1b")
    assert settings["costs"]["forward"] == 1.0 and settings["costs"]["activation_bytes"] == 0.0
    bad = ["simulate", "--stages", "3", "--chunks", "5", "--schedule", "interleaved",
           "--html", str(tmp_path / "no.html")]  # fmt: skip
    assert main(bad) == 2
    assert "--html: --schedule interleaved needs --chunks" in capsys.readouterr().err
    assert not (tmp_path / "no.html").exists()


def test_write_returns_the_path_written(tmp_path):
    path = write(tmp_path / "v.html", Settings(schedule="1f1b"))
    assert data_of(path.read_text())["settings"]["schedule"] == "1f1b"


def test_a_folder_for_the_page_is_refused_in_one_line(tmp_path, capsys):
    """``--out pages/`` wrote a file named ``pages`` (pathlib drops the separator), and
    ``gpipe simulate --html`` ended in a traceback after its table where the page could not
    be written; both name the option and what it expects."""
    folder = tmp_path / "pages"
    cases = [
        (["view", "--out", f"{folder}/"], f"--out {folder}/: is a folder; expected the page's "
         f"file, such as {folder / 'gpipe-view.html'}"),
        (["view", "--out", str(tmp_path)], f"--out {tmp_path}: is a folder"),
        (["simulate", "--schedule", "gpipe", "--html", f"{folder}/"], f"--html {folder}/: is a "
         "folder"),
        (["simulate", "--schedule", "gpipe", "--html", str(folder / "no" / "sim.html")],
         f"--html {folder / 'no' / 'sim.html'}: No such file or directory"),
    ]  # fmt: skip
    for args, message in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("gpipe: error: ") and err.count("\n") == 1, err
        assert message in err, err
    assert not folder.exists()
    with pytest.raises(IsADirectoryError, match="is a folder"):
        write(f"{folder}/")
