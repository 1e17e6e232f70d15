"""A run's data as every rank reads it: token files memory-mapped where they are, text
through a tokenizer tokenized once into the run folder before the processes start, and the
check that every rank reads the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch.distributed as dist

from gpipe.errors import StageError
from gpipe.pipeline import Pipeline
from gpipe.training.data.documents import (
    Documents,
    open_documents,
    prepare_documents,
    read_documents,
    starts_path,
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


def _prepared(opts: TrainOptions, out: Path) -> tuple[Path, Path | None] | None:
    """Where the tokenized text of this run lies (training, validation), if it has any."""
    if not needs_preparing(opts.data, opts.tokenizer):
        return None
    val = out / TOKENS / "val.bin" if opts.val_data is not None else None
    return out / TOKENS / "train.bin", val


def data_prepared(opts: TrainOptions, out: Path) -> bool:
    """Whether the run folder holds the tokenized text it needs (whole: a start that was
    interrupted while tokenizing left none)."""
    paths = _prepared(opts, out)
    if paths is None:
        return True
    return (starts_path(paths[0]) if opts.pack else paths[0]).is_file()


def prepare_run_data(opts: TrainOptions, out: Path) -> None:
    """Tokenize text data once into the run folder, unless an earlier start of this run
    already did (each file is written whole or not at all)."""
    paths = _prepared(opts, out)
    if paths is None:
        return
    tokenizer = load_tokenizer(opts.tokenizer)
    train, val = paths
    if opts.pack:  # the ids and where each document begins, the latter written last
        for source, flag, target in (("data", "--data", train), ("val_data", "--val-data", val)):
            if target is not None and not starts_path(target).is_file():
                prepare_documents(getattr(opts, source), target, tokenizer, flag)
        return
    if not train.is_file():
        prepare_tokens(opts.data, train, tokenizer)
    if val is not None and not val.is_file():
        prepare_tokens(opts.val_data, val, tokenizer, flag="--val-data")


def run_dataset(opts: TrainOptions, out: Path) -> TokenDataset:
    """The training and validation ids of the run in ``out``: its tokenized text if it has
    some, else ``--data`` as it is (memory-mapped token files, or bytes)."""
    paths = _prepared(opts, out)
    if paths is None:
        return open_dataset(
            opts.data,
            val_data=opts.val_data,
            tokenizer=opts.tokenizer,
            token_dtype=opts.token_dtype,
        )
    train, val = paths
    dtype = token_dtype_for(load_tokenizer(opts.tokenizer).vocab_size)
    return open_dataset(train, val_data=val, token_dtype=dtype)


def run_documents(opts: TrainOptions, out: Path) -> tuple[TokenDataset, Documents, Documents]:
    """The documents of a ``--pack`` run, for training and validation (the last tenth of
    ``--data``'s documents unless ``--val-data``), and all their ids as a ``TokenDataset``
    for the checks every run's data gets."""
    paths = _prepared(opts, out)
    if paths is None:
        tokenizer = load_tokenizer(opts.tokenizer) if opts.tokenizer else None
        whole = read_documents(str(opts.data), tokenizer)
        bound = tokenizer.vocab_size if tokenizer else 256
        if opts.val_data is None:
            train, val = whole.split(VAL_FRACTION)
        else:
            train, val = whole, read_documents(opts.val_data, tokenizer, "--val-data")
    else:
        tokenizer = load_tokenizer(opts.tokenizer)
        bound = tokenizer.vocab_size
        whole = open_documents(paths[0], tokenizer)
        if paths[1] is None:
            train, val = whole.split(VAL_FRACTION)
        else:
            train, val = whole, open_documents(paths[1], tokenizer)
    what = (
        f"{Path(str(opts.data)).name}: {len(train):,} documents, {len(train.ids):,} ids for "
        f"training; {len(val):,} documents, {len(val.ids):,} ids held out"
    )
    val_source = "--data" if opts.val_data is None else "--val-data"
    dataset = TokenDataset(train.ids, val.ids, bound, what, "--data", val_source)
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
