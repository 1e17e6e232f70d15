"""A run's data as every rank reads it: token files memory-mapped where they are, text
through a tokenizer tokenized once into the run folder before the processes start, and the
check that every rank reads the same."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from gpipe.errors import StageError
from gpipe.pipeline import Pipeline
from gpipe.training.data.documents import (
    Documents,
    open_documents,
    prepare_documents,
    read_documents,
)
from gpipe.training.data.tokenizer import load_tokenizer
from gpipe.training.data.tokens import (
    TokenDataset,
    fingerprint,
    needs_preparing,
    open_dataset,
    prepare_tokens,
    token_dtype_for,
)
from gpipe.training.options import TrainOptions

__all__ = [
    "check_same_data",
    "check_same_everywhere",
    "checked_documents",
    "data_prepared",
    "prepare_run_data",
    "run_dataset",
    "run_documents",
]

TOKENS = "tokens"  # the run folder's subfolder of tokenized text
VAL_FRACTION = 0.1  # of --data held out for validation when there is no --val-data


def _parts(opts: TrainOptions) -> list[tuple[str, str | None, str]]:
    """Each part of the run's data: its name in ``tokens/``, where it comes from, its flag."""
    parts = [("train", opts.data, "--data")]
    if opts.val_data is not None:
        parts.append(("val", opts.val_data, "--val-data"))
    return parts


def _targets(opts: TrainOptions, out: Path) -> dict[str, Path]:
    """Where each part that a tokenizer turns into ids lies once tokenized, by name (token
    files are read as they are)."""
    return {
        name: out / TOKENS / f"{name}.bin"
        for name, source, _ in _parts(opts)
        if needs_preparing(source, opts.tokenizer)
    }


def _files(root: Path) -> list[Path]:
    """``root`` if it is a file, else the files under it as ``load_text`` reads them: hidden
    files and folders left out."""
    if root.is_file():
        return [root]
    found = (p for p in root.rglob("*") if p.is_file())
    return sorted(p for p in found if not any(n.startswith(".") for n in p.relative_to(root).parts))


def _stamp(path: str | Path | None) -> list[Any]:
    """What a source is, as far as its tokens go: each file's path, size and modification
    time (this Python's standard library when None)."""
    if path is None:
        return ["stdlib", sysconfig.get_paths()["stdlib"]]
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in _files(Path(path))]


def _origin(opts: TrainOptions, source: str | None) -> dict[str, Any]:
    """What a part's prepared tokens were made from: the source, the tokenizer, packing."""
    return {"source": _stamp(source), "tokenizer": _stamp(opts.tokenizer), "pack": opts.pack}


def _origin_path(target: Path) -> Path:
    return target.with_name(target.stem + ".origin.json")


def _is_current(opts: TrainOptions, target: Path, source: str | None) -> bool:
    """Whether ``target`` holds the tokens of ``source`` as it is now, whole: its origin file,
    written last, says so."""
    try:
        return bool(json.loads(_origin_path(target).read_text()) == _origin(opts, source))
    except (OSError, ValueError):
        return False


def data_prepared(opts: TrainOptions, out: Path) -> bool:
    """Whether the run folder holds the tokenized text it needs, of the data as it is now
    (whole: a start that was interrupted while tokenizing left none; current: a run resumed
    with another ``--data`` or ``--tokenizer`` tokenizes it anew)."""
    targets = _targets(opts, out)
    return all(
        _is_current(opts, targets[name], source)
        for name, source, _ in _parts(opts)
        if name in targets
    )


