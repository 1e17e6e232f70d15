"""Cost and memory simulation of any schedule: predicted timelines, bubbles and peak memory.

The simulator's names in one place: ``Costs`` (``costs``) says what actions cost,
``simulate`` (``replay``) runs a schedule's programs under them, ``bubbles`` compares
schedules, ``closed_forms`` gives each one's bubble and peak memory by formula,
``measured`` replays a measured step.
"""

from gpipe.planning.bubbles import compare, scenario, sub_sequence_costs
from gpipe.planning.closed_forms import analytic_bubble, closed_form_bubble, closed_form_peak
from gpipe.planning.costs import Costs
from gpipe.planning.measured import measured_costs, predict
from gpipe.planning.replay import SimResult, simulate

__all__ = [
    "Costs",
    "SimResult",
    "analytic_bubble",
    "closed_form_bubble",
    "closed_form_peak",
    "compare",
    "measured_costs",
    "predict",
    "scenario",
    "simulate",
    "sub_sequence_costs",
]
