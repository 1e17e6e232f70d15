"""What a stage's layers need to generate with a KV cache, and the cache's rows moved as
sequences come and go.

Generation (``gpipe.engine.generation``) keeps on every stage one cache per group of
sequences in flight. A group's rows are left-padded to one length: row b's tokens are the
last ``n_b`` columns of its keys and values, the columns before them masked. A layer that
can generate (``CachedLayer``) makes an empty cache for a group (``new_cache``) and runs new
tokens against it (``forward_cached``) under a ``CacheContext``: where each new token sits
in its sequence and which keys are real. Its cache shows its keys and values
(``kv_layers``), so that rows are added, dropped and trimmed here, whatever the model.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "CacheContext",
    "CachedLayer",
    "KVCache",
    "KVLayer",
    "LayerCache",
    "add_rows",
    "keep_rows",
    "limit_columns",
    "pad_columns",
    "trim_columns",
]


@dataclass(frozen=True)
class CacheContext:
    """The new tokens of one forward: ``positions`` ``[rows, new]`` (each token's position in
    its sequence) and ``valid`` ``[rows, past + new]`` (which keys are real: the cached
    columns, then the new ones). ``every_token``: a training run over a sub-sequence
    (``gpipe.runtime.seq_chunks``), which needs every new token's logits (generation needs
    only the last's) and the model's training behaviour, dropout included."""

    positions: Tensor
    valid: Tensor
    every_token: bool = False
    _biases: dict[torch.dtype, Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def past(self) -> int:
        """Columns already in the cache."""
        return self.valid.shape[1] - self.positions.shape[1]

    @functools.cached_property
    def attention_mask(self) -> Tensor:
        """``[rows, 1, new, past + new]`` bool: a new token sees the real keys up to its own
        column; built once per forward and shared by every layer."""
        total = self.valid.shape[1]
        if self.positions.shape[1] == 1:  # one new token: it sees every real key
            return self.valid[:, None, None, :]
        device = self.valid.device
        queries = torch.arange(self.past, total, device=device)
        causal = torch.arange(total, device=device)[None, :] <= queries[:, None]
        return self.valid[:, None, None, :] & causal[None, None]

    def causal_bias(self, dtype: torch.dtype) -> Tensor:
        """For a sub-sequence in training (every key real): ``[1, 1, new, past + new]``, 0
        where a new token sees the key and -inf where not, in ``dtype``. Made once and shared
        by every layer, so that the attention of each (which keeps its mask for its
        backward) keeps this one rather than a copy per layer and row."""
        bias = self._biases.get(dtype)
        if bias is None:
            total, device = self.valid.shape[1], self.valid.device
            queries = torch.arange(self.past, total, device=device)
            hidden = torch.arange(total, device=device)[None, :] > queries[:, None]
            bias = torch.zeros(hidden.shape, dtype=dtype, device=device)
            bias = bias.masked_fill(hidden, float("-inf"))[None, None]
            self._biases[dtype] = bias
        return bias


class KVLayer(Protocol):
    """One attention layer's keys and values, ``[rows, heads, columns, head_dim]`` (None
    before any token). For sub-sequences in training (``gpipe.runtime.seq_chunks``) it also
    hands on what the next sub-sequence starts from (``carry``) and takes it (``take_carry``):
    the keys and values of the tokens so far, as tensors in the layer's own layout."""

    keys: Tensor | None
    values: Tensor | None

    def carry(self) -> list[Tensor]: ...

    def take_carry(self, carried: Sequence[Tensor]) -> None: ...


class LayerCache(Protocol):
    """What a layer keeps for one group: its attention layers' keys and values, in order."""

    def kv_layers(self) -> Sequence[KVLayer]: ...


@runtime_checkable
class CachedLayer(Protocol):
    """A layer that can generate: an empty cache for a group of sequences (None if it keeps
    nothing), and a forward of new tokens against it that adds theirs. On the last stage the
    output holds (at least) each row's logits at its last new token."""

    def new_cache(self) -> LayerCache | None: ...

    def forward_cached(self, x: Any, cache: Any, context: CacheContext) -> Any: ...