def prepare_run_data(opts: TrainOptions, out: Path) -> None:
    """Tokenize text data once into the run folder, unless it already holds the tokens of
    the data as it is now (each file is written whole or not at all, the origin file last)."""
    targets = _targets(opts, out)
    if not targets:
        return
    tokenizer = load_tokenizer(opts.tokenizer)
    for name, source, flag in _parts(opts):
        target = targets.get(name)
        if target is None or _is_current(opts, target, source):
            continue
        _origin_path(target).unlink(missing_ok=True)
        if opts.pack:  # the ids and where each document begins
            prepare_documents(str(source), target, tokenizer, flag)
        else:
            prepare_tokens(source, target, tokenizer, flag=flag)
        temporary = target.with_name(f".{target.stem}.origin.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(_origin(opts, source)))
        os.replace(temporary, _origin_path(target))


def run_dataset(opts: TrainOptions, out: Path) -> TokenDataset:
    """The training and validation ids of the run in ``out``: its tokenized text where it
    has some, else ``--data`` and ``--val-data`` as they are (memory-mapped token files, or
    bytes)."""
    targets = _targets(opts, out)
    if not targets:
        return open_dataset(
            opts.data,
            val_data=opts.val_data,
            tokenizer=opts.tokenizer,
            token_dtype=opts.token_dtype,
        )
    train, val = targets.get("train"), targets.get("val")
    dtype = token_dtype_for(load_tokenizer(opts.tokenizer).vocab_size)
    return open_dataset(
        train or opts.data,
        val_data=val or opts.val_data,
        token_dtype=dtype if train else opts.token_dtype,
        val_token_dtype=dtype if val else opts.token_dtype,
    )


def run_documents(opts: TrainOptions, out: Path) -> tuple[TokenDataset, Documents, Documents]:
    """The documents of a ``--pack`` run, for training and validation (the last tenth of
    ``--data``'s documents unless ``--val-data``), and all their ids as a ``TokenDataset``
    for the checks every run's data gets."""
    targets = _targets(opts, out)
    if not targets:
        tokenizer = load_tokenizer(opts.tokenizer) if opts.tokenizer else None
        whole = read_documents(str(opts.data), tokenizer)
        bound = tokenizer.vocab_size if tokenizer else 256
        if opts.val_data is None:
            train, val = whole.split(VAL_FRACTION)
        else:
            train, val = whole, read_documents(opts.val_data, tokenizer, "--val-data")
    else:  # under --pack every part is JSON lines: prepared alike
        tokenizer = load_tokenizer(opts.tokenizer)
        bound = tokenizer.vocab_size
        whole = open_documents(targets["train"], tokenizer)
        if "val" not in targets:
            train, val = whole.split(VAL_FRACTION)
        else:
            train, val = whole, open_documents(targets["val"], tokenizer)
    what = (
        f"{Path(str(opts.data)).name}: {len(train):,} documents, {len(train.ids):,} ids for "
        f"training; {len(val):,} documents, {len(val.ids):,} ids held out"
    )
    source = f"--data {opts.data}"
    val_source = source if opts.val_data is None else f"--val-data {opts.val_data}"
    dataset = TokenDataset(train.ids, val.ids, bound, what, source, val_source)
    return dataset, train, val


def checked_documents(opts: TrainOptions, out: Path) -> TokenDataset:
    """``run_documents``' ids, once each part is known to hold a document with something to
    predict (two tokens or more): the check before any process starts."""
    dataset, train, val = run_documents(opts, out)
    for part, source, name in (
        (train, dataset.train_source, "training"),
        (val, dataset.val_source, "validation"),
    ):
        if not (np.diff(part.starts) >= 2).any():
            raise ValueError(
                f"{source}: its {name} part has no document of 2 tokens or more, so nothing "
                "to predict; give documents with text"
            )
    return dataset


def check_same_data(dataset: TokenDataset, pipe: Pipeline) -> None:
    """Inputs come from the first stage's copy of the data and targets from the last's: on
    several machines, make sure every copy is the same."""
    check_same_everywhere(
        fingerprint(dataset),
        pipe,
        "reads different training data than stage 0 (another Python's standard library, "
        "another copy of --data?); pass the same --data on every machine",
    )


def check_same_everywhere(digest: str, pipe: Pipeline, problem: str) -> None:
    """Raise ``problem`` as the error of the first stage whose ``digest`` differs from stage
    0's; collective over the world."""
    if dist.get_world_size() == 1:
        return
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    per_position = dist.get_world_size() // pipe.n_ranks  # a stage's replicas and tensor ranks
    for rank, found in enumerate(digests):
        if found != digests[0]:
            raise StageError(rank // per_position, problem)  # rank = position x D x T + ...
