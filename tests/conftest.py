"""Fixtures every test module shares, the order modules run in, and the device: the suite
runs on CPU, as CI does, even on a GPU machine (where every process would otherwise take
cuda:LOCAL_RANK). tests/test_cuda.py runs on GPUs with GPIPE_TEST_CUDA=1."""

import os

import pytest

if os.environ.get("GPIPE_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks CUDA for its devices

from . import workers

# The modules that take longest (each a minute or so of real processes on two cores) run
# first: the workers (``-n 2 --dist loadfile``: a module at a time) then end on short
# modules and finish together, rather than one waiting on the other's last long module.
LONGEST_FIRST = (
    "test_restart.py",
    "test_cli.py",
    "test_examples.py",
    "test_bench.py",
    "test_distributed_schedules.py",
    "test_distributed.py",
    "test_ties.py",
    "test_view_browser.py",
    "test_transformers.py",
)


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each module's tests keep their order


@pytest.fixture(autouse=True, scope="module")
def _shared_processes_last_one_module():
    """The processes ``workers.run`` starts serve the tests of one module, then stop."""
    yield
    workers.close_all()
