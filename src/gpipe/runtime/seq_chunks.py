"""Sequence-pipelined micro-batches (Seq1F1B) on a stage: cutting a micro-batch along its
sequence, and the keys and values one sub-sequence leaves for the next.

A stage runs sub-sequence j of a micro-batch through its layers' cached forward
(``gpipe.runtime.kv_cache``'s ``CachedLayer``, the protocol generation uses), with each
attention layer's cache holding the keys and values of sub-sequences 0..j-1. Those come in as
leaves of this unit's graph, so that its backward ends at them; their gradients go to
sub-sequence j-1's backward, which starts from its own keys and values with them. Each unit's
graph is thus its own, and the stage keeps a unit's activations, not a micro-batch's.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.comm.payload import tensors_of, with_tensors
from gpipe.runtime.kv_cache import CacheContext, CachedLayer
from gpipe.schedules.seq_chunked import SEQ_CHUNKED

__all__ = [
    "SEQ_SPLITS",
    "Carries",
    "SeqChunks",
    "check_seq_chunks",
    "check_seq_setup",
    "join_sequence",
    "observe",
    "run_cached",
    "seq_chunk_refusal",
    "sequence_length",
    "split_sequence",
]

SEQ_SPLITS = ("even", "balanced")

_observers: list[Callable[[Sequence[Tensor]], None]] = []


@contextlib.contextmanager
def observe(callback: Callable[[Sequence[Tensor]], None]) -> Iterator[None]:
    """Call ``callback`` with the tensors a sub-sequence's layers take and return, and with
    the keys and values it leaves the next one, inside the body (memory meters use it: the
    cached forward runs no module hooks, and the carried tensors are held by the stage)."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def _notify(tensors: Sequence[Tensor]) -> None:
    for callback in list(_observers):
        callback(tensors)


