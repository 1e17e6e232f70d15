"""Where a pipeline's stages and layers sit: ``RankPlacement`` for one stage per rank, looped
stages and a V, and for a schedule file's own stage-to-rank map."""

import pytest

from gpipe.engine import RankPlacement
from gpipe.schedules import Placement


def test_one_stage_per_rank_holds_its_layers_in_order():
    placement = RankPlacement((2, 3, 1), rank=1, n_ranks=3, group=None)
    assert placement.stages == (1,)
    assert [placement.stage_of(layer) for layer in range(6)] == [0, 0, 1, 1, 1, 2]
    assert placement.stage_to_rank == (0, 1, 2)
    assert not placement.is_first and not placement.is_last
    assert placement.global_rank(2) == 2  # no group: the world's ranks


@pytest.mark.parametrize(
    ("layout", "stage_to_rank", "held", "first", "last"),
    [
        # per rank 0 and 1: the stages it holds, whether it holds the first and the last
        (Placement.LOOPED, (0, 1, 0, 1), ((0, 2), (1, 3)), (True, False), (False, True)),
        (Placement.V, (0, 1, 1, 0), ((0, 3), (1, 2)), (True, False), (True, False)),
        ((1, 0, 0, 1), (1, 0, 0, 1), ((1, 2), (0, 3)), (False, True), (False, True)),
    ],
)
def test_several_stages_per_rank_sit_as_the_layout_says(layout, stage_to_rank, held, first, last):
    for rank in (0, 1):
        placement = RankPlacement((1, 1, 1, 1), rank=rank, n_ranks=2, group=None, layout=layout)
        assert placement.stage_to_rank == stage_to_rank
        assert placement.stages == held[rank]
        assert (placement.is_first, placement.is_last) == (first[rank], last[rank])


@pytest.mark.parametrize("layer", [-1, 4])
def test_a_layer_outside_the_model_is_refused(layer):
    placement = RankPlacement((2, 2), rank=0, n_ranks=2, group=None)
    with pytest.raises(IndexError, match=rf"layer must be in \[0, 4\), got {layer}"):
        placement.stage_of(layer)
