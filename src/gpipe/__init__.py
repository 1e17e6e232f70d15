"""gpipe: pipeline-parallel training of models too large for one device (arXiv:1811.06965)."""

from gpipe.checkpointing import is_checkpointing, is_recomputing
from gpipe.distributed import Pipeline
from gpipe.errors import BalanceError, MovingDenied, PipelineError, StageError
from gpipe.launch import LaunchError, launch
from gpipe.pipe import GPipe
from gpipe.splitting import split

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
