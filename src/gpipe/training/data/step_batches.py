"""What each step of a training run feeds the pipeline: random windows of the token stream,
or with ``--pack``, whole documents packed into micro-batches of near-equal tokens.

Every rank of a replica draws the same batches from the same seeded sampler; the first stage
reads the inputs and the last the targets. Replicas take their own rows of the windows, or
their own micro-batches of the packed ones."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from gpipe.data.packing import counts_of, pack
from gpipe.data.text import BatchSampler
from gpipe.parallel.replicas import shard
from gpipe.pipeline import Pipeline
from gpipe.runtime.microbatch import split_sizes
from gpipe.training.data.documents import Documents, DocumentSampler
from gpipe.training.data.tokens import TokenDataset

__all__ = ["PackedBatches", "StepBatch", "WindowBatches", "packed_inputs"]


@dataclass(frozen=True)
class StepBatch:
    """One step's data: the arguments ``Pipeline.step``/``evaluate`` take for it, the tokens
    of the whole step (every replica's, padding left out) and its micro-batches."""

    args: dict[str, Any]
    tokens: int
    microbatches: int


def packed_inputs(inputs: dict[str, Any]) -> dict[str, Tensor]:
    """What a model reads of a packed micro-batch: its ids and the positions that restart
    with every document, from which the models build their document masks."""
    return {"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"]}


class WindowBatches:
    """Rows of ``seq_len`` tokens at random places in the token stream (the default)."""

    def __init__(
        self,
        dataset: TokenDataset,
        batch_size: int,
        seq_len: int,
        chunks: int,
        *,
        seed: int,
        replica: int,
        replicas: int,
    ) -> None:
        self.dataset, self.batch_size, self.seq_len = dataset, batch_size, seq_len
        self.chunks, self.replica, self.replicas = chunks, replica, replicas
        self.sampler = BatchSampler(dataset.train, batch_size, seq_len, seed=seed)

    def _mine(self, batch: Tensor) -> Tensor:
        """This replica's rows of a global mini-batch."""
        return shard(batch, self.replica, self.replicas) if self.replicas > 1 else batch

    def _batch(self, sampler: BatchSampler, pipe: Pipeline) -> StepBatch:
        x, y = sampler.next()  # the global mini-batch, the same on every rank
        x, y = self._mine(x), self._mine(y)
        args = {"inputs": x if pipe.is_first else None, "targets": y if pipe.is_last else None}
        m = len(split_sizes(len(x), self.chunks))
        return StepBatch(args, self.batch_size * self.seq_len, m)

    def next(self, pipe: Pipeline) -> StepBatch:
        return self._batch(self.sampler, pipe)

    def validation(self, pipe: Pipeline, batches: int, seed: int) -> Iterator[StepBatch]:
        """The first ``batches`` batches of the held-out part, the same at every evaluation."""
        val = BatchSampler(self.dataset.val, self.batch_size, self.seq_len, seed=seed)
        for _ in range(batches):
            yield self._batch(val, pipe)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class PackedBatches:
    """Each step's documents (``batch_size x seq_len`` tokens of them, in pieces of at most
    ``seq_len``) packed by ``gpipe.data.pack`` into ``chunks`` micro-batches per replica of
    near-equal tokens; the loss is a mean over every target token of the step, exactly,
    through ``counts``."""

    def __init__(
        self,
        train: Documents,
        val: Documents,
        batch_size: int,
        seq_len: int,
        chunks: int,
        *,
        seed: int,
        replica: int,
        replicas: int,
    ) -> None:
        self.val, self.tokens, self.seq_len = val, batch_size * seq_len, seq_len
        self.chunks, self.replica, self.replicas = chunks, replica, replicas
        self.sampler = DocumentSampler(train, self.tokens, seq_len, seed=seed)

    def _batch(self, pieces: list[Any]) -> StepBatch:
        everyone = pack(pieces, self.seq_len, self.chunks * self.replicas)
        start = self.replica * self.chunks
        mine = [(packed_inputs(x), y) for x, y in everyone[start : start + self.chunks]]
        args = {"microbatches": mine, "counts": counts_of(mine)}
        return StepBatch(args, sum(len(p) for p in pieces), self.chunks)

    def next(self, pipe: Pipeline) -> StepBatch:
        return self._batch(self.sampler.next())

    def validation(self, pipe: Pipeline, batches: int, seed: int) -> Iterator[StepBatch]:
        """The first ``batches`` steps' worth of held-out documents, the same every time."""
        val = DocumentSampler(self.val, self.tokens, self.seq_len, seed=seed)
        for _ in range(batches):
            yield self._batch(val.next())

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
