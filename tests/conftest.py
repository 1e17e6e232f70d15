"""Fixtures every test module shares, and the device: the suite
runs on CPU, as CI does, even on a GPU machine (where every process would otherwise take
cuda:LOCAL_RANK). tests/test_cuda.py runs on GPUs with GPIPE_TEST_CUDA=1."""

import os

import pytest

if os.environ.get("GPIPE_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks CUDA for its devices

from . import workers


@pytest.fixture(autouse=True, scope="module")
def _shared_processes_last_one_module():
    """The processes ``workers.run`` starts serve the tests of one module, then stop."""
    yield
    workers.close_all()
