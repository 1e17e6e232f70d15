"""Fixtures every test module shares, and the device: the suite
runs on CPU, as CI does, even on a GPU machine (where every process would otherwise take
cuda:LOCAL_RANK). tests/test_cuda.py runs on GPUs with GPIPE_TEST_CUDA=1. W&B runs offline,
into their run folders."""

import os

import pytest

if os.environ.get("GPIPE_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks CUDA for its devices
os.environ["WANDB_MODE"] = "offline"  # runs with --report-to wandb write only to their folder

from . import workers


@pytest.fixture(autouse=True, scope="module")
def _shared_processes_last_one_module():
    """The processes ``workers.run`` starts serve the tests of one module, then stop."""
    yield
    workers.close_all()


@pytest.fixture
def train_on_shared_processes(request):
    """`gpipe train` runs its stages on the module's shared processes (real ones, over gloo)
    rather than starting new ones for every run (however it asks them started); runs that
    restart keep their own, and so do tests that read what the stages print (the shared
    processes write to the streams of the test that started them). A module's own fixtures,
    set up before any test's, run theirs in ``workers.training_on_shared_processes()``."""
    with workers.training_on_shared_processes(own="capfd" in request.fixturenames):
        yield


@pytest.fixture(scope="module")
def one_process_group():
    """A world of this one process (gloo, an in-memory store), for the collaborators that need
    torch.distributed but no peer: a transport or a step runner whose stages all sit here."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()
