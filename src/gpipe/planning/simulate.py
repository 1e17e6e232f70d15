"""Cost and memory simulation of any schedule: predicted timelines, bubbles and peak memory.

The simulator's names in one place: ``Costs`` (``costs``) says what actions cost,
``simulate`` (``replay``) runs a schedule's programs under them, ``bubbles`` compares
schedules and gives their closed forms, ``measured`` replays a measured step.
"""

from gpipe.planning.bubbles import analytic_bubble, closed_form_bubble, compare, scenario
from gpipe.planning.costs import Costs
from gpipe.planning.measured import measured_costs, predict
from gpipe.planning.replay import SimResult, simulate

__all__ = [
    "Costs",
    "SimResult",
    "analytic_bubble",
    "closed_form_bubble",
    "compare",
    "measured_costs",
    "predict",
    "scenario",
    "simulate",
]
