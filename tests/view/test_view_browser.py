"""The page in a real browser: headless Chromium opens it from disk, the tests set its controls as
a user would and read its read-outs, which must be gpipe.planning.simulate's; it draws one
block per action, loads a measured step, answers the keyboard and fits a phone. Screenshots are
saved (into $GPIPE_VIEW_SCREENSHOTS if set, as for docs/view.png)."""

import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from gpipe.planning.bubbles import split_costs
from gpipe.planning.simulate import (
    Costs,
    closed_form_bubble,
    closed_form_peak,
    predict,
    scenario,
    simulate,
)
from gpipe.runtime.recompute import should_checkpoint
from gpipe.schedules import Kind, Placement, build, from_csv, gpipe, to_csv, traits
from gpipe.view import DEFAULT_COSTS, Measured, Settings, write

from .test_view import traced_step

try:
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select
except ImportError:  # pragma: no cover - depends on the machine
    webdriver = None

CHROMIUM = next(
    filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None
)
DRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.skipif(webdriver is None, reason="selenium is not installed (pip install .[test])"),
    pytest.mark.skipif(
        CHROMIUM is None or DRIVER is None,
        reason="no headless browser here: needs Chromium and chromedriver on PATH "
        "(apt-get install chromium chromium-driver)",
    ),
]
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage")  # fmt: skip


@pytest.fixture(scope="module")
def browser():
    profile = tempfile.mkdtemp(prefix="gpipe-view-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    try:
        driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    except WebDriverException as exc:
        shutil.rmtree(profile, ignore_errors=True)
        pytest.fail(f"Chromium ({CHROMIUM}) and chromedriver ({DRIVER}) are there but fail: {exc}")
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _viewport(browser, width: int, height: int) -> None:
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600},
    )


def _open(
    browser, path: Path, width: int = 1280, height: int = 720, *, motion: bool = False
) -> None:
    """Open ``path``. Unless ``motion``, as for a user who asks for reduced motion: a change
    then shows the whole step at once instead of playing it for ten seconds, frame by frame,
    behind a test that only reads the page (most of this module's CPU time when it played)."""
    _viewport(browser, width, height)
    reduce = "no-preference" if motion else "reduce"
    browser.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-reduced-motion", "value": reduce}]},
    )
    browser.get(path.resolve().as_uri())
    assert browser.execute_script("return document.body.dataset.state") == "ready", _error(browser)


def _error(browser) -> str:
    return browser.find_element(By.ID, "error").text


def _set(browser, control: str, value: str) -> None:
    """Choose or type ``value`` into a control, as a user would."""
    element = browser.find_element(By.ID, control)
    if element.tag_name == "select":
        Select(element).select_by_value(value)
    else:
        element.click()
        element.send_keys(Keys.CONTROL, "a")
        element.send_keys(value)


def _fill(browser, values: dict[str, str]) -> None:
    """Put ``values`` into text boxes at once, with one ``input`` event as a paste would
    send: the page replays at each keystroke (what typing in ``_set`` checks), a second or
    more a field on this machine, which the grid of cases below has no need to repeat."""
    browser.execute_script(
        """const values = arguments[0];
        let last = null;
        for (const [id, value] of Object.entries(values)) {
          last = document.getElementById(id);
          last.value = value;
        }
        last.dispatchEvent(new Event("input", {bubbles: true}));""",
        values,
    )


def _value(browser, element_id: str) -> float | None:
    text = browser.find_element(By.ID, element_id).get_attribute("data-value")
    return None if text == "" else float(text)


def _key(browser, key: str) -> None:
    browser.find_element(By.TAG_NAME, "body").click()
    ActionChains(browser).send_keys(key).perform()


def _drawn(browser, panel: str, kind: str | None = None) -> int:
    selector = f"#{panel} .block:not(.pending)" + (f'[data-kind="{kind}"]' if kind else "")
    return len(browser.find_elements(By.CSS_SELECTOR, selector))


