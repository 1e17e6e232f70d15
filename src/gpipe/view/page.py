"""The page behind ``gpipe view``: one self-contained HTML file, its scripts and data inline, so it
plays schedules opened from disk with no network."""

from __future__ import annotations

import errno
import html
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from gpipe.planning.simulate import Costs, measured_costs
from gpipe.runtime.recompute import check_checkpoint
from gpipe.runtime.timeline import Event
from gpipe.schedules import SCHEDULES, Schedule, get_schedule, traits

__all__ = [
    "DEFAULT_COSTS",
    "LIMITS",
    "Measured",
    "Settings",
    "asset",
    "asset_path",
    "check_settings",
    "costs_json",
    "page_data",
    "render",
    "schedule_json",
    "write",
]

# What the page draws at most; its controls refuse more, and so does ``check_settings``.
LIMITS = {"stages": 32, "chunks": 128, "virtual_stages": 8, "actions": 50_000}

# Forward, input-gradient and weight-gradient passes of one time unit each (as gpipe
# simulate's default), 4 MiB messages and 64 MiB of activations per micro-batch and stage.
DEFAULT_COSTS = Costs(
    forward=1.0, backward=1.0, weight=1.0, message_bytes=4 * 2**20, activation_bytes=64 * 2**20
)

# Inlined in this order: each script uses what those before it define.
_SCRIPTS = ("schedule.js", "simulate.js", "controls.js", "lanes.js", "app.js")
_PER_RANK = ("forward", "backward", "weight", "activation_bytes")


def _actions(stages: int, chunks: int, schedule: str, virtual_stages: int) -> int:
    """At most how many actions the schedule has: F, B, W (when its backward is split) and four
    messages per stage and micro-batch (the page estimates the same)."""
    per = 7 if traits(schedule).split_backward else 6
    return stages * virtual_stages * chunks * per


