"""Checkpoints of a training run: torch.distributed.checkpoint folders, written atomically.

A checkpoint holds the model keyed by layer (``model.3.attn.qkv.weight``, whatever the number
of stages), the optimizer keyed the same way, the data sampler's state and the step. Every
rank writes its own stage's part into ``.step-N.partial``; once all have finished, rank 0
renames the folder to ``step-N``. A crash mid-save leaves only a ``.partial`` folder, which
is never read, so a ``step-N`` folder is always complete.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

__all__ = [
    "DESCRIPTION",
    "checkpoint_dirs",
    "latest_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "read_description",
    "save_checkpoint",
]

DESCRIPTION = "gpipe.json"  # what the checkpoint is: model config and step, readable by people
_PREFIX = "step-"
# Optimizer state keyed by parameter name, one entry per parameter, so that the stages'
# parts never collide: this is what lets each rank save only its own.
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoint_dirs(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(_PREFIX) and (p / ".metadata").is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def latest_checkpoint(root: Path) -> Path | None:
    dirs = checkpoint_dirs(root)
    return dirs[-1] if dirs else None


def read_description(path: Path) -> dict[str, Any]:
    return json.loads((path / DESCRIPTION).read_text())


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group)


def _is_writer(group: dist.ProcessGroup | None) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


def _state(model: nn.Module, optimizer: Optimizer, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIM),
        **extra,
    }


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: Optimizer,
    extra: dict[str, Any],
    description: dict[str, Any],
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Save this rank's part of step ``step`` under ``root``; collective over ``group``.

    ``extra`` holds more state (the sampler's, the step), the same on every rank.
    ``description`` is written as JSON beside the data for people and for ``gpipe sample``.
    """
    final = root / f"{_PREFIX}{step:06d}"
    partial = root / f".{final.name}.partial"
    if _is_writer(group):
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    _barrier(group)
    dcp.save(_state(model, optimizer, extra), checkpoint_id=partial, process_group=group)
    _barrier(group)
    if _is_writer(group):
        (partial / DESCRIPTION).write_text(json.dumps(description | {"step": step}, indent=2))
        if final.exists():  # the same step saved again, after a resume: replace it whole
            stale = root / f".{final.name}.stale"
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
            os.replace(partial, final)
            shutil.rmtree(stale)
        else:
            os.replace(partial, final)
        _fsync_dir(root)
    _barrier(group)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: Optimizer,
    extra: dict[str, Any],
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Load this rank's part of the checkpoint at ``path`` into ``model`` and ``optimizer``;
    returns ``extra`` filled with the saved values. Works for any number of stages."""
    state = _state(model, optimizer, extra)
    dcp.load(state, checkpoint_id=path, process_group=group)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIM)
    return {key: state[key] for key in extra}


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load the weights of a checkpoint into ``model``, the whole model in one process."""
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state["model"])
