"""The same promise on CUDA devices: GPipe across GPUs, Pipeline over NCCL. Skipped without
CUDA (CI has none); run them on a GPU machine with
`GPIPE_TEST_CUDA=1 pytest tests/test_cuda.py` (without it the suite hides the GPUs and runs
on CPU: tests/conftest.py)."""

import copy

import pytest
import torch
from torch.nn.functional import mse_loss

from gpipe import GPipe, launch

from . import distributed_cases as cases
from .small_models import batch, mlp

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device and GPIPE_TEST_CUDA=1")
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices and GPIPE_TEST_CUDA=1")


@needs_gpu
@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
def test_gpipe_on_cuda_matches_unpipelined(mode):
    devices = [f"cuda:{i % GPUS}" for i in range(2)]
    reference = mlp().cuda()
    pipe = GPipe(copy.deepcopy(reference), [4, 4], devices=devices, chunks=4, checkpoint=mode)
    x, y = (t.cuda() for t in batch(10))
    mse_loss(pipe(x), y.to(devices[-1])).backward()
    mse_loss(reference(x), y).backward()
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad.cuda(), ref[name.split(".", 2)[2]].grad)


@needs_two_gpus
def test_pipeline_over_nccl_matches_unpipelined():
    results = launch(cases.equivalence_cuda, 2)
    assert all(r == "ok" for r in results.values())


@needs_two_gpus
@pytest.mark.parametrize("mode", ["never", "always"])
def test_gpipe_copies_between_gpus_on_copy_streams(mode):
    """Activations and gradients cross GPUs on each device's copy stream, and every step
    still equals the unpipelined one (a copy read before it is written, or memory reused
    while a copy reads it, would show as wrong gradients)."""
    reference = mlp().cuda(0)
    pipe = GPipe(copy.deepcopy(reference), [4, 4], devices=["cuda:0", "cuda:1"], chunks=8,
                 checkpoint=mode)  # fmt: skip
    for step in range(3):
        x, y = (t.cuda(0) for t in batch(64, seed=step))
        pipe.zero_grad()
        reference.zero_grad()
        mse_loss(pipe(x), y.cuda(1)).backward()
        mse_loss(reference(x), y).backward()
        ref = dict(reference.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad.cuda(0), ref[name.split(".", 2)[2]].grad)
    assert pipe.workers.copies.devices == {torch.device("cuda", 0), torch.device("cuda", 1)}