def check_settings(
    stages: int,
    chunks: int,
    schedule: str,
    virtual_stages: int,
    checkpoint: str,
    costs: Costs,
    names: Mapping[str, str] | None = None,
) -> None:
    """Raise ValueError naming the first setting the page cannot play.

    ``names`` says what to call each setting in the message (the command line passes its
    option names); by default a setting is called by its field name.
    """

    def name(key: str) -> str:
        return (names or {}).get(key, key)

    for key, value in (("stages", stages), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= LIMITS[key]:
            raise ValueError(
                f"{name(key)} must be a whole number from 1 to {LIMITS[key]}, got {value!r}"
            )
    try:
        get_schedule(schedule)
    except ValueError as exc:
        raise ValueError(f"{name('schedule')}: {exc}") from None
    v = virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= LIMITS["virtual_stages"]:
        raise ValueError(
            f"{name('virtual_stages')} must be a whole number from 1 to "
            f"{LIMITS['virtual_stages']}, got {v!r}"
        )
    try:
        check_checkpoint(checkpoint)
    except ValueError as exc:
        raise ValueError(f"{name('checkpoint')}: {exc}") from None
    if traits(schedule).microbatches_per_round and chunks % stages:
        raise ValueError(
            f"{name('schedule')} {schedule} needs {name('chunks')} a multiple of "
            f"{name('stages')}, got {chunks} and {stages}"
        )
    if not traits(schedule).runs(stages, chunks, v):
        fewest = traits(schedule).fewest_microbatches(stages, v)
        raise ValueError(
            f"{name('schedule')} {schedule} needs {name('chunks')} of at least {fewest} "
            f"for {stages} {name('stages')}, got {chunks}"
        )
    if not isinstance(costs, Costs):
        raise ValueError(f"{name('costs')} must be a gpipe.planning.simulate.Costs, got {costs!r}")
    for key in _PER_RANK:
        try:
            costs.per_stage(key, stages)
        except ValueError as exc:
            raise ValueError(f"{name('costs')}: {exc} (one value per rank)") from None
    try:
        costs.microbatch_scales(chunks)
    except ValueError as exc:
        raise ValueError(f"{name('costs')}: {exc}") from None
    actions = _actions(stages, chunks, schedule, traits(schedule).stages_per_rank(v))
    if actions > LIMITS["actions"]:
        raise ValueError(
            f"{name('stages')} {stages}, {name('chunks')} {chunks}: up to {actions} actions, "
            f"more than the page draws ({LIMITS['actions']}); take fewer"
        )


@dataclass(frozen=True)
class Settings:
    """Where the page's controls start: K ranks, M micro-batches, the schedule (with
    ``virtual_stages`` stages per rank when it places several on each), the
    re-materialization mode and the costs of one rank, as ``gpipe simulate`` takes them
    (see ``gpipe.planning.simulate.scenario``)."""

    stages: int = 4
    chunks: int = 8
    schedule: str = "gpipe"
    virtual_stages: int = 2
    checkpoint: str = "never"
    costs: Costs = field(default=DEFAULT_COSTS)

    def __post_init__(self) -> None:
        check_settings(
            self.stages,
            self.chunks,
            self.schedule,
            self.virtual_stages,
            self.checkpoint,
            self.costs,
        )


@dataclass(frozen=True)
class Measured:
    """One measured step: the schedule that ran and what every rank did when
    (``Pipeline.timeline()``). The page draws it above the simulator's prediction from the
    step's own mean action times (``gpipe.planning.simulate.predict``)."""

    schedule: Schedule
    events: Sequence[Event]
    checkpoint: str = "never"

    def __post_init__(self) -> None:
        check_checkpoint(self.checkpoint)
        if not self.events:
            raise ValueError("a measured step needs events; got none")

    def settings(self) -> Settings:
        """The controls' starting point when leaving the measured run: its shape, default
        costs (or the page's defaults if the run is larger than the page plays)."""
        s = self.schedule
        name = s.name if s.name in SCHEDULES else "gpipe"
        v = s.n_stages // s.n_ranks if traits(name).several_stages_per_rank else 2
        try:
            return Settings(s.n_ranks, s.n_microbatches, name, v, self.checkpoint)
        except ValueError:
            return Settings(checkpoint=self.checkpoint)


def costs_json(costs: Costs) -> dict[str, Any]:
    """Costs as the page reads them (JSON, which has no infinity: an unlimited bandwidth is
    null); public so that what is fed to the page's own simulator can be checked against
    Python's."""
    data = costs.to_dict()
    if math.isinf(data["bandwidth"]):
        data["bandwidth"] = None
    return data


def schedule_json(schedule: Schedule) -> dict[str, Any]:
    """A schedule as the page reads it: its programs as action strings (``0F1``), with what
    the page needs to place and simulate them."""
    return {
        "name": schedule.name,
        "n_stages": schedule.n_stages,
        "n_microbatches": schedule.n_microbatches,
        "programs": [[str(a) for a in program] for program in schedule.programs],
        "stage_to_rank": list(schedule.stage_to_rank),
        "backward": schedule.backward,
        "split_backward": schedule.split_backward,
        "recomputed": sorted(schedule.recomputed),
    }


def page_data(
    settings: Settings | None = None,
    measured: Measured | None = None,
    *,
    fixed: Schedule | None = None,
) -> dict[str, Any]:
    """What the page reads at start: its limits, the controls' values, a measured step, and a
    fixed schedule (read from a file: ``gpipe view --schedule-csv``) that the page plays as
    its schedule "file", with the costs from its controls."""
    if fixed is not None:
        _check_fixed(fixed)
        if settings is None:
            settings = Settings(fixed.n_ranks, fixed.n_microbatches)
    if settings is None:
        settings = measured.settings() if measured is not None else Settings()
    data: dict[str, Any] = {
        "limits": LIMITS,
        "settings": {
            "stages": settings.stages,
            "chunks": settings.chunks,
            "schedule": settings.schedule,
            "virtual_stages": settings.virtual_stages,
            "checkpoint": settings.checkpoint,
            "costs": costs_json(settings.costs),
        },
        "measured": None,
        "fixed": None if fixed is None else schedule_json(fixed),
    }
    if measured is not None:
        data["measured"] = {
            "schedule": schedule_json(measured.schedule),
            "checkpoint": measured.checkpoint,
            "costs": costs_json(measured_costs(measured.schedule, measured.events)),
            "events": [
                [e.rank, e.stage, e.kind, e.microbatch, e.start, e.end] for e in measured.events
            ],
        }
    return data


def _check_fixed(fixed: Schedule) -> None:
    """A fixed schedule the page can draw: within its limits of ranks, micro-batches and
    actions."""
    actions = sum(len(program) for program in fixed.programs)
    for what, value, limit in (
        ("ranks", fixed.n_ranks, LIMITS["stages"]),
        ("micro-batches", fixed.n_microbatches, LIMITS["chunks"]),
        ("actions", actions, LIMITS["actions"]),
    ):
        if value > limit:
            raise ValueError(
                f"schedule {fixed.name!r} has {value} {what}, more than the page draws ({limit})"
            )


def asset(name: str) -> str:
    """The text of one of the page's files (``app.js``, ``view.css``, ...)."""
    return (resources.files(__package__) / "assets" / name).read_text(encoding="utf-8")


def asset_path(name: str) -> Path:
    """Where one of the page's files lies, for tools that run its scripts outside a browser."""
    return Path(str(resources.files(__package__) / "assets" / name))


def _inline_json(data: Any) -> str:
    """JSON that cannot end the script element holding it."""
    text = json.dumps(data, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(
    settings: Settings | None = None,
    measured: Measured | None = None,
    title: str | None = None,
    *,
    fixed: Schedule | None = None,
) -> str:
    """The page as one HTML document: controls starting at ``settings`` (by default those of
    ``measured`` or ``fixed``, or K=4, M=8, gpipe), ``measured``'s lanes above the prediction
    if given, and ``fixed`` as a schedule to play (see ``page_data``)."""
    if title is None:
        title = "gpipe view: a measured step" if measured is not None else "gpipe view"
    scripts = []
    for name in _SCRIPTS:
        code = asset(name)
        if "</script" in code.lower():
            raise ValueError(f"{name} holds '</script', which would end its inline element")
        scripts.append(f"<script>\n{code}</script>")
    page = asset("view.html")
    for key, value in (
        ("@CSS@", asset("view.css")),
        ("@DATA@", _inline_json(page_data(settings, measured, fixed=fixed))),
        ("@SCRIPTS@", "\n".join(scripts)),
        ("@TITLE@", html.escape(title)),
    ):
        page = page.replace(key, value)
    return page


def write(
    path: str | Path,
    settings: Settings | None = None,
    measured: Measured | None = None,
    title: str | None = None,
    *,
    fixed: Schedule | None = None,
) -> Path:
    """Write the page (see ``render``) to ``path``; returns the path. A folder is refused
    (IsADirectoryError), a name ending in a separator too: ``Path`` would cut the separator
    off and write a file of the folder's name."""
    if str(path).endswith(("/", os.sep)) or Path(path).is_dir():
        page = Path(path) / "gpipe-view.html"
        message = f"is a folder; expected the page's file, such as {page}"
        raise IsADirectoryError(errno.EISDIR, message, str(path))
    out = Path(path)
    out.write_text(render(settings, measured, title, fixed=fixed), encoding="utf-8")
    return out
