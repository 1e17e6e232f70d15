"""gpipe: pipeline-parallel training of models too large for one device (arXiv:1811.06965)."""

from .errors import BalanceError, MovingDenied, PipelineError, StageError
from .pipe import GPipe

__all__ = ["BalanceError", "GPipe", "MovingDenied", "PipelineError", "StageError"]
__version__ = "0.1.0"