def _screenshot(browser, tmp_path: Path, name: str) -> Path:
    folder = Path(os.environ.get("GPIPE_VIEW_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    assert browser.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return path


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("view") / "view.html")


CASES = [  # K, M, schedule, checkpoint, v, costs typed into the page (F, B, W, latency)
    (4, 8, "gpipe", "never", 2, None),
    (3, 6, "1f1b", "always", 2, ("1", "2", "0.5", "0.1")),
    (4, 8, "zero-bubble", "except_last", 2, None),
    (4, 5, "zero-bubble", "always", 2, ("1", "1.5", "0.5", "0")),
    (2, 4, "interleaved", "always", 2, None),
    (3, 6, "interleaved", "never", 3, ("1, 2, 1.5", "2", "1", "0")),
    (2, 4, "interleaved-zero-bubble", "never", 2, ("1", "1", "0.5", "0")),
    (2, 3, "looped-bfs", "except_last", 2, None),
    (3, 5, "zero-bubble-v", "never", 2, ("1", "1.5", "1", "0")),
    (2, 4, "dualpipe-v", "always", 2, None),
]


@pytest.mark.parametrize(("k", "m", "name", "mode", "v", "typed"), CASES)
def test_the_pages_read_outs_are_the_simulators(browser, page, k, m, name, mode, v, typed):
    _open(browser, page)
    _set(browser, "schedule", name)
    looped = traits(name).placement is Placement.LOOPED
    for control, value in (("stages", k), ("chunks", m), ("virtual_stages", v)):
        if looped or control != "virtual_stages":
            _set(browser, control, str(value))
    _set(browser, "checkpoint", mode)
    costs = DEFAULT_COSTS
    if typed is not None:
        _fill(browser, dict(zip(("forward", "backward", "weight", "latency"), typed, strict=True)))
        values = [[float(x) for x in text.split(",")] for text in typed]
        f, b, w, latency = (x[0] if len(x) == 1 else x for x in values)
        costs = Costs(
            forward=f,
            backward=b,
            weight=w,
            latency=latency,
            message_bytes=DEFAULT_COSTS.message_bytes,
            activation_bytes=DEFAULT_COSTS.activation_bytes,
        )
    assert _error(browser) == ""
    schedule, split = scenario(name, k, m, costs, v)
    result = simulate(schedule, split, mode)

    assert _value(browser, "bubble") == pytest.approx(result.bubble, rel=1e-12, abs=1e-12)
    assert _value(browser, "makespan") == pytest.approx(result.makespan, rel=1e-12)
    per_rank = None if isinstance(costs.forward, tuple) else (costs.forward, costs.backward)
    per_rank_stages = schedule.n_stages // k
    closed = (
        closed_form_bubble(name, k, m, per_rank_stages, *per_rank, costs.weight)
        if per_rank
        else None
    )
    assert _value(browser, "closed-form") == (None if closed is None else pytest.approx(closed))
    peak = max(closed_form_peak(name, k, m, per_rank_stages))
    assert _value(browser, "closed-form-peak") == pytest.approx(peak)
    rows = browser.find_elements(By.CSS_SELECTOR, "#per-stage tbody tr")
    assert len(rows) == schedule.n_stages
    for s, row in enumerate(rows):
        live = row.find_element(By.CSS_SELECTOR, ".live").get_attribute("data-value")
        held = row.find_element(By.CSS_SELECTOR, ".bytes").get_attribute("data-value")
        assert int(live) == result.peak_live[s]
        assert float(held) == pytest.approx(result.peak_activation_bytes[s], rel=1e-12)
    charts = browser.find_elements(By.CSS_SELECTOR, "#memory .mem-rank")
    assert [float(c.get_attribute("data-peak")) for c in charts] == pytest.approx(
        result.peak_rank_activation_bytes, rel=1e-12
    )

    # Played to the end: one block per action, a recomputation (R) ahead of each recomputed B.
    _key(browser, Keys.END)
    assert _value(browser, "clock") == pytest.approx(result.makespan)
    actions = [a for program in result.schedule.programs for a in program]
    recomputed = sum(
        a.kind is Kind.BACKWARD and should_checkpoint(mode, a.microbatch, m) for a in actions
    )
    assert _drawn(browser, "predicted") == len(actions)
    assert _drawn(browser, "predicted", "R") == recomputed
    for kind in ("F", "B", "W", "SEND_F", "RECV_B"):
        assert _drawn(browser, "predicted", kind) == sum(a.kind.value == kind for a in actions)
    assert _value(browser, "actions") == len(actions)


def test_a_schedule_file_plays_with_the_controls_costs(browser, tmp_path):
    """``gpipe view --schedule-csv``: the file's schedule is chosen, K and M locked to its
    shape, and a cost typed in replays it as ``gpipe simulate --schedule-csv`` would."""
    path = tmp_path / "dualpipe.csv"
    to_csv(build("dualpipe-v", 2, 4), path)
    schedule = from_csv(path)
    page = write(tmp_path / "file.html", Settings(2, 4, checkpoint="always"), fixed=schedule)
    _open(browser, page)
    assert browser.find_element(By.ID, "schedule").get_attribute("value") == "file"
    assert not browser.find_element(By.ID, "chunks").is_enabled()
    _set(browser, "forward", "1, 2")
    assert _error(browser) == ""
    costs = dataclasses.replace(DEFAULT_COSTS, forward=(1.0, 2.0))
    result = simulate(schedule, split_costs(schedule, costs), "always")
    assert _value(browser, "makespan") == pytest.approx(result.makespan, rel=1e-12)
    assert _value(browser, "bubble") == pytest.approx(result.bubble, rel=1e-12, abs=1e-12)
    _set(browser, "schedule", "1f1b")  # the page's own schedules stay a choice away
    assert browser.find_element(By.ID, "chunks").is_enabled() and _error(browser) == ""


def test_micro_batches_of_their_own_costs_play_as_the_simulator_says(browser, page):
    """Cost factors typed per micro-batch (packed micro-batches of different tokens) scale
    each one's F, B and W as ``Costs.microbatch_scale`` does; no closed form holds then,
    and a list that is not M long is named."""
    _open(browser, page)
    for control, value in (("schedule", "1f1b"), ("stages", "2"), ("chunks", "4")):
        _set(browser, control, value)
    _set(browser, "microbatch_scale", "0.5, 1.5, 1, 1")
    assert _error(browser) == ""
    costs = dataclasses.replace(DEFAULT_COSTS, microbatch_scale=(0.5, 1.5, 1.0, 1.0))
    result = simulate(*scenario("1f1b", 2, 4, costs))
    assert _value(browser, "makespan") == pytest.approx(result.makespan, rel=1e-12)
    assert _value(browser, "bubble") == pytest.approx(result.bubble, rel=1e-12, abs=1e-12)
    assert _value(browser, "closed-form") is None
    _set(browser, "chunks", "5")
    assert "cost factor per micro-batch takes M = 5 numbers" in _error(browser)


def test_blocks_appear_at_their_simulated_start(browser, page):
    _open(browser, page)
    _key(browser, Keys.HOME)
    assert _value(browser, "clock") == 0
    assert _drawn(browser, "predicted", "B") == 0
    result = simulate(gpipe(4, 8), DEFAULT_COSTS)
    starts = sorted({s for _, a, s, _ in result.events} | {e for _, a, _, e in result.events})
    _key(browser, Keys.ARROW_RIGHT)
    _key(browser, Keys.ARROW_RIGHT)
    t = _value(browser, "clock")
    assert t == starts[2]  # the second boundary after 0
    started = sum(s <= t for _, _, s, _ in result.events)
    assert _drawn(browser, "predicted", "F") + _drawn(browser, "predicted", "B") == started
    _key(browser, Keys.ARROW_LEFT)
    assert _value(browser, "clock") == starts[1]


def test_keyboard_plays_pauses_and_changes_speed(browser, page):
    _open(browser, page, motion=True)
    _key(browser, Keys.HOME)
    _key(browser, "+")
    assert browser.find_element(By.ID, "speed").get_attribute("value") == "2"
    _key(browser, Keys.SPACE)
    assert browser.execute_script("return document.body.dataset.playing") == "true"
    time.sleep(0.5)
    _key(browser, Keys.SPACE)
    assert browser.execute_script("return document.body.dataset.playing") == "false"
    t = _value(browser, "clock")
    assert 0 < t < 33
    time.sleep(0.2)
    assert _value(browser, "clock") == t  # paused


def test_a_change_replays_at_once_and_bad_input_is_named(browser, page):
    _open(browser, page, motion=True)
    _set(browser, "schedule", "1f1b")
    assert browser.execute_script("return document.body.dataset.playing") == "true"
    _set(browser, "schedule", "interleaved")
    _set(browser, "chunks", "6")
    assert _error(browser) == "interleaved needs M a multiple of K: M = 6, K = 4"
    _set(browser, "chunks", "8")
    assert _error(browser) == ""
    _set(browser, "forward", "1, 2")
    assert "F takes one number or 4 (one per rank), got 2" in _error(browser)


def test_hovering_a_block_tells_its_action_micro_batch_start_and_end(browser, page):
    _open(browser, page)
    _key(browser, Keys.END)
    block = browser.find_element(By.CSS_SELECTOR, '#predicted .block[data-kind="B"]')
    ActionChains(browser).move_to_element(block).perform()
    tip = browser.find_element(By.ID, "tip")
    assert tip.is_displayed()
    assert "backward, micro-batch" in tip.text and "start" in tip.text and "end" in tip.text


def test_a_measured_step_loads_above_its_prediction(browser, tmp_path):
    events = traced_step()
    schedule = gpipe(2, 4)
    path = write(tmp_path / "measured.html", measured=Measured(schedule, events, "except_last"))
    _open(browser, path)
    assert browser.find_element(By.ID, "show-measured").is_selected()
    _key(browser, Keys.END)
    assert _drawn(browser, "measured") == len(events)
    assert _value(browser, "measured-actions") == len(events)
    predicted = predict(schedule, events)
    assert _drawn(browser, "predicted") == sum(map(len, schedule.programs))
    assert _value(browser, "makespan") == pytest.approx(max(e.end for e in predicted), rel=1e-12)
    ends = sorted(
        float(b.get_attribute("data-end"))
        for b in browser.find_elements(By.CSS_SELECTOR, "#predicted .block")
        if b.get_attribute("data-kind") in ("F", "B")
    )
    assert ends == pytest.approx(sorted(e.end for e in predicted), rel=1e-12)
    assert _value(browser, "measured-span") == pytest.approx(max(e.end for e in events))
    _screenshot(browser, tmp_path, "view-measured.png")
    browser.find_element(By.ID, "show-measured").click()  # leave it: the controls come back
    assert not browser.find_elements(By.ID, "measured")
    assert browser.find_element(By.ID, "stages").is_enabled()
    assert browser.find_element(By.ID, "stages").get_attribute("value") == "2"


def test_screenshots_at_desktop_and_phone_width(browser, tmp_path):
    path = write(tmp_path / "v.html", Settings(4, 8, "zero-bubble", 2, "except_last"))
    _open(browser, path, 1280, 720)
    _key(browser, Keys.END)
    shot = _screenshot(browser, tmp_path, "view.png")
    assert shot.stat().st_size > 10_000
    _open(browser, path, 390, 844)
    _key(browser, Keys.END)
    width = browser.execute_script("return [document.documentElement.scrollWidth, innerWidth]")
    assert width[0] <= width[1], "the page scrolls sideways at phone width"
    for element_id in ("play", "bubble", "lanes", "per-stage", "stages"):
        box = browser.find_element(By.ID, element_id).rect
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390, element_id
    # The lanes scroll sideways instead, so that every compute block keeps its label.
    labels = browser.find_elements(By.CSS_SELECTOR, "#predicted .label:not(.pending)")
    assert len(labels) == 4 * 8 * 3 + 4 * 7  # F, B and W of every stage and micro-batch, and R
    _screenshot(browser, tmp_path, "view-phone.png")
