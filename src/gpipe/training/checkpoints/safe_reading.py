"""Reading a checkpoint without running code from it.

``torch.distributed.checkpoint``'s file reader unpickles a checkpoint's ``.metadata`` with
``pickle.load`` and the values of its state that are not tensors with ``torch.load(...,
weights_only=False)``. A pickle may name any importable callable and call it, so a folder that
someone else edited runs their code when it is opened, whatever its manifest says (whoever
edits a file can edit its digest too). Here every pickle in a checkpoint is read by an
allow-list instead: the metadata by an unpickler that resolves only the classes DCP's metadata
is made of, and every stored item (tensors and the rest) by ``torch.load(weights_only=True)``.
A foreign name is refused before anything it names is called, with ``CheckpointRefused``.

``refusals`` reads a whole checkpoint this way without loading it anywhere, so that a
checkpoint is judged before a single live tensor is overwritten; ``load_state`` is
``dcp.load`` through the same reader, for the loads that follow.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from gpipe.errors import first_line
from gpipe.training.checkpoints.pieces import PiecewiseLoadPlanner

__all__ = [
    "METADATA_FILE",
    "METADATA_GLOBALS",
    "CheckpointRefused",
    "SafeLoadPlanner",
    "SafeReader",
    "load_state",
    "read_metadata",
    "refusals",
]

METADATA_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name, "torch.strided"
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id, the folder it was saved to
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)
"""The globals a checkpoint's ``.metadata`` may name, besides ``torch``'s dtypes: the classes
PyTorch's checkpoint metadata is made of. This is the one list; a test writes checkpoints of
every kind gpipe saves and fails if the installed PyTorch names anything outside it."""


class CheckpointRefused(ValueError):
    """A checkpoint (or one of its files) that gpipe will not open: its pickles name code, or
    its metadata points outside its folder. Treated like a damaged checkpoint."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def _allowed(module: str, name: str) -> bool:
    if (module, name) in METADATA_GLOBALS:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a ``.metadata`` file, resolving only the globals of ``METADATA_GLOBALS``."""

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise pickle.UnpicklingError(
                f"it names {module}.{name}, which is not part of a checkpoint's metadata"
            )
        return super().find_class(module, name)


def _cause(failure: Any) -> Any:
    """A rank's failure as DCP gathers it: the exception and its stack summary (older
    versions: an object holding the exception)."""
    if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
        return failure[0]
    return getattr(failure, "exc", failure)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():  # torch's weights_only message starts with advice
        if "GLOBAL" in line or "nsupported" in line:
            return line.strip().rstrip(".")
    return first_line(exc)


def read_metadata(folder: Path, name: str = METADATA_FILE) -> Metadata:
    """The checkpoint metadata in ``folder``, read by the allow-list and checked: it is
    whole (``_malformed``) and every item it describes lies in a file of ``folder`` itself.
    CheckpointRefused otherwise."""
    path = folder / name
    if path.is_symlink():
        raise CheckpointRefused(path, "is a link; a checkpoint's files lie in its folder")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except OSError as exc:
        raise CheckpointRefused(path, f"unreadable ({exc.strerror or exc})") from None
    except Exception as exc:  # a pickle fails in many ways; each is a refusal
        raise CheckpointRefused(path, f"refused: {_first_line(exc)}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointRefused(path, f"holds a {type(metadata).__name__}, not checkpoint metadata")
    stored = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for info in stored.values():
        where = getattr(info, "relative_path", None)
        if not isinstance(where, str) or Path(where).name != where or where in ("", ".", ".."):
            raise CheckpointRefused(path, f"points at {where!r}, outside the checkpoint's folder")
    problem = _malformed(metadata)
    if problem is not None:
        raise CheckpointRefused(path, f"is not whole: {problem}")
    return metadata


def _malformed(metadata: Metadata) -> str | None:
    """Why ``metadata`` does not describe a checkpoint DCP can load, or None: each entry of
    the state a tensor (chunks within its size) or bytes, each stored where the storage
    map says, in a stretch of a file (a pickle of the right classes can still hold any
    values, and DCP would fail on them deep in a load, on every rank)."""
    described, stored = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(described, dict) or not described:
        return "it describes no state"
    if not isinstance(stored, dict):
        return f"its storage map is a {type(stored).__name__}"
    for index, info in stored.items():
        if not isinstance(index, MetadataIndex) or index.fqn not in described:
            return f"it stores {getattr(index, 'fqn', index)!r}, which its state does not hold"
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(isinstance(n, int) and n >= 0 for n in (offset, length)):
            return f"{index.fqn} lies at offset {offset!r}, length {length!r}"
    for name, entry in described.items():
        if isinstance(entry, BytesStorageMetadata):
            wanted = [MetadataIndex(name)]
        elif isinstance(entry, TensorStorageMetadata) and _chunks_fit(entry):
            wanted = [MetadataIndex(name, chunk.offsets) for chunk in entry.chunks]
        else:
            return f"{name!r} is neither bytes nor a tensor whose chunks fit its size"
        if any(index not in stored for index in wanted):
            return f"{name!r} is not stored"
    return None


def _chunks_fit(entry: TensorStorageMetadata) -> bool:
    # read as unpickled, whatever the annotations of its classes say
    size, chunks = cast(Any, entry.size), cast(Any, entry.chunks)
    if not isinstance(size, torch.Size) or not isinstance(chunks, list):
        return False
    for chunk in chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            return False
        offsets, sizes = cast(Any, chunk.offsets), cast(Any, chunk.sizes)
        if not (isinstance(offsets, torch.Size) and isinstance(sizes, torch.Size)):
            return False
        if not len(offsets) == len(sizes) == len(size):
            return False
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)):
            return False
    return True


def _load_item(stream: IO[bytes]) -> Any:
    """One stored item, by ``torch.load``'s allow-list, onto the meta device (its pickle is
    what is judged; no tensor's data is kept)."""
    return torch.load(stream, map_location="meta", weights_only=True)


