"""A measured step replayed: its mean action times as costs, and the timeline they predict."""

from __future__ import annotations

from collections.abc import Sequence

from gpipe.planning.costs import Costs
from gpipe.planning.replay import simulate
from gpipe.runtime.timeline import Event
from gpipe.schedules import Schedule

__all__ = ["measured_costs", "predict"]


def measured_costs(schedule: Schedule, events: Sequence[Event]) -> Costs:
    """Each stage's mean measured time of F, B and W (0 where none ran); messages free."""
    total: dict[tuple[int, str], float] = {}
    count: dict[tuple[int, str], int] = {}
    for e in events:
        if e.is_compute:
            key = (e.stage, e.kind)
            total[key] = total.get(key, 0.0) + max(e.end - e.start, 0.0)
            count[key] = count.get(key, 0) + 1

    def mean(kind: str) -> list[float]:
        return [
            total.get((s, kind), 0.0) / count.get((s, kind), 1) for s in range(schedule.n_stages)
        ]

    return Costs(forward=mean("F"), backward=mean("B"), weight=mean("W"))


def predict(schedule: Schedule, events: Sequence[Event]) -> list[Event]:
    """The timeline ``schedule`` would have if each action took what it took on average.

    Costs come from the compute actions in ``events`` (a measured step); messages are taken
    as instant, so where the measured timeline lags the prediction, transfers or overheads
    are the cause. Returns the predicted compute events in order of start.
    """
    result = simulate(schedule, measured_costs(schedule, events))
    predicted = [
        Event(rank, a.stage, a.kind.value, a.microbatch, start, end)
        for rank, a, start, end in result.events
    ]
    return sorted(predicted, key=lambda e: (e.start, e.rank, e.stage))
