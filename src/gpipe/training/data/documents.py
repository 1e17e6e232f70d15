"""Documents for packed training (``gpipe train --pack``): a JSON lines file's documents as
token ids with where each begins, the held-out part cut between documents, and the seeded,
resumable draw of each step's documents.

Text a real tokenizer turns into ids is tokenized once into the run folder, as for any run,
with a second file beside the ids that says where each document begins; bytes are read in
memory by every rank, as they are without ``--pack``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpipe.training.data.tokenizer import ByteTokenizer, Tokenizer
from gpipe.training.data.tokens import document_chunks, token_dtype_for

__all__ = [
    "Documents",
    "DocumentSampler",
    "open_documents",
    "prepare_documents",
    "read_documents",
    "starts_path",
]


@dataclass(frozen=True)
class Documents:
    """Documents laid one after another in ``ids``; document ``i`` is
    ``ids[starts[i]:starts[i + 1]]`` (``starts`` has one entry more than there are documents)."""

    ids: np.ndarray
    starts: np.ndarray

    def __len__(self) -> int:
        return len(self.starts) - 1

    def split(self, val_fraction: float) -> tuple[Documents, Documents]:
        """The first documents for training and the last ``val_fraction`` of them (at least
        one) held out, cut between documents."""
        n = len(self)
        if n < 2:
            raise ValueError(
                f"--pack needs at least 2 documents to hold one out for validation, got {n}; "
                "give more documents or --val-data"
            )
        cut = n - max(1, int(n * val_fraction))
        at = int(self.starts[cut])
        train = Documents(self.ids[:at], self.starts[: cut + 1])
        return train, Documents(self.ids[at:], self.starts[cut:] - at)


def starts_path(ids_path: Path) -> Path:
    """Where the document starts of a prepared token file lie: beside it."""
    return ids_path.with_name(ids_path.stem + ".starts.npy")


def read_documents(
    path: str | Path, tokenizer: Tokenizer | None, flag: str = "--data"
) -> Documents:
    """A JSON lines file's documents in memory (bytes without a tokenizer)."""
    chunks = list(document_chunks(path, tokenizer or ByteTokenizer(), flag))
    if not chunks:
        raise ValueError(f"{flag} {path} holds no documents (no line with a text field)")
    ids = np.concatenate([c for c, _ in chunks])
    lengths = np.concatenate([n for _, n in chunks])
    return Documents(ids, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def prepare_documents(
    path: str | Path, out: Path, tokenizer: Tokenizer, flag: str = "--data"
) -> None:
    """Tokenize a JSON lines file once into the token file ``out`` and its document starts
    beside it, each written whole or not at all; the starts are written last, so their file
    says that both are complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    ids_tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    starts_tmp = out.with_name(f".{out.stem}.starts.{os.getpid()}.tmp.npy")
    lengths: list[np.ndarray] = []
    try:
        with open(ids_tmp, "wb") as file:
            for ids, sizes in document_chunks(path, tokenizer, flag):
                file.write(ids.tobytes())
                lengths.append(sizes)
            file.flush()
            os.fsync(file.fileno())
        if not lengths:
            raise ValueError(f"{flag} {path} holds no documents (no line with a text field)")
        starts = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
        np.save(starts_tmp, starts)
        os.replace(ids_tmp, out)
        os.replace(starts_tmp, starts_path(out))
    finally:
        ids_tmp.unlink(missing_ok=True)
        starts_tmp.unlink(missing_ok=True)


def open_documents(out: Path, tokenizer: Tokenizer) -> Documents:
    """The documents ``prepare_documents`` wrote, memory-mapped; ValueError naming the
    files if they are not what it writes (damaged, or edited by someone else)."""
    dtype = np.dtype(token_dtype_for(tokenizer.vocab_size))
    starts_file = starts_path(out)
    damaged = (
        f"{out} and {starts_file.name}: not the token ids and document starts gpipe "
        "prepared; delete them to prepare them again"
    )
    try:
        ids = np.memmap(out, dtype=dtype, mode="r")
        starts = np.load(starts_file, allow_pickle=False)
    except (ValueError, OSError):  # numpy's own words would advise unpickling the file
        raise ValueError(damaged) from None
    whole = starts.ndim == 1 and starts.dtype == np.int64 and len(starts) >= 1
    if not whole or starts[0] != 0 or starts[-1] != len(ids) or (np.diff(starts) < 0).any():
        raise ValueError(damaged)
    return Documents(ids, starts)


class DocumentSampler:
    """Each step's documents, to be packed: in a seeded random order, each document once per
    epoch, until the step holds ``tokens_per_step`` tokens.

    A document longer than ``max_len`` comes in pieces of ``max_len`` that overlap by one
    token, so that every token but a document's last is still predicted once; documents of
    one token (nothing to predict) are skipped. The state is the epoch, the place in it and
    the place in a document cut into pieces: ``state_dict`` is all a resumed run needs to
    draw exactly what the interrupted one would have."""

    def __init__(
        self, documents: Documents, tokens_per_step: int, max_len: int, *, seed: int = 0
    ) -> None:
        if max_len < 2:
            raise ValueError(f"DocumentSampler: max_len must be at least 2, got {max_len}")
        lengths = np.diff(documents.starts)
        if not (lengths >= 2).any():
            raise ValueError("DocumentSampler: every document has fewer than 2 tokens")
        self.documents = documents
        self.tokens = tokens_per_step
        self.max_len = max_len
        self.seed = seed
        self.epoch = self.position = self.offset = self.step = 0
        self._order: tuple[int, torch.Tensor] | None = None

    def _order_of(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = epoch, torch.randperm(len(self.documents), generator=generator)
        return self._order[1]

    def _piece(self) -> np.ndarray:
        """The next piece of the current document, moving on past it when it is done."""
        while True:
            if self.position >= len(self.documents):  # past the end: of fewer documents
                self.epoch, self.position, self.offset = self.epoch + 1, 0, 0
            index = int(self._order_of(self.epoch)[self.position])
            begin, end = (int(v) for v in self.documents.starts[index : index + 2])
            start = begin + self.offset
            stop = min(end, start + self.max_len)
            if stop == end:
                self.position, self.offset = self.position + 1, 0
            else:
                self.offset += self.max_len - 1
            if stop - start >= 2:
                return np.asarray(self.documents.ids[start:stop], dtype=np.int64)

    def next(self) -> list[np.ndarray]:
        """The next step's pieces of documents, ``tokens_per_step`` tokens or a piece more."""
        pieces, total = [], 0
        while total < self.tokens:
            piece = self._piece()
            pieces.append(piece)
            total += len(piece)
        self.step += 1
        return pieces

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "offset": self.offset,
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"epoch", "position", "offset", "step"} - set(state)
        if missing:
            raise ValueError(
                f"DocumentSampler.load_state_dict: state lacks {sorted(missing)}; expected "
                "what state_dict() returns (was this checkpoint written without --pack?)"
            )
        for key in ("epoch", "position", "offset", "step"):
            value = int(state[key])
            if value < 0:
                raise ValueError(
                    f"DocumentSampler.load_state_dict: {key} must not be negative, got {value}"
                )
            setattr(self, key, value)
