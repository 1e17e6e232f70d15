"""The timeline of a run's last step, written beside the simulator's prediction of it."""

from __future__ import annotations

import json
from pathlib import Path

from gpipe.pipeline import Pipeline
from gpipe.planning.simulate import analytic_bubble, predict
from gpipe.runtime.timeline import Event, plot_gantt, to_chrome
from gpipe.view import Measured
from gpipe.view import write as write_page

__all__ = ["bubble_share", "write_timeline"]


def bubble_share(events: list[Event], n_ranks: int) -> float:
    """The share of the ranks' time in a step not spent computing."""
    start = min(e.start for e in events)
    makespan = max(e.end for e in events) - start
    busy = sum(e.end - e.start for e in events if e.is_compute)
    return 1 - busy / (n_ranks * makespan) if makespan > 0 else 0.0


def write_timeline(out: Path, events: list[Event], pipe: Pipeline, n_microbatches: int) -> None:
    """The measured step as a Chrome/Perfetto trace, as the interactive page and, with
    matplotlib, as a Gantt chart, each beside the simulator's prediction from the step's own
    measured costs."""
    schedule = pipe.schedule_for(n_microbatches)
    predicted = predict(schedule, events)
    to_chrome(events, out / "trace.json", predicted=predicted)
    bubbles = {
        "measured": bubble_share(events, schedule.n_ranks),
        "simulated": bubble_share(predicted, schedule.n_ranks),
        "analytic": analytic_bubble(pipe.n_ranks, n_microbatches),
    }
    (out / "bubble.json").write_text(json.dumps(bubbles, indent=1) + "\n")
    measured = Measured(schedule, events, str(pipe.checkpoint))  # a run names a mode
    write_page(out / "view.html", measured=measured)
    try:
        plot_gantt(events, out / "timeline.png", predicted=predicted, title=schedule.name)
    except ImportError as exc:
        print(f"timeline.png not drawn: {exc}", flush=True)
