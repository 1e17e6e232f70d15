"""One stage's side of generation: its layers run against caches, one cache per lane and one
per prompt being prefilled, changed by each task as the first stage planned it.

A lane's rows are left-padded to one length (``gpipe.runtime.kv_cache``): a prompt that
joins is padded to the lane's columns (or the lane to its own, if longer), and when rows
leave, the columns no remaining row uses are trimmed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.engine.generation.scheduler import Task
from gpipe.runtime.kv_cache import (
    CacheContext,
    CachedLayer,
    LayerCache,
    add_rows,
    keep_rows,
    limit_columns,
    pad_columns,
    trim_columns,
)

__all__ = ["GenerationRefused", "CachedStage", "StageCaches", "cache_refusal"]


class GenerationRefused(ValueError):
    """A pipeline that cannot generate (a stage whose layers keep no KV cache, stages sharded
    over replicas), refused on every rank alike."""


def cache_refusal(module: nn.Module, index: int) -> str | None:
    """Why stage ``index`` (``module``, its layers) cannot keep a KV cache; None if it can.
    Each layer makes one empty cache, so that a model's refusal (a layer whose state is not
    keys and values) comes before anything runs."""
    layers = list(module.children()) if isinstance(module, nn.Sequential) else [module]
    for name, layer in zip(_names(module), layers, strict=True):
        if not isinstance(layer, CachedLayer):
            return (
                f"generate() needs layers that keep a KV cache (new_cache and forward_cached), "
                f"but stage {index}'s layer {name!r} ({type(layer).__name__}) has none: use the "
                "built-in GPT (gpipe.models.gpt) or a Hugging Face causal LM cut by its plan "
                "(gpipe.split(model, parts=K, plan='hf'))"
            )
        try:
            layer.new_cache()
        except (RuntimeError, ValueError, TypeError) as exc:
            return f"generate(): stage {index}'s layer {name!r} cannot keep a KV cache: {exc}"
    return None


def _names(module: nn.Module) -> list[str]:
    if isinstance(module, nn.Sequential):
        return [name for name, _ in module.named_children()]
    return [type(module).__name__]


class CachedStage:
    """Stage ``index``'s layers (``module``, checked by ``cache_refusal``) run with caches
    on ``device``, under ``autocast`` if given."""

    def __init__(
        self, module: nn.Module, index: int, device: torch.device, autocast: torch.dtype | None
    ) -> None:
        layers = list(module.children()) if isinstance(module, nn.Sequential) else [module]
        self.layers: list[CachedLayer] = [
            layer for layer in layers if isinstance(layer, CachedLayer)
        ]
        assert len(self.layers) == len(layers), "checked by cache_refusal first"
        self.index = index
        self.device = device
        self.autocast = autocast

    def new_caches(self) -> list[LayerCache | None]:
        return [layer.new_cache() for layer in self.layers]

    def run(self, x: Any, caches: Sequence[LayerCache | None], context: CacheContext) -> Any:
        precision = (
            torch.autocast(self.device.type, dtype=self.autocast)
            if self.autocast is not None
            else contextlib.nullcontext()
        )
        with precision:
            for layer, cache in zip(self.layers, caches, strict=True):
                x = layer.forward_cached(x, cache, context)
        return x


@dataclass
class _Lane:
    """A lane's rows on this stage: their sequences, lengths, real columns and caches."""

    caches: list[LayerCache | None]
    rows: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    valid: Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.bool))


@dataclass
class _Prefill:
    caches: list[LayerCache | None]
    length: int = 0


