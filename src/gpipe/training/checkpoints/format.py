"""Checkpoints of a training run: torch.distributed.checkpoint folders, written atomically
and verifiably.

A checkpoint holds the model keyed by layer (``model.3.attn.qkv.weight``, whatever the number
of stages), the optimizer keyed the same way, the data sampler's state and the step. Every
rank writes its own stage's part into ``.step-N.partial`` (sharded replicas their shards,
which load into any number of replicas, sharded or not); once all have finished, the ranks
share out the hashing of its files, rank 0 writes a manifest of every file's size and SHA-256
last and renames the folder to ``step-N``. A crash mid-save leaves only a ``.partial`` folder,
which is never read, and a ``step-N`` folder damaged afterwards (a file lost or cut short)
fails its manifest and is skipped for the one before it, with a warning.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from gpipe.training.checkpoints.manifest import Digest, digest, listed_files, verify, write_manifest
from gpipe.training.run_record import checked_run_record, read_json

if TYPE_CHECKING:
    from gpipe.pipeline import Pipeline

__all__ = [
    "DESCRIPTION",
    "DamagedCheckpointWarning",
    "begin_save",
    "checkpoint_dirs",
    "checkpoint_group",
    "discard_partial",
    "finish_save",
    "latest_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "read_description",
    "read_run_record",
    "remove_folder",
    "save_checkpoint",
    "saved_state",
    "verify_checkpoint",
    "writing_ranks",
]

DESCRIPTION = "gpipe.json"  # what the checkpoint is: model config and step, readable by people
_PREFIX = "step-"


class DamagedCheckpointWarning(UserWarning):
    """A checkpoint failed verification and was skipped for an older one."""


def checkpoint_dirs(root: Path) -> list[Path]:
    """The checkpoints under ``root`` that were renamed into place, oldest first (whether
    they are still whole is ``verify_checkpoint``'s to say)."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def verify_checkpoint(path: Path, *, checksums: bool = True, run: bool = False) -> list[str]:
    """What is wrong with the checkpoint at ``path`` (empty if nothing): its manifest must
    be whole and list the data's index and the description, and every file it lists must be
    there with its size. With ``checksums``, every file must also match its SHA-256, the
    description must be a JSON object with the step (with ``run``, the record of a ``gpipe
    train`` run, field by field, of the model its run folder's ``run.json`` trains), and
    every pickle in the data must read by the allow-lists of ``safe_reading`` (a digest
    proves a file whole, not harmless: whoever edits a file can edit the manifest too)."""
    problems = verify(path, checksums=checksums, required=(".metadata", DESCRIPTION))
    if problems or not checksums:
        return problems
    from gpipe.training.checkpoints.safe_reading import refusals

    try:
        if run:
            _check_same_model(path, read_run_record(path))
        else:
            read_description(path)
    except ValueError as exc:
        return [str(exc)]
    return refusals(path)


RUN_RECORD = "run.json"  # beside ``checkpoints/``: the run's model and options


def _check_same_model(path: Path, record: dict[str, Any]) -> None:
    """ValueError if the checkpoint at ``path`` holds another model than the run whose
    ``checkpoints`` folder it lies in (a checkpoint copied in from another run): resumed,
    its tensors would not fit the stages the run builds. Where a split model is cut is
    learnt after ``run.json`` is written, so it is not compared."""
    run_file = path.parent.parent / RUN_RECORD
    if path.parent.name != "checkpoints" or not run_file.is_file():
        return
    mine = _shape(record.get("model", {}))
    theirs = _shape(checked_run_record(run_file).get("model", {}))
    differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if differ:
        raise ValueError(
            f"{path / DESCRIPTION}: holds another model than its run's {run_file} "
            f"(they differ in {', '.join(differ)}): a checkpoint of another run"
        )


def _shape(model: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model.items() if k != "split_at"}


def latest_checkpoint(root: Path, *, checksums: bool = True, run: bool = False) -> Path | None:
    """The newest checkpoint under ``root`` that verifies (``verify_checkpoint``); each
    newer one that does not is named in a DamagedCheckpointWarning. None if none verifies."""
    for path in reversed(checkpoint_dirs(root)):
        problems = verify_checkpoint(path, checksums=checksums, run=run)
        if not problems:
            return path
        warnings.warn(
            f"checkpoint {path} is damaged ({'; '.join(problems)}); skipped for an older one",
            DamagedCheckpointWarning,
            stacklevel=2,
        )
    return None


def discard_partial(root: Path) -> list[Path]:
    """Remove what unfinished saves left under ``root`` (``.step-N.partial`` folders and
    replaced ``.step-N.stale`` ones); returns them. Call it only while nothing saves."""
    if not root.is_dir():
        return []
    left = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(f".{_PREFIX}") and p.suffix in (".partial", ".stale")
    ]
    for path in left:
        remove_folder(path)
    return sorted(left)


