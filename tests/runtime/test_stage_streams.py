"""Which pipelines give each stage a CUDA stream of its own, and what is refused.

The streams themselves need a GPU: tests/test_cuda.py runs every checkpoint mode of the
schedules that use them against un-pipelined training there."""

import pytest
import torch
from torch import nn

from gpipe import Pipeline
from gpipe.runtime.stage_streams import StageStreams, check_overlap_stages, overlaps_stages

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_dualpipe_v_pairs_its_stages_on_cuda_by_default():
    assert overlaps_stages(None, "dualpipe-v", CUDA, 2)
    assert not overlaps_stages(None, "dualpipe-v", CPU, 2)
    assert not overlaps_stages(None, "zero-bubble-v", CUDA, 2)
    assert not overlaps_stages(None, "1f1b", CUDA, 1)
    assert not overlaps_stages(None, "read-from-a-file", CUDA, 2)  # a fixed Schedule's name


def test_asking_wins_over_the_default():
    assert overlaps_stages(True, "zero-bubble-v", CUDA, 2)
    assert not overlaps_stages(False, "dualpipe-v", CUDA, 2)


@pytest.mark.parametrize(
    "value, error, words",
    [
        ("yes", TypeError, "overlap_stages must be True, False or None, got str"),
        (1, TypeError, "got int"),
        (True, ValueError, "CUDA stream of its own, but this rank's device is cpu"),
    ],
)
def test_a_bad_overlap_stages_is_refused(value, error, words):
    with pytest.raises(error, match=words):
        check_overlap_stages(value, CPU)


def test_pipeline_refuses_streams_on_cpu_before_any_process_group_work(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="overlap_stages=True issues each stage's work"):
        Pipeline(nn.Sequential(nn.Linear(2, 2)), [1], device="cpu", overlap_stages=True)


def test_streams_need_a_cuda_device():
    with pytest.raises(ValueError, match="stage streams need a CUDA device, got cpu"):
        StageStreams([0, 1], CPU)
