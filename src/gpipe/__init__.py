"""gpipe: pipeline-parallel training of models too large for one device (arXiv:1811.06965)."""

from .checkpointing import is_checkpointing, is_recomputing
from .distributed import Pipeline
from .errors import BalanceError, MovingDenied, PipelineError, StageError
from .launch import LaunchError, launch
from .pipe import GPipe
from .splitting import split

__all__ = [
    "BalanceError",
    "GPipe",
    "LaunchError",
    "MovingDenied",
    "Pipeline",
    "PipelineError",
    "StageError",
    "is_checkpointing",
    "is_recomputing",
    "launch",
    "split",
]
__version__ = "0.1.0"