class KVCache:
    """The keys and values of one attention layer of the built-in GPT. In generation they lie
    in buffers with room for more columns: a new token's keys and values are written in
    place, not concatenated (which would copy the whole cache at every token); the buffers
    double when full, but past ``limit`` columns (the context, where generation sets it) only
    as far as needed. Sub-sequences in training keep each sub-sequence's keys and values
    apart instead (``add_sub_sequence``): the gradient reaches each, and the attention of
    every later sub-sequence keeps the same tensors rather than a longer copy of its own."""

    def __init__(self) -> None:
        self._keys: Tensor | None = None
        self._values: Tensor | None = None
        self._length = 0
        self.limit: int | None = None
        self._sub_sequences: list[tuple[Tensor, Tensor]] = []

    @property
    def keys(self) -> Tensor | None:
        return None if self._keys is None else self._keys[..., : self._length, :]

    @keys.setter
    def keys(self, value: Tensor | None) -> None:
        self._keys = value
        self._length = 0 if value is None else value.shape[-2]

    @property
    def values(self) -> Tensor | None:
        return None if self._values is None else self._values[..., : self._length, :]

    @values.setter
    def values(self, value: Tensor | None) -> None:
        self._values = value

    def kv_layers(self) -> list[KVCache]:
        return [self]

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Add the new tokens' keys and values after the cached ones; returns all of them."""
        old, new = self._length, keys.shape[-2]
        if self._keys is None or self._values is None:
            room = self._room_for(new, 16)
            self._keys, self._values = self._room(keys, room), self._room(values, room)
        elif old + new > self._keys.shape[-2]:
            room = self._room_for(old + new, 2 * (old + new))
            self._keys = self._grown(self._keys[..., :old, :], keys, room)
            self._values = self._grown(self._values[..., :old, :], values, room)
        self._keys[..., old : old + new, :] = keys
        self._values[..., old : old + new, :] = values
        self._length = old + new
        return self._keys[..., : old + new, :], self._values[..., : old + new, :]

    def add_sub_sequence(self, keys: Tensor, values: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Keep a sub-sequence's own keys and values (in training), apart from those of the
        sub-sequences before it, which are returned: their keys, and their values, in order."""
        before = list(self._sub_sequences)
        self._sub_sequences.append((keys, values))
        return [k for k, _ in before], [v for _, v in before]

    def carry(self) -> list[Tensor]:
        """Each sub-sequence's keys and values so far (keys, values; in order)."""
        return [t for pair in self._sub_sequences for t in pair]

    def take_carry(self, carried: Sequence[Tensor]) -> None:
        """Start from the sub-sequences ``carry`` handed on."""
        self._sub_sequences = list(zip(carried[::2], carried[1::2], strict=True))

    def _room_for(self, needed: int, wanted: int) -> int:
        """Columns of a new buffer that holds ``needed``: ``wanted``, but no more than
        ``limit`` unless ``needed`` is more."""
        wanted = max(needed, wanted)
        return wanted if self.limit is None else max(needed, min(wanted, self.limit))

    @staticmethod
    def _room(like: Tensor, columns: int) -> Tensor:
        return like.new_empty((*like.shape[:-2], columns, like.shape[-1]))

    @staticmethod
    def _grown(held: Tensor, like: Tensor, columns: int) -> Tensor:
        buffer = KVCache._room(like, columns)
        buffer[..., : held.shape[-2], :] = held
        return buffer


def _each(caches: Sequence[LayerCache | None]) -> Iterator[KVLayer]:
    for cache in caches:
        if cache is not None:
            yield from cache.kv_layers()


def limit_columns(caches: Sequence[LayerCache | None], limit: int | None) -> None:
    """Let no layer's buffers (the built-in GPT's, which grow by doubling) grow past
    ``limit`` columns unless a forward needs more: generation sets the model's context, which
    no row outgrows, so that the caches hold what ``gpipe plan --generate`` counts."""
    for kv in _each(caches):
        if isinstance(kv, KVCache):
            kv.limit = limit


def keep_rows(caches: Sequence[LayerCache | None], index: Tensor) -> None:
    """Keep the rows ``index`` (in that order) of every layer's keys and values."""
    for kv in _each(caches):
        if kv.keys is not None and kv.values is not None:
            kv.keys, kv.values = kv.keys[index], kv.values[index]


def trim_columns(caches: Sequence[LayerCache | None], n: int) -> None:
    """Drop the first ``n`` columns (masked in every row) of every layer's keys and values."""
    if n <= 0:
        return
    for kv in _each(caches):
        if kv.keys is not None and kv.values is not None:
            kv.keys, kv.values = kv.keys[..., n:, :], kv.values[..., n:, :]


def _padded(t: Tensor, n: int) -> Tensor:
    """``t`` with ``n`` columns of zeros before its own (dim -2)."""
    if n <= 0:
        return t
    pad = t.new_zeros((*t.shape[:-2], n, t.shape[-1]))
    return torch.cat([pad, t], dim=-2)


def pad_columns(caches: Sequence[LayerCache | None], n: int) -> None:
    """Put ``n`` masked columns before every row of every layer's keys and values."""
    for kv in _each(caches):
        if kv.keys is not None and kv.values is not None:
            kv.keys, kv.values = _padded(kv.keys, n), _padded(kv.values, n)


def add_rows(
    caches: Sequence[LayerCache | None], rows: Sequence[LayerCache | None], pad: int
) -> None:
    """Add the rows of ``rows`` (caches of the same layers) after those of ``caches``, each
    column-padded by ``pad`` so that both end at the same column."""
    for kv, new in zip(_each(caches), _each(rows), strict=True):
        if new.keys is None or new.values is None:
            continue
        keys, values = _padded(new.keys, pad), _padded(new.values, pad)
        if kv.keys is None or kv.values is None:
            kv.keys, kv.values = keys, values
        else:
            kv.keys = torch.cat([kv.keys, keys], dim=0)
            kv.values = torch.cat([kv.values, values], dim=0)
