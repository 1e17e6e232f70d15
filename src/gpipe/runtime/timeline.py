"""Timelines: what each stage did when, as Chrome/Perfetto traces and Gantt charts."""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpipe.schedules import Action

__all__ = ["Event", "Recorder", "merge", "plot_gantt", "to_chrome"]

_COMPUTE = ("F", "B", "W", "R")
_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "R": "#8172b3"}
_LABELS = {"F": "forward", "B": "backward", "W": "weight gradients", "R": "recomputation"}
_COMM_COLOUR = "#9a9a9a"


@dataclass(frozen=True)
class Event:
    """One action that ran: ``kind`` is the schedule's letter (``"F"``, ``"SEND_B"``, ...) and
    ``start``/``end`` are seconds since the start of its step."""

    rank: int
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float

    @property
    def name(self) -> str:
        return f"{self.kind}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in _COMPUTE


_Raw = tuple[int, str, int, float, float]


class Recorder:
    """Collects one rank's actions per step, cheaply enough to leave on while training.

    ``on_action`` is the executor's ``on_action`` hook: it only appends a tuple to the current
    step's list, and ``list.append`` is atomic in CPython, so GPipe's worker threads can share
    one recorder. Only the last ``keep`` steps are kept, so memory stays bounded however long
    the training runs. Times are the host's clock: on CUDA, where kernels run asynchronously,
    an action's span is when the host issued its work, which may precede the device's.
    """

    def __init__(self, rank: int = 0, keep: int = 4) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        self.rank = rank
        self.keep = keep
        self._steps: deque[tuple[float, list[_Raw]]] = deque(maxlen=keep)
        self._current: list[_Raw] = []
        self.clear()

    def __len__(self) -> int:
        """The number of steps kept."""
        return len(self._steps)

    def on_action(self, action: Action, start: float, end: float) -> None:
        self._current.append((action.stage, action.kind.value, action.microbatch, start, end))

    def step(self) -> None:
        """Start a new step now. A step that recorded nothing is restarted instead, so calls
        that run nothing cannot push recorded steps out."""
        if not self._current:
            self._steps[-1] = (perf_counter(), self._current)
            return
        self._current = []
        self._steps.append((perf_counter(), self._current))

    def events(self, step: int = -1) -> list[Event]:
        """The events of one kept step (default: the last), in order of start, with times
        relative to the step's start."""
        n = len(self._steps)
        if isinstance(step, bool) or not isinstance(step, int) or not -n <= step < n:
            raise IndexError(f"step must be an integer in [{-n}, {n}), got {step!r}")
        origin, raw = self._steps[step]
        events = [Event(self.rank, s, k, mb, a - origin, b - origin) for s, k, mb, a, b in raw]
        return sorted(events, key=lambda e: e.start)

    def clear(self) -> None:
        """Forget every step and start a fresh one."""
        self._current = []
        self._steps.clear()
        self._steps.append((perf_counter(), self._current))


def merge(per_rank: Sequence[Sequence[Event]]) -> list[Event]:
    """One timeline from the events of several processes, in order of start.

    Each process measures from its own step start, so the clocks are aligned there only; that
    start follows a collective, which makes the alignment good to about its latency.
    """
    events = [e for events in per_rank for e in events]
    return sorted(events, key=lambda e: (e.start, e.rank, e.stage))


