"""gpipe: pipeline-parallel training of models too large for one device (arXiv:1811.06965)."""

import importlib as _importlib
import sys as _sys
from typing import Any as _Any

from gpipe import _moved
from gpipe.errors import BalanceError, MovingDenied, PipelineError, StageError
from gpipe.pipe import GPipe
from gpipe.pipeline import Pipeline
from gpipe.runtime.recompute import is_checkpointing, is_recomputing
from gpipe.splitting import split
from gpipe.training.launch import LaunchError, launch

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

_moved.install()
# Old names of modules already loaded point at them now, so that importing one later does
# not rebind a package attribute (``gpipe.launch`` stays the function).
for _old, _new in _moved.MOVED.items():
    if _new in _sys.modules:
        _sys.modules.setdefault(_old, _sys.modules[_new])


def __getattr__(name: str) -> _Any:
    """``gpipe.planning.simulate`` and the other old module names, imported on first use."""
    new = _moved.current_name(f"{__name__}.{name}")
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _importlib.import_module(new)
