"""Byte-level text data with no download (the interpreter's own standard library, or your
files), and the random windows a run trains on, of bytes or of any token ids."""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "stdlib_corpus",
    "load_text",
    "encode",
    "decode",
    "ByteDataset",
    "BatchSampler",
]

_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}


@functools.cache
def stdlib_corpus(max_bytes: int = 8_000_000, *, include_tests: bool = False) -> bytes:
    """The ``.py`` sources of this interpreter's standard library, in sorted path order, cut
    at ``max_bytes``: text every Python install already holds, the same on every rank."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = _NOT_STDLIB if include_tests else _NOT_STDLIB | _TEST_DIRS
    parts, size = [], 0
    for path in _files(root, skipped.__contains__):
        if path.suffix != ".py":
            continue
        try:
            text = path.read_bytes()
        except OSError:
            continue
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    if not parts:
        raise ValueError(f"no readable .py files in the standard library at {root}")
    return b"".join(parts)[:max_bytes]


def _files(root: Path, skip: Callable[[str], bool]) -> list[Path]:
    """Files under ``root``, sorted, leaving out those and never entering folders whose name
    ``skip`` accepts (pruned, not filtered: site-packages can dwarf the standard library)."""
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not skip(d)]
        found.extend(Path(folder, f) for f in files if not skip(f))
    return sorted(found)


def _text_or_none(path: Path, root: Path, flag: str) -> bytes | None:
    """The file's bytes if it is UTF-8 text, None if it is a binary (it holds a NUL byte).
    Text in another encoding is refused rather than skipped: leaving it out would silently
    train on less than the user gave. ``root`` is what ``flag`` gave: the file or its folder."""
    named = f"{flag} {root}" if path == root else f"{flag} {root}: {path.relative_to(root)}"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{named} cannot be read ({exc.strerror or exc})") from None
    if b"\0" in data:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        remedy = "" if path == root else ", or move it out of the folder"
        raise ValueError(
            f"{named} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); "
            f"convert it to UTF-8{remedy}"
        ) from None
    return data


def load_text(path: str | Path, *, flag: str = "data path") -> bytes:
    """A text file's bytes, or the UTF-8 text files under a folder concatenated in sorted path
    order. Hidden files and folders (such as ``.git``) and binaries (files holding a NUL byte)
    are skipped; a file of text in another encoding is a ValueError naming it and its first
    wrong byte, as is an unreadable one. ``flag`` names the source in messages."""
    root = Path(path)
    if not root.exists():
        raise ValueError(f"{flag} {path} does not exist")
    files = [root] if root.is_file() else _files(root, lambda name: name.startswith("."))
    texts = [t for t in (_text_or_none(f, root, flag) for f in files) if t]
    if not texts:
        raise ValueError(
            f"{flag} {path} holds no readable UTF-8 text, only empty or binary files (a "
            "file holding a NUL byte, such as UTF-16 text, counts as binary)"
        )
    return b"".join(texts)


def encode(text: str) -> Tensor:
    """The UTF-8 bytes of ``text`` as an int64 tensor of token ids in [0, 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: Tensor | Sequence[int]) -> str:
    """Token ids back to text; byte sequences that are not UTF-8 become U+FFFD."""
    values = tokens.flatten().tolist() if isinstance(tokens, Tensor) else list(tokens)
    return bytes(values).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class ByteDataset:
    """A corpus as two uint8 tensors: ``train`` and the held-out ``val``."""

    train: Tensor
    val: Tensor

    @classmethod
    def split(cls, data: bytes, val_fraction: float = 0.1) -> ByteDataset:
        """The last ``val_fraction`` of ``data`` is ``val``: contiguous, so no validation
        window overlaps a training one (except across the single cut)."""
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if not data:
            raise ValueError("data is empty; expected some bytes of text")
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        cut = len(tensor) - int(len(tensor) * val_fraction)
        return cls(train=tensor[:cut], val=tensor[cut:])


class BatchSampler:
    """Endless random windows of a split: ``(inputs, targets)`` int64 ``[batch_size, seq_len]``,
    targets being inputs shifted by one token.

    The split is a tensor (a ``ByteDataset``'s) or a 1-D numpy array of token ids (a
    ``TokenDataset``'s, often a memory map): a batch reads only its windows. Both draw the
    windows' starts with the same generator calls, so the same ids give the same batches.

    It draws from its own generator, so its ``state_dict`` is all a resumed run needs to draw
    exactly the batches the interrupted one would have.
    """

    def __init__(
        self, data: Tensor | np.ndarray, batch_size: int, seq_len: int, *, seed: int = 0
    ) -> None:
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BatchSampler: {name} must be a positive integer, got {value!r}")
        if len(data) < seq_len + 1:
            unit = "bytes" if isinstance(data, Tensor) or data.dtype == np.uint8 else "tokens"
            raise ValueError(
                f"BatchSampler: the split has {len(data)} {unit}, fewer than one window of "
                f"seq_len {seq_len} + 1"
            )
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0
        self._offsets = torch.arange(seq_len + 1)

    def next(self) -> tuple[Tensor, Tensor]:
        """The next batch."""
        starts = torch.randint(
            len(self.data) - self.seq_len, (self.batch_size,), generator=self.generator
        )
        if isinstance(self.data, Tensor):
            windows = self.data[starts[:, None] + self._offsets].long()
        else:  # index the array (a memory map reads just these windows), then convert
            index = starts.numpy()[:, None] + self._offsets.numpy()
            windows = torch.from_numpy(np.asarray(self.data[index], dtype=np.int64))
        self.step += 1
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            yield self.next()

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"generator", "step"} - set(state)
        if missing:
            raise ValueError(
                f"BatchSampler.load_state_dict: state lacks {sorted(missing)}; "
                "expected what state_dict() returns"
            )
        self.generator.set_state(state["generator"])
        self.step = int(state["step"])
