"""Old module names that keep working: ``import gpipe.schedules`` gives ``gpipe.schedules``.

The package was flat until 0.1; its modules then moved into folders by concern. Users'
imports of the old names (``gpipe.balance``, ``gpipe.checkpointing``, ``gpipe.simulate``,
...) stay valid until the next major version: a finder placed before the ordinary ones
answers an old name (and its submodules) with the module that now holds it, the very same
module object, so classes, private names and monkeypatching behave as before.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

MOVED: dict[str, str] = {
    "gpipe.schedule": "gpipe.schedules",
    "gpipe.stage": "gpipe.runtime.stage",
    "gpipe.executor": "gpipe.runtime.executor",
    "gpipe.checkpointing": "gpipe.runtime.recompute",
    "gpipe.weightgrad": "gpipe.runtime.weight_gradients",
    "gpipe.microbatch": "gpipe.runtime.microbatch",
    "gpipe.batchnorm": "gpipe.runtime.batchnorm",
    "gpipe.partition": "gpipe.runtime.partitions",
    "gpipe.amp": "gpipe.runtime.loss_scaling",
    "gpipe.trace": "gpipe.runtime.timeline",
    "gpipe.transport": "gpipe.comm.transport",
    "gpipe.p2p": "gpipe.comm.distributed",
    "gpipe.pipes": "gpipe.comm.named_pipes",
    "gpipe.envelope": "gpipe.comm.envelope",
    "gpipe.payload": "gpipe.comm.payload",
    "gpipe.copies": "gpipe.comm.copy_streams",
    "gpipe.replicas": "gpipe.parallel.replicas",
    "gpipe.ties": "gpipe.parallel.ties",
    "gpipe.simulate": "gpipe.planning.simulate",
    "gpipe.memory": "gpipe.planning.memory",
    "gpipe.balance": "gpipe.planning.balancing",
    "gpipe.suggest": "gpipe.planning.suggest",
    "gpipe.advice": "gpipe.planning.advice",
    "gpipe.train": "gpipe.training.job",
    "gpipe.data": "gpipe.training.data",
    "gpipe.saving": "gpipe.training.checkpoints",
    "gpipe.manifest": "gpipe.training.manifest",
    "gpipe.elastic": "gpipe.training.elastic",
    "gpipe.launch": "gpipe.training.launch",
    "gpipe.models": "gpipe.training.models",
    "gpipe.distributed": "gpipe.pipeline",
}


def current_name(name: str) -> str | None:
    """The module that now holds ``name`` (an old name or a submodule of one), else None."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads an old name by importing the new one and putting it in ``sys.modules``."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if current_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        # The import system returns whatever sys.modules holds under the name once this
        # returns, and leaves that module's own attributes (its __spec__, __name__) alone.
        new = current_name(module.__name__)
        assert new is not None
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Answer old names before the ordinary finders: a submodule of an old package name
    (``gpipe.models.gpt``) would otherwise be found again on the new package's path and
    loaded a second time. No file lives under an old name, so nothing real is shadowed."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
