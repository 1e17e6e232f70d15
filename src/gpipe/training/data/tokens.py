"""Training data of any size: token files memory-mapped, text and JSON lines as bytes or through
a tokenizer, split into a training and a validation part, and checked before a run starts."""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from gpipe.data.text import load_text, stdlib_corpus
from gpipe.training.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "TokenDataset",
    "Prepared",
    "open_dataset",
    "read_tokens",
    "prepare_tokens",
    "document_chunks",
    "needs_preparing",
    "token_dtype_for",
    "check_sources",
    "check_vocabulary",
    "check_windows",
    "fingerprint",
]

TOKEN_DTYPES = ("uint16", "uint32")
_SCAN = 4_000_000  # ids per chunk when scanning a token file for its largest id
_MIB = 1 << 20
_PIECE = _MIB  # characters of text tokenized at a time (cut at a line end)
_BATCH = 1024  # texts handed to the tokenizer at a time
_SNIFF = 8192  # bytes read to tell text from an unknown binary format
_FIRST_LINE = 16 * _MIB  # bytes of a .json file's first line read to tell JSON lines


@dataclass(frozen=True)
class TokenDataset:
    """A corpus as two 1-D integer arrays of token ids: ``train`` and ``val``.

    For a token file both are views of its memory map (``np.memmap``), so nothing is read
    until a batch needs it.
    """

    train: np.ndarray
    val: np.ndarray
    vocab_bound: int | None
    """Every id is known to be below this (256 for bytes, the tokenizer's vocabulary for text
    it tokenized), or None for a token file: ``check_vocabulary`` scans it."""
    description: str
    """What was read, for messages and the run's log."""
    train_source: str = "--data"
    val_source: str = "--data"
    """The flag and path each part came from, named by errors."""


class Prepared(NamedTuple):
    """A token file ``prepare_tokens`` wrote, and the ``token_dtype`` to read it with."""

    path: Path
    token_dtype: str


def _flag_path(flag: str, path: str | Path | None) -> str:
    return f"{flag} {path}" if path is not None else "the built-in corpus"


def _check_dtype(token_dtype: str) -> np.dtype:
    if token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"--token-dtype must be uint16 or uint32, got {token_dtype!r}")
    return np.dtype(token_dtype)