def remove_folder(path: Path) -> None:
    """Remove the folder ``path`` of a run's checkpoints, whatever is left of it; a link is
    removed itself, never what it points at (a run folder may come from someone else)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def read_description(path: Path) -> dict[str, Any]:
    """The checkpoint's description (``gpipe.json``): what ``save_checkpoint`` was given and
    the step; a ValueError naming the file if it is not a JSON object with an integer step."""
    file = path / DESCRIPTION
    description = read_json(file)
    step = description.get("step") if isinstance(description, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"{file}: not a checkpoint's description (no integer step)")
    return description


def read_run_record(path: Path) -> dict[str, Any]:
    """The description of a checkpoint of a ``gpipe train`` run: its step, model and
    options, checked field by field (``run_record``); a ValueError naming the file."""
    return checked_run_record(path / DESCRIPTION, require_step=True)


def writing_ranks(pipe: Pipeline | None) -> list[int]:
    """The ranks that write ``pipe``'s checkpoints: its pipeline's, or with replicas the
    first replica's (the others hold the same state), every tensor rank of each stage (each
    holds its own shards); every rank, with sharded replicas (each holds its own shard)."""
    world = dist.get_world_size()
    if pipe is None or (pipe.replicas is not None and pipe.replicas.sharded):
        return list(range(world))
    if pipe.mesh is not None:  # (pipeline, data, tensor): replica 0 of every position
        return sorted(int(r) for r in pipe.mesh.mesh.mesh[:, 0, :].flatten().tolist())
    if pipe.replicas is not None:
        from gpipe.parallel.replicas import layout

        return layout(world, pipe.replicas.data_parallel)[0][0]
    return dist.get_process_group_ranks(pipe.group or dist.group.WORLD)


def checkpoint_group(pipe: Pipeline | None) -> dist.ProcessGroup | None:
    """The group that saves ``pipe``'s checkpoints, one ``.metadata`` listing what each of
    its ranks wrote: its pipeline's (the first replica's writes for all); the whole world
    (None) where every rank writes (sharded replicas), or where the writers are the world
    (tensor ranks without replicas); with tensor ranks and replicas, a group of the first
    replica's ranks, made here (collective over the world, as ``new_group`` is)."""
    if pipe is None:
        return None
    ranks = writing_ranks(pipe)
    if len(ranks) == dist.get_world_size():
        return None
    if pipe.mesh is not None:
        return dist.new_group(ranks)
    return pipe.group


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group)


def _is_writer(group: dist.ProcessGroup | None) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


# torch.distributed.checkpoint is imported where a checkpoint is written or read: it takes
# most of a second, which a process that never touches one (the command that only launches
# the stages, a run without checkpoints) need not spend.


