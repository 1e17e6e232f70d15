"""The step engine: what runs one step of a pipeline, under either facade.

``Pipeline`` (one stage per process) hands its steps to a ``StepRunner`` (``runner``), over the
stages that ``placement`` puts on its ranks and builds; ``GPipe`` (one process, a partition per
device) hands its forward to ``DeviceWorkers`` (``workers``). Both run the schedules that
``step_schedule`` builds, in one place, for every kind of step. Beside them: the user's own
micro-batches (``presplit`` for ``Pipeline``, ``given_batches`` for ``GPipe``), forward-only
log-probabilities (``forward_only``, through ``logprobs``), the losses' weights
(``loss_weights``) and clipping by the global norm of every rank's gradients (``clipping``).
"""

from gpipe.engine.clipping import clip_grad_norm_
from gpipe.engine.forward_only import forward_logprobs
from gpipe.engine.given_batches import (
    GivenForward,
    check_microbatches,
    given_outputs,
    take_step_data,
)
from gpipe.engine.logprobs import IGNORE_INDEX, TokenLogprobs, logits_of, token_logprobs
from gpipe.engine.loss_weights import scatter_targets
from gpipe.engine.placement import (
    BuiltStages,
    RankPlacement,
    StageRecipe,
    build_stages,
    check_stages_per_rank,
)
from gpipe.engine.presplit import (
    Presplit,
    first_parts,
    given_microbatches,
    given_targets,
    later_sizes,
)
from gpipe.engine.runner import StepResult, StepRunner, StepTimes, connect
from gpipe.engine.step_schedule import ScheduleSource, StepSchedules
from gpipe.engine.workers import DeviceWorkers, PipelinedForward

__all__ = [
    "IGNORE_INDEX",
    "BuiltStages",
    "DeviceWorkers",
    "GivenForward",
    "PipelinedForward",
    "Presplit",
    "RankPlacement",
    "ScheduleSource",
    "StageRecipe",
    "StepResult",
    "StepRunner",
    "StepSchedules",
    "StepTimes",
    "TokenLogprobs",
    "build_stages",
    "check_microbatches",
    "check_stages_per_rank",
    "clip_grad_norm_",
    "connect",
    "first_parts",
    "forward_logprobs",
    "given_microbatches",
    "given_outputs",
    "given_targets",
    "later_sizes",
    "logits_of",
    "scatter_targets",
    "take_step_data",
    "token_logprobs",
]