def refusals(folder: Path) -> list[str]:
    """Why the checkpoint in ``folder`` must not be opened: an empty list if its metadata
    and every item it stores read by the allow-lists alone, each tensor of the size and
    dtype its metadata gives it. Reads every file once."""
    try:
        metadata = read_metadata(folder)
    except CheckpointRefused as exc:
        return [f"{METADATA_FILE} {exc.reason}"]
    problems: list[str] = []
    by_file: dict[str, list[tuple[MetadataIndex, Any]]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    for name, items in sorted(by_file.items()):
        if (folder / name).is_symlink():
            problems.append(f"{name} is a link; a checkpoint's files lie in its folder")
            continue
        try:
            with open(folder / name, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                for index, info in sorted(items, key=lambda item: item[1].offset):
                    if info.offset + info.length > size:
                        problems.append(f"{name} ends before an item it should hold")
                        break
                    f.seek(info.offset)
                    item = _load_item(io.BytesIO(f.read(info.length)))
                    wrong = _unlike(item, index, metadata.state_dict_metadata[index.fqn])
                    if wrong is not None:
                        problems.append(f"{name} holds {wrong}")
                        break
        except OSError as exc:
            problems.append(f"{name} unreadable ({exc.strerror or exc})")
        except Exception as exc:  # a refused global, or bytes that are no pickle at all
            problems.append(f"{name} refused: {_first_line(exc)}")
    return problems


def _unlike(item: Any, index: MetadataIndex, entry: Any) -> str | None:
    """How a stored tensor differs from what the metadata says of its chunk (its size, its
    dtype), or None: DCP would narrow a larger tensor to the chunk's size and cast another
    dtype, loading other values than the checkpoint names without a word."""
    if not isinstance(entry, TensorStorageMetadata):
        return None
    sizes = next((c.sizes for c in entry.chunks if c.offsets == index.offset), None)
    dtype = getattr(entry.properties, "dtype", None)
    if sizes is None:
        return f"{index.fqn} at {index.offset}, where its metadata has no chunk"
    if not isinstance(item, torch.Tensor):
        return f"a {type(item).__name__} for {index.fqn}, which its metadata says is a tensor"
    if item.shape != sizes or item.dtype != dtype:
        return (
            f"{index.fqn} as {item.dtype} {list(item.shape)}, "
            f"where its metadata says {dtype} {list(sizes)}"
        )
    return None


class SafeReader(FileSystemReader):
    """DCP's file-system reader with the metadata read by the allow-list; its tensors are
    already read with ``weights_only=True``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_metadata(Path(self.checkpoint_id), name)
        storage: StorageMeta | None = getattr(metadata, "storage_meta", None)
        if storage is None:
            storage = metadata.storage_meta = StorageMeta()
        storage.load_id = self.load_id
        return metadata


class SafeLoadPlanner(PiecewiseLoadPlanner):
    """DCP's load planner (split tensors read by their blocks) with the values that are not
    tensors read by ``torch.load``'s allow-list (``weights_only=True``) rather than by plain
    unpickling."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:
            raise pickle.UnpicklingError(
                f"item {read_item.dest_index.fqn} refused: {_first_line(exc)}"
            ) from None
        trusted = io.BytesIO()  # the parent unpickles again: give it our own pickle of it
        torch.save(loaded, trusted)
        trusted.seek(0)
        super().load_bytes(read_item, trusted)


def load_state(state: dict[str, Any], folder: Path, **how: Any) -> None:
    """``dcp.load(state, ...)`` from ``folder`` through the allow-lists; ``how`` is passed
    on (``process_group``, ``no_dist``). CheckpointRefused if a pickle names code.

    Judge the checkpoint with ``refusals`` first where a refusal must leave ``state`` as it
    was: this refuses an item only when it comes to it, after those before it are loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    read_metadata(folder)  # refused here, before DCP logs its fallbacks
    try:
        dcp.load(
            state,
            checkpoint_id=folder,
            storage_reader=SafeReader(folder),
            planner=SafeLoadPlanner(),
            **how,
        )
    except pickle.UnpicklingError as exc:
        raise CheckpointRefused(folder, _first_line(exc)) from None
    except CheckpointException as exc:  # DCP gathers each rank's failure into one
        causes = [_cause(failure) for failure in exc.failures.values()]
        for cause in causes:
            if isinstance(cause, CheckpointRefused):
                raise cause from None
            if isinstance(cause, pickle.UnpicklingError):
                raise CheckpointRefused(folder, _first_line(cause)) from None
        for cause in causes:  # its tensors do not fit the model its record describes
            if isinstance(cause, ValueError):
                raise ValueError(
                    f"{folder}: its tensors do not fit the model it describes: {_first_line(cause)}"
                ) from None
        # anything else DCP met reading it (a CheckpointException is no Exception: callers
        # that catch Exception would miss it)
        first = next((c for c in causes if isinstance(c, BaseException)), exc)
        raise ValueError(f"{folder}: could not be read: {_first_line(first)}") from None
