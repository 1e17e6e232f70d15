"""The training text of a run, and the check that every rank reads the same."""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from gpipe.data.text import load_text, stdlib_corpus
from gpipe.errors import StageError
from gpipe.pipeline import Pipeline

__all__ = ["check_same_everywhere", "check_same_text", "load_corpus"]


def load_corpus(path: str | None) -> bytes:
    """The text at ``path``, or this Python's standard library's source without one."""
    return stdlib_corpus() if path is None else load_text(path)


def check_same_text(corpus: bytes, pipe: Pipeline) -> None:
    """Inputs come from the first stage's copy of the text and targets from the last's: on
    several machines, make sure every copy is the same."""
    check_same_everywhere(
        hashlib.sha256(corpus).hexdigest(),
        pipe,
        "reads different training text than stage 0 (another Python's standard library?); "
        "pass --data with the same text on every machine",
    )


def check_same_everywhere(digest: str, pipe: Pipeline, problem: str) -> None:
    """Raise ``problem`` as the error of the first stage whose ``digest`` differs from stage
    0's; collective over the world."""
    if dist.get_world_size() == 1:
        return
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    replicas = pipe.replicas.data_parallel if pipe.replicas is not None else 1
    for rank, found in enumerate(digests):
        if found != digests[0]:
            raise StageError(rank // replicas, problem)  # rank = position x D + replica
