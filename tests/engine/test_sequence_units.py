"""SequenceUnits on its own: a step's micro-batches cut into sub-sequences, each unit's share
of its micro-batch's loss weight, and the outputs and losses joined back (no processes; the
steps of tests/runtime/test_seq_chunks.py check it end to end against unsplit training)."""

import pytest
import torch

from gpipe.engine.sequence_units import SequenceUnits
from gpipe.runtime.executor import StepData
from gpipe.runtime.seq_chunks import SeqChunks
from gpipe.runtime.stage import NO_TARGET


def _units(chunks: int, split: str = "even", reduction: str = "mean") -> SequenceUnits:
    return SequenceUnits(SeqChunks(chunks, split), reduction)


def _last_stage(targets, weights) -> StepData:
    return StepData(n_stages=2, build_graph=True, targets=targets, loss_weights=weights)


def test_inputs_are_cut_in_unit_order_each_micro_batch_in_turn():
    parts = [torch.arange(12).view(2, 6), torch.arange(12, 18).view(1, 6)]
    units = _units(3).inputs(parts)
    assert units is not None and len(units) == 6
    assert [u.tolist() for u in units[:3]] == [
        [[0, 1], [6, 7]],
        [[2, 3], [8, 9]],
        [[4, 5], [10, 11]],
    ]
    assert units[3].tolist() == [[12, 13]]
    assert _units(3).inputs(None) is None  # a rank that feeds no inputs


def test_a_mean_loss_shares_each_weight_by_tokens_and_a_sum_keeps_it_whole():
    targets = [torch.zeros(2, 6, dtype=torch.long), torch.zeros(1, 6, dtype=torch.long)]
    data = _last_stage(list(targets), [0.75, 0.25])
    kept = _units(2).targets(data, None, [2, 1])
    assert kept == [0.75, 0.25]
    assert data.loss_weights == pytest.approx([0.375, 0.375, 0.125, 0.125])
    assert [tuple(t.shape) for t in data.targets] == [(2, 3)] * 2 + [(1, 3)] * 2
    summed = _last_stage(list(targets), [1.0, 1.0])
    _units(2, reduction="sum").targets(summed, None, [2, 1])
    assert summed.loss_weights == [1.0] * 4


def test_balanced_units_share_by_their_tokens_and_counts_by_what_they_count():
    target = torch.zeros(1, 8, dtype=torch.long)
    data = _last_stage([target], [1.0])
    seq = SeqChunks(2, "balanced")
    _units(2, "balanced").targets(data, None, [1])
    assert data.loss_weights == pytest.approx(seq.weights(8))
    counts = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0]])  # padding after the second token
    counted = _last_stage([target], [1.0])
    _units(2).targets(counted, counts, [1])
    assert counted.loss_weights == [1.0, 0.0]  # a unit of padding alone weighs nothing


def test_outputs_and_losses_are_joined_back_with_the_micro_batches_weights():
    data = StepData(n_stages=2, build_graph=True, keep_outputs=True)
    data.outputs = {i: torch.full((1, 2), float(i)) for i in range(4)}
    data.losses = {i: torch.tensor(float(i)) for i in range(4)}
    _units(2).join(data, 2, [0.5, 0.5])
    assert data.outputs[0].tolist() == [[0.0, 0.0, 1.0, 1.0]]
    assert data.outputs[1].tolist() == [[2.0, 2.0, 3.0, 3.0]]
    assert [float(data.losses[i]) for i in range(2)] == [1.0, 5.0]
    assert data.loss_weights == [0.5, 0.5]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("packed", "seq_chunks cuts token ids, a tensor"),
        ("no targets", "seq_chunks needs targets"),
        ("row counts", "with seq_chunks, counts= needs one count per token"),
        ("short counts", "counts= per token must cover each sequence of 6 tokens, got 4 a row"),
    ],
)
def test_what_cannot_be_cut_is_refused_in_one_line(case, message):
    units = _units(2)
    target = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises((TypeError, ValueError), match=f"^{message}"):
        if case == "packed":
            units.inputs([{"input_ids": target}])
        elif case == "no targets":
            units.targets(_last_stage([NO_TARGET], [1.0]), None, [2])
        elif case == "row counts":
            units.targets(_last_stage([target], [1.0]), torch.ones(2), [2])
        else:
            units.targets(_last_stage([target], [1.0]), torch.ones(2, 4), [2])
