"""Fixtures every test module shares, and the device: the suite
runs on CPU, as CI does, even on a GPU machine (where every process would otherwise take
cuda:LOCAL_RANK). tests/test_cuda.py runs on GPUs with GPIPE_TEST_CUDA=1. W&B runs offline,
into their run folders. Hypothesis sets no deadline on an example."""

import os

import pytest
from hypothesis import settings

if os.environ.get("GPIPE_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks CUDA for its devices
os.environ["WANDB_MODE"] = "offline"  # runs with --report-to wandb write only to their folder

# no deadline per example: on a loaded 2-core machine an example's time says nothing about
# the code, and speed is measured in benchmarks, not asserted in tests
settings.register_profile("gpipe", deadline=None)
settings.load_profile("gpipe")


def pytest_configure(config):
    """In each process that runs tests, PyTorch's threads. xdist's controller runs none and
    imports neither torch nor gpipe: its start is on every run's critical path, before the
    workers start (seven CPU seconds with them)."""
    numprocesses = config.getoption("numprocesses", default=None)
    if not hasattr(config, "workerinput") and numprocesses:
        return
    import torch

    from gpipe.training.launch import threads_per_process

    # Each of xdist's workers is one of the processes that share this machine's cores: its
    # own PyTorch work takes its share of threads, as gpipe.launch gives each process it
    # starts, rather than a thread per core in every worker (threads that then wait on
    # each other).
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(threads_per_process(processes))


@pytest.fixture(autouse=True, scope="session")
def _forkserver_that_imported_the_shared_processes_code():
    """In each of xdist's workers, the forkserver starts before any test launches processes
    of its own (``workers.start_forkserver``). A run without xdist (a few modules, a
    debugger) starts it at its first launch, as a user's program does."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from . import workers

        workers.start_forkserver()


@pytest.fixture(autouse=True, scope="module")
def _shared_processes_last_one_module():
    """The processes ``workers.run`` starts serve the tests of one module, then stop."""
    yield
    from . import workers

    workers.close_all()


@pytest.fixture
def train_on_shared_processes(request):
    """`gpipe train` runs its stages on the module's shared processes (real ones, over gloo)
    rather than starting new ones for every run (however it asks them started); runs that
    restart keep their own, and so do tests that read what the stages print (the shared
    processes write to the streams of the test that started them). A module's own fixtures,
    set up before any test's, run theirs in ``workers.training_on_shared_processes()``."""
    from . import workers

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


# The modules that take longest in a run of the suite, longest first. xdist hands whole modules
# to its workers in collection order (pyproject's --no-loadscope-reorder; by default it would
# hand out the modules with the most tests first, which left the longest, with few tests, to
# the end): these start first and the short ones fill in beside them, rather than one worker
# running a long one alone at the end after the other has finished.
LONGEST_FIRST = (  # seconds in a run on the 2-core machine, setup and teardown included
    "tests/test_examples.py",  # 139
    "tests/training/test_restart.py",  # 67
    "tests/cli/test_train.py",  # 50
    "tests/parallel/test_tensor.py",  # 39
    "tests/engine/test_distributed_schedules.py",  # 33
    "tests/test_pipeline.py",  # 26
    "tests/parallel/test_sharding.py",  # 25
    "tests/view/test_view_browser.py",  # 23
    "tests/training/test_launch.py",  # 19
    "tests/splitting/test_transformers.py",  # 19
    "tests/cli/test_train_tensor_parallel.py",  # 18
    "tests/splitting/test_split.py",  # 15
    "tests/training/test_train_models.py",  # 15
    "tests/bench/test_bench.py",  # 14
    "tests/training/test_checkpoint_safety.py",  # 14
    "tests/integrations/test_transformers.py",  # 10
    "tests/splitting/test_split_pipeline.py",  # 10
    "tests/planning/test_memory.py",  # 10
    "tests/view/test_view_parity.py",  # 9
    "tests/training/test_export.py",  # 8
)


def pytest_collection_modifyitems(items):
    """The modules of LONGEST_FIRST first, in its order; the others after, as collected."""
    order = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.nodeid.split("::")[0], len(order)))