def token_dtype_for(vocab_size: int) -> str:
    """The smaller token file dtype that holds every id below ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _kind(path: str | Path | None, flag: str) -> str:
    """``"tokens"``, ``"jsonl"`` or ``"text"``; an unknown binary format is an error."""
    if path is None:
        return "text"
    where = Path(path)
    if not where.exists():
        raise ValueError(f"{flag} {path} does not exist")
    if where.is_dir():
        return "text"
    if where.stat().st_size == 0:
        raise ValueError(f"{flag} {path} is empty (0 bytes); expected token ids or text")
    suffix = where.suffix.lower()
    if suffix in (".bin", ".npy"):
        return "tokens"
    if suffix == ".jsonl":
        return "jsonl"
    if suffix in (".json", ".ndjson") and _is_json_lines(where):
        raise ValueError(
            f"{flag} {path} holds JSON lines (its first lines are JSON objects), which a "
            f"{suffix} file would train on as text, JSON syntax and all; name it .jsonl to "
            "train on each line's text field"
        )
    with open(where, "rb") as file:
        head = file.read(_SNIFF)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        head = b"\0"
    if b"\0" in head:
        raise ValueError(
            f"{flag} {path}: unknown file extension {suffix or '(none)'!r} and not UTF-8 text; "
            "expected a token file (.bin of uint16/uint32 ids, .npy), JSON lines (.jsonl) "
            "or text"
        )
    return "text"


def _is_json_lines(path: Path) -> bool:
    """Whether a file's first two lines are whole JSON objects, as ``datasets``' ``to_json``
    writes a line per record, even to a ``.json`` file (a line longer than 16 MiB is not
    read whole, and not taken for one). One line alone is a JSON document, minified."""
    with open(path, "rb") as file:
        first = file.readline(_FIRST_LINE).removeprefix(codecs.BOM_UTF8)
        second = file.readline(_FIRST_LINE)
    try:
        return all(isinstance(json.loads(line), dict) for line in (first, second))
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, an empty line: not JSON lines
        return False


def check_sources(data: str | Path | None, val_data: str | Path | None, token_dtype: str) -> None:
    """Refuse what would be silently ignored or would mislead: a ``token_dtype`` other than
    the default where neither part is a ``.bin`` token file (the only one it is read for),
    and ``val_data`` that is ``data`` itself (the validation loss would be a training loss)."""
    if token_dtype != TOKEN_DTYPES[0] and not any(
        path is not None and Path(path).suffix.lower() == ".bin" for path in (data, val_data)
    ):
        given = _flag_path("--data", data)
        raise ValueError(
            f"--token-dtype {token_dtype} says how to read a .bin token file, but {given} is "
            "not one (nor --val-data); leave it out: text is bytes or a tokenizer's ids, and "
            "a .npy file holds its own dtype"
        )
    if (
        data is not None
        and val_data is not None
        and Path(data).resolve() == Path(val_data).resolve()
    ):
        raise ValueError(
            f"--val-data {val_data} is --data itself, so the validation loss would be "
            "measured on the training data; give held-out data, or leave --val-data out to "
            "hold out the last tenth of --data"
        )


def _read_bin(path: Path, token_dtype: str, flag: str) -> np.ndarray:
    dtype = _check_dtype(token_dtype)
    size = path.stat().st_size
    if size % dtype.itemsize:
        other = np.dtype("uint32" if dtype == np.uint16 else "uint16")
        hint = (
            f"; as {other} it would be {size // other.itemsize} ids (--token-dtype {other})"
            if size % other.itemsize == 0
            else ""
        )
        raise ValueError(
            f"{flag} {path}: its size, {size} bytes, is not a whole number of {dtype} token "
            f"ids ({dtype.itemsize} bytes each){hint}"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def _read_npy(path: Path, flag: str) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{flag} {path}: not a .npy array numpy can map ({exc})") from None
    if array.dtype.kind not in "iu":
        raise ValueError(f"{flag} {path}: holds {array.dtype} values; expected integer token ids")
    if not array.flags.c_contiguous:
        raise ValueError(f"{flag} {path}: a Fortran-ordered array; save it in C order")
    if array.size == 0:
        raise ValueError(f"{flag} {path} is empty (an array of shape {array.shape})")
    return array.reshape(-1)


def _pieces(text: str) -> Iterator[str]:
    """``text`` in pieces of about ``_PIECE`` characters, each cut just after a line end, so
    a long text is tokenized a piece at a time and no token spans two pieces mid-line."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + _PIECE)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def _documents(path: Path, flag: str) -> Iterator[str]:
    """The ``text`` field of each line of a JSON lines file, read a line at a time (a UTF-8
    byte order mark at its start, as some editors write, is skipped)."""
    with open(path, "rb") as file:
        for number, raw in enumerate(file, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{flag} {path}: line {number} is not UTF-8 (byte {raw[exc.start]:#04x} at "
                    f"column {exc.start + 1}); JSON lines must be UTF-8 text"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{flag} {path}: line {number} is not JSON ({exc})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                found = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f'{flag} {path}: line {number} has no "text" field holding a string '
                    f"(found {found}); expected one JSON object per line with a text field"
                )
            yield text


def _batches(texts: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def document_chunks(
    path: str | Path, tokenizer: Tokenizer, flag: str = "--data"
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The token ids of a JSON lines file's documents, a chunk of documents at a time, with
    each document's length: its ids followed by the tokenizer's end-of-text id, or a newline's
    ids if it has none."""
    dtype = token_dtype_for(tokenizer.vocab_size)
    end = [tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode("\n")
    for batch in _batches(_documents(Path(str(path)), flag)):
        encoded = [[*ids, *end] for ids in tokenizer.encode_batch(batch)]
        ids = [i for document in encoded for i in document]
        yield np.asarray(ids, dtype=dtype), np.asarray([len(d) for d in encoded], dtype=np.int64)


def _token_chunks(
    path: str | Path | None, kind: str, tokenizer: Tokenizer, flag: str
) -> Iterator[np.ndarray]:
    """The token ids of a text or JSON lines source, a chunk at a time (JSON lines as
    ``document_chunks`` gives them)."""
    if kind == "jsonl":
        yield from (ids for ids, _ in document_chunks(str(path), tokenizer, flag))
        return
    dtype = token_dtype_for(tokenizer.vocab_size)
    text = stdlib_corpus() if path is None else load_text(path, flag=flag)
    for batch in _batches(_pieces(text.decode("utf-8", errors="replace"))):
        ids = [i for encoded in tokenizer.encode_batch(batch) for i in encoded]
        yield np.asarray(ids, dtype=dtype)


def _is_bytes(tokenizer: Tokenizer | None) -> bool:
    return tokenizer is None or isinstance(tokenizer, ByteTokenizer)


def read_tokens(
    path: str | Path | None,
    *,
    tokenizer: Tokenizer | str | Path | None = None,
    token_dtype: str = "uint16",
    flag: str = "--data",
) -> tuple[np.ndarray, int | None]:
    """The token ids of one source, and the bound its ids are known to lie below (None for a
    token file). A token file is memory-mapped; text is bytes without a tokenizer."""
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    kind = _kind(path, flag)
    if kind == "tokens":
        where = Path(str(path))
        if where.suffix.lower() == ".npy":
            return _read_npy(where, flag), None
        return _read_bin(where, token_dtype, flag), None
    if kind == "text" and _is_bytes(tok):
        text = stdlib_corpus() if path is None else load_text(path, flag=flag)
        return np.frombuffer(text, dtype=np.uint8), 256
    tok = tok if tok is not None else ByteTokenizer()
    chunks = list(_token_chunks(path, kind, tok, flag))
    ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)
    if len(ids) == 0:
        raise ValueError(f"{_flag_path(flag, path)} holds no text to tokenize")
    return ids, tok.vocab_size


def open_dataset(
    data: str | Path | None,
    *,
    val_data: str | Path | None = None,
    tokenizer: Tokenizer | str | Path | None = None,
    token_dtype: str = "uint16",
    val_fraction: float = 0.1,
    val_token_dtype: str | None = None,
) -> TokenDataset:
    """The training and validation token ids of ``gpipe train --data``.

    ``data`` is a token file (``.bin`` of ``token_dtype`` ids, ``.npy``), JSON lines
    (``.jsonl``, a ``text`` field per line), or a text file or folder; None is this Python's
    standard library. Text is bytes (vocabulary 256) without a ``tokenizer``. The last
    ``val_fraction`` of it is the validation part, unless ``val_data`` gives that separately
    (in any of the same forms; a ``.bin`` of ``val_token_dtype`` ids, if given).
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    _check_dtype(token_dtype)
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    ids, bound = read_tokens(data, tokenizer=tok, token_dtype=token_dtype)
    source = _flag_path("--data", data)
    what = f"{Path(str(data)).name if data else 'the standard library'}: {len(ids):,} ids"
    if val_data is None:
        cut = len(ids) - int(len(ids) * val_fraction)
        train, val, val_source = ids[:cut], ids[cut:], source
        what += f" ({ids.dtype}), the last {len(val):,} held out"
    else:
        val, val_bound = read_tokens(
            val_data, tokenizer=tok, token_dtype=val_token_dtype or token_dtype, flag="--val-data"
        )
        train, val_source = ids, _flag_path("--val-data", val_data)
        bound = None if bound is None or val_bound is None else max(bound, val_bound)
        what += f" ({ids.dtype}); validation {Path(str(val_data)).name}: {len(val):,} ids"
    return TokenDataset(train, val, bound, what, source, val_source)


def needs_preparing(data: str | Path | None, tokenizer: Tokenizer | str | Path | None) -> bool:
    """Whether ``data`` is text or JSON lines that a real tokenizer must turn into ids: then
    ``prepare_tokens`` once, before the processes start, spares every rank the work."""
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        return False
    return _kind(data, "--data") != "tokens"


def prepare_tokens(
    data: str | Path | None,
    out: str | Path,
    tokenizer: Tokenizer | str | Path,
    *,
    flag: str = "--data",
) -> Prepared:
    """Tokenize a text or JSON lines source once into the token file ``out`` (uint16 ids if
    the tokenizer's vocabulary fits, else uint32), written whole or not at all: a temporary
    file beside it, renamed into place."""
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    kind = _kind(data, flag)
    if kind == "tokens":
        raise ValueError(f"{flag} {data} is already a token file; read it with open_dataset")
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    written = 0
    try:
        with open(temporary, "wb") as file:
            for chunk in _token_chunks(data, kind, tok, flag):
                file.write(chunk.tobytes())
                written += len(chunk)
            file.flush()
            os.fsync(file.fileno())
        if written == 0:
            raise ValueError(f"{_flag_path(flag, data)} holds no text to tokenize")
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return Prepared(target, token_dtype_for(tok.vocab_size))


def _extremes(part: np.ndarray) -> tuple[int, int, int, int]:
    """(smallest id, its index, largest id, its index) of ``part``, a chunk at a time."""
    low = high = int(part[0])
    at_low = at_high = 0
    for start in range(0, len(part), _SCAN):
        chunk = np.asarray(part[start : start + _SCAN])
        i, j = int(chunk.argmin()), int(chunk.argmax())
        if chunk[i] < low:
            low, at_low = int(chunk[i]), start + i
        if chunk[j] > high:
            high, at_high = int(chunk[j]), start + j
    return low, at_low, high, at_high


def check_vocabulary(dataset: TokenDataset, vocab_size: int) -> None:
    """Refuse token ids the model's embedding has no row for: a token file is scanned (a few
    million ids at a time, never whole), unless its ids are already known to fit."""
    if dataset.vocab_bound is not None and dataset.vocab_bound <= vocab_size:
        return
    parts = [(dataset.train, dataset.train_source, "training")]
    parts.append((dataset.val, dataset.val_source, "validation"))
    for part, source, name in parts:
        low, at_low, high, at_high = _extremes(part)
        if low < 0:
            raise ValueError(
                f"{source}: its {name} part holds a negative token id, {low} (at index "
                f"{at_low}); expected ids in 0 to {vocab_size - 1}"
            )
        if high >= vocab_size:
            raise ValueError(
                f"{source}: its {name} part holds token id {high} (at index {at_high}), beyond "
                f"the model's vocabulary of {vocab_size} (ids 0 to {vocab_size - 1}); use "
                "the model's own tokenizer, a larger vocab_size, or check --token-dtype"
            )


def check_windows(dataset: TokenDataset, seq_len: int) -> None:
    """Refuse a part too short for one window of ``seq_len`` inputs and its next target."""
    for part, source, name in (
        (dataset.train, dataset.train_source, "training"),
        (dataset.val, dataset.val_source, "validation"),
    ):
        if len(part) < seq_len + 1:
            raise ValueError(
                f"{source}: its {name} part has {len(part)} tokens, fewer than one window of "
                f"--seq-len {seq_len} + 1; give more data or a shorter --seq-len"
            )


def fingerprint(dataset: TokenDataset) -> str:
    """A digest of the dataset that tells whether two ranks read the same: the whole of data
    held in memory; of a memory-mapped part, its size and its first and last MiB."""
    digest = hashlib.sha256()
    for part in (dataset.train, dataset.val):
        digest.update(f"{part.dtype.str}:{len(part)};".encode())
        if isinstance(part, np.memmap):
            edge = _MIB // part.dtype.itemsize
            digest.update(np.asarray(part[:edge]).tobytes())
            digest.update(np.asarray(part[-edge:]).tobytes())
        else:
            digest.update(np.ascontiguousarray(part).tobytes())
    return digest.hexdigest()