def _meta(what: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": what, "pid": pid, "tid": tid, "args": args}


def _chrome_events(events: Sequence[Event], pid_offset: int, label: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        pid = pid_offset + rank
        out.append(_meta("process_name", pid, 0, name=f"{label} {rank}"))
        out.append(_meta("process_sort_index", pid, 0, sort_index=pid))
    for rank, stage in sorted({(e.rank, e.stage) for e in events}):
        pid = pid_offset + rank
        out.append(_meta("thread_name", pid, stage, name=f"stage {stage}"))
        out.append(_meta("thread_sort_index", pid, stage, sort_index=stage))
    for e in events:
        out.append(
            {
                "ph": "X",
                "name": e.name,
                "cat": "compute" if e.is_compute else "comm",
                "ts": round(e.start * 1e6, 3),
                "dur": round(max(e.end - e.start, 0.0) * 1e6, 3),
                "pid": pid_offset + e.rank,
                "tid": e.stage,
                "args": {"microbatch": e.microbatch, "stage": e.stage},
            }
        )
    return out


def to_chrome(
    events: Sequence[Event],
    path: str | os.PathLike[str] | None = None,
    predicted: Sequence[Event] | None = None,
) -> dict[str, Any]:
    """The events in Chrome's trace event format, for chrome://tracing or ui.perfetto.dev.

    One process per rank and one thread per stage; ``predicted`` events (from a simulation)
    get processes of their own after the measured ones, to compare the two side by side.
    Written as JSON to ``path`` if given.
    """
    trace = _chrome_events(events, 0, "rank")
    if predicted is not None:
        offset = 1 + max((e.rank for e in events), default=-1)
        trace += _chrome_events(predicted, offset, "predicted rank")
    result = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(result))
    return result


def _row_labels(events: Sequence[Event]) -> dict[tuple[int, int], str]:
    rows = sorted({(e.rank, e.stage) for e in events})
    one_each = all(rank == stage for rank, stage in rows)
    return {
        (rank, stage): f"stage {stage}" if one_each else f"rank {rank} · stage {stage}"
        for rank, stage in rows
    }


def _draw(ax: Any, events: Sequence[Event], span: float, width_pt: float) -> set[str]:
    """Draw one panel's bars, one collection per row and kind; returns the kinds drawn."""
    labels = _row_labels(events)
    row = {key: i for i, key in enumerate(labels)}
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in events:
        y = row[(e.rank, e.stage)]
        left, width = e.start * 1e3, (e.end - e.start) * 1e3
        bars.setdefault((y, e.kind if e.is_compute else "comm"), []).append((left, width))
        text = str(e.microbatch)
        if e.is_compute and span > 0 and width / span * width_pt >= 6 * len(text) + 4:
            ax.text(left + width / 2, y, text, ha="center", va="center", fontsize=7, color="white")
    for (y, kind), ranges in bars.items():
        if kind == "comm":
            ax.broken_barh(ranges, (y + 0.24, 0.12), color=_COMM_COLOUR)
        else:
            ax.broken_barh(
                ranges, (y - 0.35, 0.7), color=_COLOURS[kind], edgecolor="white", linewidth=0.5
            )
    ax.set_yticks(range(len(labels)), list(labels.values()))
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    return {kind for _, kind in bars}


def plot_gantt(
    events: Sequence[Event],
    path: str | os.PathLike[str],
    predicted: Sequence[Event] | None = None,
    title: str | None = None,
) -> Path:
    """A Gantt chart of the events as a PNG: one row per stage, gaps are idle time.

    Forward, backward and weight-gradient passes are coloured bars labelled with their
    micro-batch; communication is a thin grey line. ``predicted`` events are drawn in a second
    panel below on the same time axis. Returns the path written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError(
            "plot_gantt needs matplotlib: pip install 'gpipe-parallel[plot]'"
        ) from exc

    panels = [("measured", events)]
    if predicted is not None:
        panels.append(("predicted", predicted))
    heights = [max(len(_row_labels(p)), 1) for _, p in panels]
    width_in = 10.0
    fig = Figure(
        figsize=(width_in, 1.2 + 0.45 * sum(heights) + 0.6 * len(panels)), layout="constrained"
    )
    FigureCanvasAgg(fig)
    axes = fig.subplots(
        len(panels), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights}
    )[:, 0]
    span = max((e.end for _, p in panels for e in p), default=0.0) * 1e3
    drawn: set[str] = set()
    for ax, (name, panel) in zip(axes, panels, strict=True):
        drawn |= _draw(ax, panel, span, width_in * 0.8 * 72)
        if predicted is not None:
            ax.set_title(name, loc="left", fontsize=9)
    axes[-1].set_xlabel("time (ms)")
    if span > 0:
        axes[-1].set_xlim(0, span * 1.01)
    handles = [Patch(color=_COLOURS[k], label=_LABELS[k]) for k in _COMPUTE if k in drawn]
    if "comm" in drawn:
        handles.append(Patch(color=_COMM_COLOUR, label="communication"))
    if handles:
        axes[0].legend(
            handles=handles,
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            ncol=len(handles),
            frameon=False,
            fontsize=8,
        )
    if title is not None:
        fig.suptitle(title)
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out