@dataclass(frozen=True)
class SeqChunks:
    """Cut every micro-batch into ``chunks`` sub-sequences: of equal length (``"even"``), or
    of equal cost (``"balanced"``: a later sub-sequence attends to more keys, so it gets fewer
    tokens; ``width`` is the model's, which sets how much attention weighs against the
    layers' matrix products)."""

    chunks: int
    split: str = "even"
    width: int | None = None

    def lengths(self, length: int) -> list[int]:
        """The sub-sequences' lengths for a sequence of ``length`` tokens; a sequence that
        cannot be cut so is refused."""
        s = self.chunks
        if length < s:  # whatever the split: seq_split='balanced' would not help
            raise ValueError(
                f"seq_chunks={s} cannot cut a sequence of {length} tokens: each sub-sequence "
                "needs at least one token"
            )
        if self.split == "even":
            if length % s:
                raise ValueError(
                    f"seq_chunks={s} does not divide the sequence of {length} tokens: give "
                    f"sequences whose length is a multiple of {s}, or seq_split='balanced'"
                )
            return [length // s] * s
        return _balanced(length, s, self.width or 1)

    def weights(self, length: int) -> list[float]:
        """Each sub-sequence's share of the micro-batch's tokens: its loss's weight."""
        return [n / length for n in self.lengths(length)]


def _balanced(length: int, chunks: int, width: int) -> list[int]:
    """Lengths of equal cost, a token at position p costing 12 x width (its matrix products,
    24 x width^2 operations, over 2 x width) plus 2p (its attention, 4 x width x p): the
    cost up to t is 12 x width x t + t^2."""

    total = 12 * width * length + length * length
    ends = []
    for j in range(1, chunks):
        t = -6 * width + math.sqrt(36 * width * width + total * j / chunks)
        ends.append(round(t))
    ends.append(length)
    lengths, start = [], 0
    for j, end in enumerate(ends):
        end = min(max(end, start + 1), length - (chunks - 1 - j))
        lengths.append(end - start)
        start = end
    return lengths


def check_seq_chunks(
    seq_chunks: object, seq_split: object, module: nn.Sequential
) -> SeqChunks | None:
    """``seq_chunks`` and ``seq_split`` checked, for the layers of ``module`` (None for one
    chunk: nothing is cut). Any integer is taken (a NumPy one, a 0-d tensor), as ``chunks``
    takes it."""
    chunks = _positive_chunks(seq_chunks)
    if seq_split not in SEQ_SPLITS:
        raise ValueError(f"seq_split must be one of {SEQ_SPLITS}, got {seq_split!r}")
    if chunks == 1:
        return None
    refusal = seq_chunk_refusal(module)
    if refusal is not None:
        raise ValueError(refusal)
    width = None
    if seq_split == "balanced":
        embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
        if embedding is None:
            raise ValueError(
                "seq_split='balanced' weighs attention against the layers by the model's "
                "width, read from its token embedding, and the model has no nn.Embedding"
            )
        width = embedding.embedding_dim
    return SeqChunks(chunks, str(seq_split), width)


def check_seq_setup(
    seq: SeqChunks | None,
    schedule: object,
    *,
    layers_policy: bool,
    skips: bool,
) -> None:
    """Refuse, in one line, a setting that sub-sequences do not run with."""
    if seq is None:
        return
    if not isinstance(schedule, str) or schedule not in SEQ_CHUNKED:
        name = schedule if isinstance(schedule, str) else "a fixed Schedule"
        raise ValueError(
            f"seq_chunks={seq.chunks} runs with the schedules {sorted(SEQ_CHUNKED)}, got {name!r}"
        )
    conflicts = {
        "checkpoint=Layers(...) (whole micro-batches are recomputed, or none)": layers_policy,
        "skip connections (gpipe.skip)": skips,
    }
    for what, present in conflicts.items():
        if present:
            raise ValueError(f"seq_chunks={seq.chunks} does not run with {what} yet")


def _positive_chunks(seq_chunks: object) -> int:
    """``seq_chunks`` as an ``int``: an integer of any kind (``operator.index``), not a bool,
    of at least 1; anything else is refused naming the value."""
    chunks = 0
    if not isinstance(seq_chunks, bool):
        with contextlib.suppress(TypeError):
            chunks = operator.index(seq_chunks)  # type: ignore[arg-type]
    if chunks < 1:
        raise ValueError(f"seq_chunks must be a positive integer, got {seq_chunks!r}")
    return chunks


def seq_chunk_refusal(module: nn.Sequential) -> str | None:
    """Why the layers of ``module`` cannot run sub-sequences; None if they can: each must be
    causal and carry keys and values (``CachedLayer``)."""
    for name, layer in module.named_children():
        if not isinstance(layer, CachedLayer):
            return (
                f"seq_chunks needs a causal model whose layers carry keys and values from one "
                f"sub-sequence to the next (new_cache and forward_cached), but layer {name!r} "
                f"is a {type(layer).__name__}, which does not: use the built-in GPT "
                "(gpipe.models.gpt) or a Hugging Face causal LM cut by its plan "
                "(gpipe.split(model, parts=K, plan='hf'))"
            )
        try:  # a model's refusal (a layer whose state is not keys and values) comes here
            layer.new_cache()
        except (RuntimeError, ValueError, TypeError) as exc:
            return f"seq_chunks: layer {name!r} cannot carry keys and values: {exc}"
    return None


def split_sequence(payload: Any, lengths: Sequence[int]) -> list[Any]:
    """``payload`` cut along its sequence (dimension 1 of every tensor) into ``lengths``."""
    tensors = tensors_of(payload)
    for t in tensors:
        if t.dim() < 2 or t.shape[1] != sum(lengths):
            raise ValueError(
                f"seq_chunks cuts every tensor of a micro-batch along dimension 1, the "
                f"sequence of {sum(lengths)} tokens; got a tensor of shape {list(t.shape)}"
            )
    pieces = [t.split(list(lengths), dim=1) for t in tensors]
    return [with_tensors(payload, [p[j] for p in pieces]) for j in range(len(lengths))]


def sequence_length(payload: Any) -> int:
    """The length of the sequence of a micro-batch's payload (dimension 1 of its tensors)."""
    tensors = tensors_of(payload)
    if not tensors or tensors[0].dim() < 2:
        shape = list(tensors[0].shape) if tensors else "no tensor"
        raise ValueError(
            "seq_chunks cuts micro-batches along dimension 1, their sequence; got a payload "
            f"whose first tensor has shape {shape}"
        )
    return int(tensors[0].shape[1])


def join_sequence(pieces: Sequence[Any]) -> Any:
    """A micro-batch's payload from its sub-sequences' (joined along dimension 1)."""
    columns = zip(*(tensors_of(p) for p in pieces), strict=True)
    return with_tensors(pieces[0], [torch.cat(list(ts), dim=1) for ts in columns])


class Carries:
    """What the sub-sequences of a stage's micro-batches hand each other: forward, the tokens
    so far and the keys and values (as leaves) for the next sub-sequence; backward, the
    gradients of those for the one before. Unit ``i * chunks + j`` is sub-sequence j of
    micro-batch i; a unit out of order is an error naming the stage."""

    def __init__(self, chunks: int, stage: int) -> None:
        self.chunks = chunks
        self.stage = stage
        self._forward: dict[int, tuple[int, list[Tensor]]] = {}
        self._backward: dict[int, list[Tensor | None]] = {}

    def take(self, unit: int) -> tuple[int, list[Tensor]]:
        """The tokens before ``unit`` and the keys and values it starts from."""
        microbatch, j = divmod(unit, self.chunks)
        if j == 0:
            return 0, []
        try:
            return self._forward.pop(microbatch)
        except KeyError:
            raise RuntimeError(
                f"stage {self.stage}: sub-sequence {j} of micro-batch {microbatch} ran before "
                f"sub-sequence {j - 1}: a micro-batch's sub-sequences run in order"
            ) from None

    def leave(
        self, unit: int, tokens: int, keys_values: list[Tensor], as_leaf: Callable[[Tensor], Tensor]
    ) -> None:
        """What ``unit`` leaves for the next sub-sequence: ``tokens`` so far, and its keys and
        values as leaves (``as_leaf``) of the next one's graph."""
        microbatch, j = divmod(unit, self.chunks)
        if j < self.chunks - 1:
            leaves = [as_leaf(t.contiguous()) for t in keys_values]
            if _observers:
                _notify(leaves)
            self._forward[microbatch] = (tokens, leaves)

    def gradients(self, unit: int) -> list[Tensor | None]:
        """The gradients of the keys and values ``unit`` left, from the next sub-sequence's
        backward (none for a micro-batch's last)."""
        if unit % self.chunks == self.chunks - 1:
            return []
        try:
            return self._backward.pop(unit)
        except KeyError:
            raise RuntimeError(
                f"stage {self.stage}: backward of sub-sequence {unit % self.chunks} of "
                f"micro-batch {unit // self.chunks} before that of the sub-sequence after it: "
                "a micro-batch's sub-sequences run backward last to first"
            ) from None

    def roots(
        self, unit: int, keys_values: list[Tensor], roots: list[Tensor], grads: Any
    ) -> tuple[list[Tensor], Any]:
        """A backward's ``roots`` and ``grads`` (None: from a loss), and where ``unit``'s
        backward also starts: its keys and values, with the gradients the next sub-sequence's
        backward found for them."""
        found = self.gradients(unit)
        if not found:  # a micro-batch's last sub-sequence, or a stage without attention
            return roots, grads
        pairs = [(t, g) for t, g in zip(keys_values, found, strict=True) if g is not None]
        given = [None] * len(roots) if grads is None else grads
        return [*roots, *(t for t, _ in pairs)], [*given, *(g for _, g in pairs)]

    def hand_back(self, unit: int, grads: list[Tensor | None]) -> None:
        """The gradients of the keys and values ``unit`` took, for the unit before (an empty
        list from a stage without attention)."""
        if unit % self.chunks:
            self._backward[unit - 1] = grads

    def clear(self) -> None:
        self._forward.clear()
        self._backward.clear()


def run_cached(
    layers: Sequence[CachedLayer],
    x: Any,
    carried: Sequence[Tensor],
    past: int,
    on_output: Callable[[Any, Any], None] | None = None,
) -> tuple[Any, list[Tensor]]:
    """Sub-sequence ``x`` (``[rows, tokens, ...]``, after ``past`` tokens) through ``layers``,
    their attention caches starting from ``carried`` (what each attention layer handed on,
    layer after layer, the same number each); returns the output (every token's, logits
    included) and what the caches hand on to the next sub-sequence, in the same order.
    ``on_output(layer, output)`` after each layer: a cached forward runs no module hooks."""
    caches = [layer.new_cache() for layer in layers]
    held = [kv for cache in caches if cache is not None for kv in cache.kv_layers()]
    if carried:
        if not held or len(carried) % len(held):
            raise RuntimeError(
                f"a sub-sequence brought {len(carried)} keys and values for "
                f"{len(held)} attention layers"
            )
        each = len(carried) // len(held)
        for i, kv in enumerate(held):
            kv.take_carry(carried[i * each : (i + 1) * each])
    first = tensors_of(x)[0]
    rows, new = first.shape[0], first.shape[1]
    positions = torch.arange(past, past + new, device=first.device).expand(rows, new)
    valid = torch.ones(rows, past + new, dtype=torch.bool, device=first.device)
    context = CacheContext(positions, valid, every_token=True)
    for layer, cache in zip(layers, caches, strict=True):
        taken = tensors_of(x) if _observers else []  # only a meter looks at them
        x = layer.forward_cached(x, cache, context)
        if on_output is not None:
            on_output(layer, x)
        if _observers:
            _notify([*taken, *tensors_of(x)])
    after: list[Tensor] = []
    for kv in held:
        handed = kv.carry()
        if not handed:
            raise RuntimeError("an attention layer left no keys and values for the next unit")
        after += handed
    return x, after
