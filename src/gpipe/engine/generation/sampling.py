"""The next token of each sequence, chosen on the last stage: greedy, or drawn with a
generator of the sequence's own.

Each sequence draws from a generator seeded by (seed, its prompt's index), one uniform
number per token, so a seed gives the same tokens however the sequences are grouped, how
many are in flight and over how many stages the model runs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gpipe.engine.generation.scheduler import Task
from gpipe.engine.logprobs import logits_of

__all__ = ["Sampler", "Sampling", "filtered_logits", "picked"]


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: ``temperature`` 0 is greedy (``top_k`` and ``top_p`` unused);
    otherwise logits are divided by it, cut to the ``top_k`` largest and to the smallest set
    whose probability reaches ``top_p``, and a token is drawn."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_logits(logits: Tensor, top_k: int | None, top_p: float | None) -> Tensor:
    """``logits`` (one row, ``[vocab]``) with what ``top_k`` and ``top_p`` leave out at -inf."""
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        probs, order = torch.softmax(logits, dim=-1).sort(descending=True)
        before = probs.cumsum(0) - probs  # the probability of the tokens ahead of each
        cut = order[before >= top_p]  # the most likely token always stays
        logits = logits.clone()
        logits[cut] = -math.inf
    return logits


def _seed_of(seed: int, sequence: int) -> int:
    """A 63-bit seed for one sequence, the same in every process."""
    digest = hashlib.blake2b(f"{seed}:{sequence}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Sampler:
    """Picks the next token of each row of a forward's last logits, as ``sampling`` says."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self._generators: dict[int, torch.Generator] = {}

    def pick(self, logits: Tensor, sequences: Sequence[int]) -> list[int]:
        """The next token of each sequence from its row of ``logits`` (``[rows, vocab]``)."""
        if self.sampling.greedy:
            return [int(t) for t in logits.argmax(dim=-1).tolist()]
        logits = logits.detach().to("cpu", torch.float64)
        # from the largest, so that a tiny temperature sends the others to -inf, not all to inf
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / self.sampling.temperature
        return [self._draw(scaled[row], seq) for row, seq in enumerate(sequences)]

    def _draw(self, logits: Tensor, sequence: int) -> int:
        s = self.sampling
        probs = torch.softmax(filtered_logits(logits, s.top_k, s.top_p), dim=-1)
        generator = self._generators.get(sequence)
        if generator is None:
            generator = torch.Generator().manual_seed(_seed_of(s.seed, sequence))
            self._generators[sequence] = generator
        u = torch.rand((), generator=generator, dtype=torch.float64)
        cdf = probs.cumsum(0)
        index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
        return min(index, probs.numel() - 1)


def picked(
    sampler: Sampler, task: Task, decoded: Any, filled: Sequence[Any]
) -> tuple[list[int], list[int]]:
    """The sequences that get a token from ``task``'s outputs on the last stage (its rows,
    then the prompts whose prefill ended) and those tokens."""
    sequences: list[int] = []
    tokens: list[int] = []
    if decoded is not None:
        sequences += task.rows
        tokens += sampler.pick(logits_of(decoded)[:, -1], task.rows)
    for piece, out in zip(task.pieces, filled, strict=True):
        if piece.last:
            sequences.append(piece.sequence)
            tokens += sampler.pick(logits_of(out)[:, -1], [piece.sequence])
    return sequences, tokens
