"""Checkpoints of tensors whose shard on a rank is several blocks of the whole (the packed
gate-and-up maps of stacked experts split over tensor ranks): the blocks each rank holds, by
DTensor's rules, for any mesh and placements; and a save over real processes that loads back
split and, in one process, as the stored layout the same module trained unsplit has."""

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard  # DTensor's only name for it

from gpipe.training.checkpoints.format import load_model_weights
from gpipe.training.checkpoints.pieces import pieces_of

from ..small_models import Experts
from ..workers import run
from . import pieces_cases as cases


def _local_by_dtensors_rules(whole, placements, mesh_shape, coordinate):
    """What a rank holds, by the rules DTensor documents, from the whole tensor."""
    local = whole
    for placement, ranks, rank in zip(placements, mesh_shape, coordinate, strict=True):
        if isinstance(placement, _StridedShard):
            parts = local.chunk(placement.split_factor, placement.dim)
            local = torch.cat(
                [part.chunk(ranks, placement.dim)[rank] for part in parts], placement.dim
            )
        elif isinstance(placement, Shard):
            local = local.chunk(ranks, placement.dim)[rank]
    return local


@st.composite
def layouts(draw):
    """A tensor of 1 to 3 dimensions on a mesh of 1 or 2 dimensions, each mesh dimension
    replicating, sharding or strided-sharding one of its dimensions, by sizes that divide."""
    ndim = draw(st.integers(1, 3))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    placements, divisors = [], [1] * ndim
    for ranks in mesh_shape:
        kind, dim = (
            draw(st.sampled_from(["replicate", "shard", "strided"])),
            draw(st.integers(0, ndim - 1)),
        )
        if kind == "replicate":
            placements.append(Replicate())
            continue
        factor = draw(st.integers(2, 3)) if kind == "strided" else 1
        placements.append(_StridedShard(dim, split_factor=factor) if factor > 1 else Shard(dim))
        divisors[dim] *= factor * ranks
    shape = tuple(d * draw(st.integers(1, 2)) for d in divisors)
    return shape, tuple(placements), mesh_shape


@given(layouts())
def test_the_blocks_of_each_rank_are_what_it_holds_by_dtensors_rules(layout):
    shape, placements, mesh_shape = layout
    whole = torch.arange(torch.Size(shape).numel()).reshape(shape)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        local = _local_by_dtensors_rules(whole, placements, mesh_shape, coordinate)
        pieces = pieces_of(shape, placements, mesh_shape, coordinate)
        if pieces is None:  # one block of the whole: where its first element is
            offsets = torch.unravel_index(local.flatten()[0], shape)
            block = whole[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape, strict=True))]
            assert torch.equal(block, local)
            continue
        assert len(pieces) > 1
        covered = torch.zeros(local.shape, dtype=torch.int64)
        for piece in pieces:
            there = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes, strict=True))
            here = tuple(slice(o, o + s) for o, s in zip(piece.local, piece.sizes, strict=True))
            assert torch.equal(whole[there], local[here])
            covered[here] += 1
        assert bool((covered == 1).all())  # the blocks tile the local tensor


def test_the_packed_maps_of_two_tensor_ranks_are_two_blocks_each():
    strided = (_StridedShard(1, split_factor=2),)
    assert pieces_of((3, 8, 2), strided, (2,), (1,)) == [
        ((0, 2, 0), (3, 2, 2), (0, 0, 0)),  # its slice of the gate map
        ((0, 6, 0), (3, 2, 2), (0, 2, 0)),  # and of the up map, beside it
    ]
    assert pieces_of((3, 8, 2), strided, (1,), (0,)) is None  # one rank holds it whole
    assert pieces_of((3, 8, 2), (Shard(1),), (2,), (1,)) is None


def test_a_shard_that_does_not_divide_evenly_is_refused_by_name():
    with pytest.raises(ValueError, match="shard of 6 along dimension 1 split 2 x 2 ways"):
        pieces_of((3, 6, 2), (_StridedShard(1, split_factor=2),), (2,), (0,))


def test_split_experts_save_and_load_back_split_and_whole(tmp_path):
    """Saved over two tensor ranks, loaded back into split modules (weights and Adam's
    moments), and in one process into the whole module: the weights of the same step
    taken unsplit."""
    found = run(cases.saved_and_reloaded, 2, (str(tmp_path),), threads=1)
    assert all(r["weights"] and r["moments"] and r["step"] == 1 for r in found.values()), found
    whole = torch.nn.Sequential(Experts(**cases.EXPERTS).double())
    load_model_weights(Path(found[0]["path"]), whole)
    expected, _ = cases.trained(split=False)
    for (name, got), want in zip(whole.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)
