"""Tools that predict before a run: where to cut, what fits in memory, how long a schedule
takes and which configuration to pick. They read schedules and costs, never run a step.

The simulator's step prediction from measured costs is ``predict``; the cluster planner's, of
a layout on many GPUs, and its search are ``gpipe.planning.cluster.predict`` and
``gpipe.planning.cluster_search.search`` (``gpipe plan --cluster``), whose names would
otherwise clash with the simulator's ``predict`` and the stage planner's ``search``. Two
functions are named as their modules are; exported, each would hide its module (``import
gpipe.planning.simulate as s`` would give the function), so they are called through their
modules: ``gpipe.planning.simulate.simulate`` and ``gpipe.planning.memory.profile``.
"""

from gpipe.planning.advice import bubble, chunks_advice
from gpipe.planning.balancing import (
    balance_by_params,
    balance_by_size,
    balance_by_time,
    layer_times,
    partition,
)
from gpipe.planning.cluster import Prediction
from gpipe.planning.cluster_layout import Layout
from gpipe.planning.cluster_step import pipeline_costs, stage_costs
from gpipe.planning.generation import GenerationPlan, plan_generation
from gpipe.planning.hardware import CATALOGUE, Cluster, Device, load_devices, parse_cluster
from gpipe.planning.hf_config import from_hf_config
from gpipe.planning.layer_costs import PassCosts, Software, Work, block_costs
from gpipe.planning.memory import ActivationMeter, MemoryPlan, Profile, plan, sub_sequence_carry
from gpipe.planning.roofline import Link, matmul_seconds
from gpipe.planning.simulate import (
    Costs,
    SimResult,
    analytic_bubble,
    closed_form_bubble,
    closed_form_peak,
    compare,
    measured_costs,
    predict,
    scenario,
    sub_sequence_costs,
)
from gpipe.planning.suggest import flop_costs, search, timed_costs
from gpipe.planning.transformer import TransformerShape, gpt_shape

__all__ = [
    "CATALOGUE",
    "ActivationMeter",
    "Cluster",
    "Costs",
    "Device",
    "GenerationPlan",
    "Layout",
    "Link",
    "MemoryPlan",
    "PassCosts",
    "Prediction",
    "Profile",
    "SimResult",
    "Software",
    "TransformerShape",
    "Work",
    "analytic_bubble",
    "balance_by_params",
    "balance_by_size",
    "balance_by_time",
    "block_costs",
    "bubble",
    "chunks_advice",
    "closed_form_bubble",
    "closed_form_peak",
    "compare",
    "flop_costs",
    "from_hf_config",
    "gpt_shape",
    "layer_times",
    "load_devices",
    "matmul_seconds",
    "measured_costs",
    "parse_cluster",
    "partition",
    "pipeline_costs",
    "plan",
    "plan_generation",
    "predict",
    "scenario",
    "search",
    "stage_costs",
    "sub_sequence_carry",
    "sub_sequence_costs",
    "timed_costs",
]
