"""Which device a rank takes: a bare ``"cuda"`` becomes this process's GPU, and a GPU the
machine does not have is refused at once (on every process of the machine where the local
rank picks it), so no rank waits for a peer that failed. CUDA's device count is set by hand:
CI has no GPU."""

import pytest
import torch

from gpipe.comm.process_group import rank_device


@pytest.fixture
def gpus(monkeypatch):
    def have(n: int, local_rank: int = 0, local_world: int = 1) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))

    return have


def test_cpu_is_cpu_and_none_is_the_default(gpus):
    gpus(0, local_rank=1, local_world=2)
    assert rank_device("cpu") == torch.device("cpu")
    assert rank_device(None) == torch.device("cpu")


def test_a_bare_cuda_is_this_processs_gpu(gpus):
    gpus(2, local_rank=1, local_world=2)
    assert rank_device("cuda") == torch.device("cuda", 1)
    assert rank_device(None) == torch.device("cuda", 1)
    assert rank_device("cuda:0") == torch.device("cuda", 0)


def test_more_processes_than_gpus_are_refused_on_every_process(gpus):
    for local_rank in (0, 1):  # the rank whose GPU exists refuses too
        gpus(1, local_rank=local_rank, local_world=2)
        with pytest.raises(ValueError, match=r"2 processes on this machine and 1 CUDA device"):
            rank_device(None)
    gpus(2)
    with pytest.raises(ValueError, match=r"device cuda:3: this machine has 2 CUDA device"):
        rank_device("cuda:3")
