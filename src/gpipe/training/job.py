"""The training job behind ``gpipe train``: what every rank runs, one stage per process.

Every rank draws the same batches from the same seeded sampler; the first stage feeds the
inputs and the last the targets. Embedding and LM head may be tied across the first and last
stage: the two copies start equal and their gradients are summed before every optimizer
step, so they stay equal, as one shared weight would. The parts live in modules of their
own beside this one; the names users import from here stay here.
"""

from __future__ import annotations

from typing import Any

from gpipe.training.balance_choice import BALANCE_MODES, parse_balance
from gpipe.training.optimization import learning_rate
from gpipe.training.options import PRECISIONS, RunSpec, TrainOptions
from gpipe.training.stage_run import StageRun

__all__ = [
    "BALANCE_MODES",
    "PRECISIONS",
    "RunSpec",
    "TrainOptions",
    "learning_rate",
    "parse_balance",
    "run_stage",
]


def run_stage(spec: RunSpec) -> dict[str, Any] | None:
    """Train this rank's stage; returns the run's summary on rank 0 and None elsewhere."""
    return StageRun(spec).run()
