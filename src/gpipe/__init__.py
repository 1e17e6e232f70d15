"""gpipe: pipeline-parallel training of models too large for one device (arXiv:1811.06965)."""

# torchgpipe's module names, reachable after `import gpipe` too (gpipe.batchnorm.DeferredBatchNorm)
from gpipe import balance as balance
from gpipe import batchnorm as batchnorm
from gpipe import skip as skip
from gpipe.errors import BalanceError, ConfigError, MovingDenied, PipelineError, StageError
from gpipe.pipe import GPipe
from gpipe.pipeline import Pipeline
from gpipe.pipeline_config import PipelineConfig
from gpipe.runtime.recompute import is_checkpointing, is_recomputing
from gpipe.splitting import split
from gpipe.training.launch import LaunchError, launch

__all__ = [
    "BalanceError",
    "ConfigError",
    "GPipe",
    "LaunchError",
    "MovingDenied",
    "Pipeline",
    "PipelineConfig",
    "PipelineError",
    "StageError",
    "is_checkpointing",
    "is_recomputing",
    "launch",
    "split",
]
__version__ = "0.1.0"