class StageCaches:
    """This stage's caches: one per lane and one per prompt being prefilled; the GPT's hold
    no more columns than ``context`` (the model's), as ``gpipe plan --generate`` counts."""

    def __init__(self, stage: CachedStage, context: int | None = None) -> None:
        self.stage = stage
        self.context = context
        self.device = stage.device
        self.lanes: dict[int, _Lane] = {}
        self._prefills: dict[int, _Prefill] = {}

    def run(self, task: Task, inputs: Any, pieces: Sequence[Any]) -> tuple[Any, list[Any]]:
        """``task`` on this stage: its leaves and joins, the decoding step of its rows
        (``inputs``) and its prefill ``pieces``; returns their outputs."""
        self.apply(task)
        decoded = self.decode(task.lane, inputs) if task.rows else None
        filled = [
            self.prefill(p.sequence, p.start, x, int(x.shape[1]))
            for p, x in zip(task.pieces, pieces, strict=True)
        ]
        return decoded, filled

    def _new_caches(self) -> list[LayerCache | None]:
        caches = self.stage.new_caches()
        limit_columns(caches, self.context)
        return caches

    def apply(self, task: Task) -> None:
        """Leaves, then joins, as the first stage planned them."""
        lane = self.lanes.get(task.lane)
        if lane is None:
            lane = self.lanes[task.lane] = _Lane(self._new_caches())
            lane.valid = lane.valid.to(self.device)
        for sequence in task.leaves:
            self._prefills.pop(sequence, None)
        if any(r in task.leaves for r in lane.rows):
            self._leave(lane, task.leaves)
        for sequence in task.joins:
            self._join(lane, sequence)
        if tuple(lane.rows) != task.rows:
            raise RuntimeError(
                f"stage {self.stage.index}: lane {task.lane} holds rows {lane.rows}, but the "
                f"first stage planned {list(task.rows)}"
            )

    def _leave(self, lane: _Lane, leaves: Sequence[int]) -> None:
        kept = [i for i, r in enumerate(lane.rows) if r not in leaves]
        index = torch.tensor(kept, dtype=torch.long, device=self.device)
        keep_rows(lane.caches, index)
        lane.rows = [lane.rows[i] for i in kept]
        lane.lengths = [lane.lengths[i] for i in kept]
        trim = lane.valid.shape[1] - max(lane.lengths, default=0)
        trim_columns(lane.caches, trim)
        lane.valid = lane.valid[index][:, trim:]

    def _join(self, lane: _Lane, sequence: int) -> None:
        prefill = self._prefills.pop(sequence)
        width, length = lane.valid.shape[1], prefill.length
        if length > width:
            pad_columns(lane.caches, length - width)
            padding = torch.zeros(len(lane.rows), length - width, dtype=torch.bool)
            lane.valid = torch.cat([padding.to(self.device), lane.valid], dim=1)
            width = length
        add_rows(lane.caches, prefill.caches, width - length)
        row = torch.arange(width, device=self.device) >= width - length
        lane.valid = torch.cat([lane.valid, row[None]], dim=0)
        lane.rows.append(sequence)
        lane.lengths.append(length)

    def decode(self, lane_index: int, x: Any) -> Any:
        """One token of each of the lane's rows: ``x`` holds them (token ids ``[rows, 1]`` on
        the first stage, the stage before's output on the others)."""
        lane = self.lanes[lane_index]
        rows = len(lane.rows)
        positions = torch.tensor(lane.lengths, dtype=torch.long, device=self.device)[:, None]
        valid = torch.cat(
            [lane.valid, torch.ones(rows, 1, dtype=torch.bool, device=self.device)], 1
        )
        out = self.stage.run(x, lane.caches, CacheContext(positions, valid))
        lane.valid = valid
        lane.lengths = [n + 1 for n in lane.lengths]
        return out

    def prefill(self, sequence: int, start: int, x: Any, n: int) -> Any:
        """Tokens ``[start, start + n)`` of a prompt, in its own cache."""
        prefill = self._prefills.get(sequence)
        if prefill is None:
            prefill = self._prefills[sequence] = _Prefill(self._new_caches())
        if prefill.length != start:
            raise RuntimeError(
                f"stage {self.stage.index}: prompt {sequence} is prefilled up to token "
                f"{prefill.length}, but a piece from token {start} came"
            )
        positions = torch.arange(start, start + n, device=self.device)[None]
        valid = torch.ones(1, start + n, dtype=torch.bool, device=self.device)
        out = self.stage.run(x, prefill.caches, CacheContext(positions, valid))
        prefill.length += n
        return out
