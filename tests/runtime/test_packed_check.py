"""A packed micro-batch whose metadata does not match its tokens is refused in one line
naming the micro-batch; every micro-batch ``gpipe.data.pack`` makes passes."""

import pytest
import torch

from gpipe.data import pack
from gpipe.runtime.packed_check import check_packed

LONG_TAIL = [5, 9, 3, 11, 6, 4, 8, 120, 17, 2, 64, 33]


@pytest.mark.parametrize("balanced", [True, False])
def test_what_pack_makes_passes(balanced):
    docs = [torch.arange(1, n + 1) for n in LONG_TAIL]
    for i, (x, _) in enumerate(pack(docs, max_tokens=128, chunks=3, balanced=balanced)):
        check_packed(x, f"microbatches[{i}] inputs")


def _packed() -> dict:
    (x, _), *_ = pack([torch.arange(1, n + 1) for n in (5, 9, 3)], max_tokens=16, chunks=1)
    return x  # rows [5 + 9 tokens], [3, padding 11]: cu_seqlens 0 5 14 17 28, 2 rows x 14


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cu_seqlens": [0, 5, 14, 17, 30]}, r"cu_seqlens ends at 30 but the micro-batch "
         r"holds 28 tokens \(2 rows x 14\)"),
        ({"cu_seqlens": [0, 14, 5, 17, 28]}, "cu_seqlens must increase, got 14 then 5 at "
         "entries 1 and 2"),
        ({"cu_seqlens": [0, 5, 5, 17, 28]}, "cu_seqlens must increase, got 5 then 5"),
        ({"cu_seqlens": [1, 5, 14, 17, 28]}, "cu_seqlens must start at 0, got 1"),
        ({"cu_seqlens": [28]}, "cu_seqlens must hold at least 2 integer offsets, got 1 of"),
        ({"cu_seqlens": [0.0, 28.0]}, "cu_seqlens must hold .* got 2 of torch.float32"),
        ({"max_seqlen": 9}, "max_seqlen is 9 but the longest segment of cu_seqlens is 11"),
        ({"cu_seqlens": [0, 6, 14, 17, 28]}, "segment 1 of cu_seqlens begins at token 6, "
         "where position_ids are 1, not 0"),
    ],
)  # fmt: skip
def test_metadata_that_does_not_match_the_tokens_is_refused_naming_the_micro_batch(change, message):
    x = _packed()
    x.update({k: torch.tensor(v) if isinstance(v, list) else v for k, v in change.items()})
    with pytest.raises(ValueError, match=r"^microbatches\[3\] inputs: " + message):
        check_packed(x, "microbatches[3] inputs")


def test_position_ids_of_another_shape_than_the_tokens_are_refused():
    x = _packed()
    x["position_ids"] = x["position_ids"][:, :8]
    with pytest.raises(
        ValueError, match=r"position_ids have shape \(2, 8\) but input_ids \(2, 14\)"
    ):
        check_packed(x)


def test_inputs_that_are_not_packed_pass_unread():
    check_packed(torch.ones(2, 3))
    check_packed({"input_ids": torch.ones(2, 3)})


def test_pipeline_step_refuses_a_packed_micro_batch_that_does_not_match_before_sending():
    """``Pipeline.step(microbatches=...)`` checks each packed micro-batch as it takes the list
    (``gpipe.engine.presplit``), on every rank, before any message."""
    from gpipe.engine.presplit import presplit

    good = pack([torch.arange(1, n + 1) for n in (5, 9, 3, 7)], max_tokens=16, chunks=2)
    (x, y), second = good
    presplit(good)
    bad = {**x, "cu_seqlens": x["cu_seqlens"] + 1}
    with pytest.raises(ValueError, match=r"microbatches\[1\] inputs: cu_seqlens must start at 0"):
        presplit([second, (bad, y)])