def _optimizer_options() -> Any:
    """Optimizer state keyed by parameter name, one entry per parameter, so that the stages'
    parts never collide: this is what lets each rank save only its own."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def saved_state(model: nn.Module, optimizer: Optimizer, extra: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds of this rank: its model and optimizer keyed by layer, and
    ``extra``. The tensors are the live ones: a save in the background copies them first."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {
        "model": model.state_dict(),
        "optim": get_optimizer_state_dict(model, optimizer, options=_optimizer_options()),
        **extra,
    }


def _digests(folder: Path, group: dist.ProcessGroup | None) -> dict[str, Digest]:
    """Size and SHA-256 of every file in ``folder``, each rank of ``group`` hashing its share
    of them; collective."""
    names = listed_files(folder)
    if not dist.is_initialized():
        return {name: digest(folder / name) for name in names}
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    mine = {name: digest(folder / name) for name in names[rank::size]}
    shares: list[dict[str, Digest] | None] = [None] * size
    dist.all_gather_object(shares, mine, group=group)
    return {name: d for share in shares if share for name, d in share.items()}


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: Optimizer,
    extra: dict[str, Any],
    description: dict[str, Any],
    group: dist.ProcessGroup | None = None,
    *,
    on_written: Callable[[], None] | None = None,
) -> Path:
    """Save this rank's part of step ``step`` under ``root``; collective over ``group``.
    Training waits for it; ``CheckpointWriter`` saves in the background instead.

    ``extra`` holds more state (the sampler's, the step), the same on every rank.
    ``description`` is written as JSON beside the data for people and for ``gpipe sample``.
    ``on_written`` is called once this rank's files are written, before the checkpoint is
    complete (the fault tests lose a process there).
    """
    import torch.distributed.checkpoint as dcp

    from gpipe.training.checkpoints.pieces import PiecewiseSavePlanner

    partial = begin_save(root, step, group)
    dcp.save(
        saved_state(model, optimizer, extra),
        checkpoint_id=partial,
        process_group=group,
        planner=PiecewiseSavePlanner(),
    )
    return finish_save(root, step, description, group, on_written=on_written)


def begin_save(root: Path, step: int, group: dist.ProcessGroup | None) -> Path:
    """An empty ``.step-N.partial`` folder for step ``step``'s files; collective."""
    partial = root / f".{_PREFIX}{step:06d}.partial"
    if _is_writer(group):
        root.mkdir(parents=True, exist_ok=True)
        remove_folder(partial)
        partial.mkdir()
    _barrier(group)
    return partial


def finish_save(
    root: Path,
    step: int,
    description: dict[str, Any],
    group: dist.ProcessGroup | None,
    *,
    on_written: Callable[[], None] | None = None,
) -> Path:
    """Complete step ``step``'s checkpoint once every rank's files are in its partial folder:
    description, digests, manifest last, rename into place; collective. Returns its path."""
    final = root / f"{_PREFIX}{step:06d}"
    partial = root / f".{final.name}.partial"
    if on_written is not None:
        on_written()
    if _is_writer(group):
        text = json.dumps(description | {"step": step}, indent=2)
        with open(partial / DESCRIPTION, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    _barrier(group)
    digests = _digests(partial, group)
    if _is_writer(group):
        write_manifest(partial, digests)  # last: a folder with a whole manifest is complete
        _fsync_dir(partial)
        if final.exists():  # the same step saved again, after a resume: replace it whole
            stale = root / f".{final.name}.stale"
            remove_folder(stale)
            os.replace(final, stale)
            os.replace(partial, final)
            remove_folder(stale)
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
    returns ``extra`` filled with the saved values. Works for any number of stages. Every
    pickle is read by the allow-lists (``safe_reading``)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from gpipe.training.checkpoints.safe_reading import load_state

    state = saved_state(model, optimizer, extra)
    load_state(state, path, process_group=group)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"], options=_optimizer_options())
    return {key: state[key] for key in extra}


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load the weights of a checkpoint into ``model``, the whole model in one process,
    through the allow-lists (``safe_reading``)."""
    from gpipe.training.checkpoints.safe_reading import load_state

    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        load_state(state, path, no_dist=True)
    model.load_state_dict(state["model"])
