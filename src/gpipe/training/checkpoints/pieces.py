"""Checkpoints of split tensors whose shard on a rank is several blocks of the whole.

``torch.distributed.checkpoint`` (DCP) describes a rank's shard of a DTensor as one block of
the whole tensor: an offset and a size per dimension. A strided placement breaks that: a
stacked-experts map whose gate and up halves are split side by side over T tensor ranks
(``gpipe.parallel.experts``) leaves each rank the same slice of both halves, two blocks far
apart. DCP then places the shard at one wrong offset and refuses the save as overlapping.

The planners here describe such a shard as the blocks it is made of, each written and read
as a chunk of the whole tensor. A checkpoint so saved holds each tensor in its stored layout,
as any other: it loads at another T, into a model in one process, or by ``gpipe export``.
Every other value is planned as DCP plans it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Container
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["Piece", "PiecewiseLoadPlanner", "PiecewiseSavePlanner", "local_pieces", "pieces_of"]


class Piece(NamedTuple):
    """One block of a rank's shard: where it lies in the whole tensor (``offsets``,
    ``sizes``) and where in the rank's local tensor (``local``)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: tuple[int, ...]


Run = tuple[int, int]  # a range of the whole tensor along one dimension: (start, length)


def _take(runs: list[Run], start: int, length: int) -> list[Run]:
    """The ranges of the whole tensor that local positions ``start`` to ``start + length``
    cover, where the local tensor is ``runs`` laid end to end."""
    taken, position = [], 0
    for first, size in runs:
        low, high = max(start, position), min(start + length, position + size)
        if low < high:
            taken.append((first + low - position, high - low))
        position += size
    return taken


def _merged(runs: list[Run]) -> list[Run]:
    """``runs`` with neighbours that continue one another joined."""
    merged: list[Run] = []
    for first, size in runs:
        if merged and sum(merged[-1]) == first:
            merged[-1] = (merged[-1][0], merged[-1][1] + size)
        else:
            merged.append((first, size))
    return merged


def pieces_of(
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
) -> list[Piece] | None:
    """The blocks of the whole tensor of ``shape`` that the rank at ``coordinate`` of a mesh
    of ``mesh_shape`` holds under ``placements``, in the order its local tensor holds them;
    None where that is one block (DCP's own case). The placements apply in mesh order, as
    DTensor applies them: a ``Shard(d)`` keeps the rank's chunk of what it holds along ``d``,
    a strided one the rank's chunk of each of ``split_factor`` equal parts of it."""
    runs: list[list[Run]] = [[(0, size)] for size in shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            factor = int(placement.split_factor)
        elif isinstance(placement, Shard):
            factor = 1
        else:
            continue  # replicated: every rank holds what the mesh dimensions before it left
        dim, ranks, rank = placement.dim, mesh_shape[mesh_dim], coordinate[mesh_dim]
        held = sum(size for _, size in runs[dim])
        if held % (factor * ranks):
            raise ValueError(
                f"a checkpoint cannot place a shard of {held} along dimension {dim} split "
                f"{factor} x {ranks} ways ({placement}): it must divide evenly"
            )
        part, chunk = held // factor, held // (factor * ranks)
        runs[dim] = _merged(
            [run for j in range(factor) for run in _take(runs[dim], j * part + rank * chunk, chunk)]
        )
    if all(len(along) == 1 for along in runs):
        return None
    with_local = []
    for along in runs:
        starts = itertools.accumulate((size for _, size in along[:-1]), initial=0)
        with_local.append(
            [(first, size, local) for (first, size), local in zip(along, starts, strict=True)]
        )
    return [
        Piece(*(tuple(values) for values in zip(*block, strict=True)))
        for block in itertools.product(*with_local)
    ]


def local_pieces(value: Any) -> list[Piece] | None:
    """The blocks of this rank's shard of ``value``, a DTensor with a strided placement;
    None for anything DCP places itself."""
    if not isinstance(value, DTensor) or not any(
        isinstance(p, _StridedShard) for p in value.placements
    ):
        return None
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:  # not on this rank's mesh: nothing of it here
        return None
    mesh = value.device_mesh
    return pieces_of(tuple(value.shape), value.placements, tuple(mesh.shape), tuple(coordinate))


def _narrowed(value: DTensor, piece: Piece) -> Tensor:
    """The view of ``value``'s local tensor that holds ``piece``."""
    block = value.to_local()
    for dim, (start, size) in enumerate(zip(piece.local, piece.sizes, strict=True)):
        block = block.narrow(dim, start, size)
    return block


def _by_blocks(
    state_dict: dict[str, Any], keys: Container[str] | None = None
) -> dict[str, list[Piece]]:
    """The blocks of this rank's shard of each value of ``state_dict`` (of ``keys``, if
    given) that DCP cannot place itself."""
    return {
        fqn: found
        for fqn, value in state_dict.items()
        if (keys is None or fqn in keys) and (found := local_pieces(value)) is not None
    }


def _block(state_dict: dict[str, Any], pieces: list[Piece], index: MetadataIndex) -> Tensor:
    """The view of the local tensor of ``state_dict[index.fqn]`` that holds the block at
    ``index.offset``."""
    for piece in pieces:
        if torch.Size(piece.offsets) == index.offset:
            return _narrowed(state_dict[index.fqn], piece)
    raise ValueError(f"{index.fqn} has no block at offset {index.offset} on this rank")


class PiecewiseSavePlanner(DefaultSavePlanner):
    """DCP's save planner, with a strided shard written as the blocks it is made of."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pieces: dict[str, list[Piece]] = {}  # by key: the blocks of this rank's shard

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.pieces = _by_blocks(self.state_dict)
        if not self.pieces:
            return plan
        items = [item for item in plan.items if item.index.fqn not in self.pieces]
        for fqn, pieces in self.pieces.items():
            value = self.state_dict[fqn]
            properties = TensorProperties.create_from_tensor(value.to_local())
            items += [
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(piece.offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(
                            offsets=torch.Size(piece.offsets), sizes=torch.Size(piece.sizes)
                        ),
                        properties=properties,
                        size=value.size(),
                    ),
                )
                for piece in pieces
            ]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        pieces = self.pieces.get(index.fqn)
        if pieces is None:
            return super().lookup_object(index)
        return _block(self.state_dict, pieces, index)


class PiecewiseLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with a strided shard read as the blocks it is made of (each from
    whichever saved chunks overlap it), straight into the rank's local tensor."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pieces: dict[str, list[Piece]] = {}  # by key: the blocks of this rank's shard

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self.metadata is not None  # set up by DCP before it plans
        saved = self.metadata.state_dict_metadata
        tensors = {fqn for fqn, md in saved.items() if isinstance(md, TensorStorageMetadata)}
        self.pieces = _by_blocks(self.state_dict, tensors)
        if not self.pieces:
            return plan
        items = [item for item in plan.items if item.dest_index.fqn not in self.pieces]
        for fqn, pieces in self.pieces.items():
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes))
                for p in pieces
            ]
            md = saved[fqn]
            assert isinstance(md, TensorStorageMetadata)
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        pieces = self.pieces.get(index.fqn)
        if pieces is None:
            return super().lookup_tensor(index)
        return _block(self.state_dict, pieces, index)
