"""Skip connections that cross stages: ``@skippable`` layers ``stash`` a tensor and a later
layer ``pop``s it; in a pipeline it travels straight from one stage to the other."""

from gpipe.skip.layout import SkipLayout, StagePorts
from gpipe.skip.namespace import Namespace
from gpipe.skip.skippable import (
    Skip,
    Skippable,
    find_skips,
    pop,
    skippable,
    stash,
    verify_skippables,
)
from gpipe.skip.tracker import current_tracker, use_tracker

__all__ = [
    "Namespace",
    "Skip",
    "SkipLayout",
    "Skippable",
    "StagePorts",
    "current_tracker",
    "find_skips",
    "pop",
    "skippable",
    "stash",
    "use_tracker",
    "verify_skippables",
]
