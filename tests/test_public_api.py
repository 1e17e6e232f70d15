"""The public API, listed: what users import keeps working, under its old names too.

The package moved from a flat layout into folders by concern; the names users import, the
top-level ones and the modules the guides name, stay until a major version. An old module
name gives the very module that now holds it, so its classes, private helpers and
monkeypatching behave as before.
"""

import importlib
import subprocess
import sys
import warnings

import pytest

import gpipe
from gpipe import _moved

TOP_LEVEL = {
    "BalanceError",
    "GPipe",
    "LaunchError",
    "MovingDenied",
    "Pipeline",
    "PipelineError",
    "StageError",
    "is_checkpointing",
    "is_recomputing",
    "launch",
    "split",
}

# The modules the README, the guides and the examples name, and what they import from them.
MODULES = {
    "gpipe.balance": ["balance_by_time", "balance_by_size", "balance_by_params"],
    "gpipe.batchnorm": ["DeferredBatchNorm", "convert_deferred_batch_norm"],
    "gpipe.checkpointing": ["Layers", "is_checkpointing", "is_recomputing", "CHECKPOINT_MODES"],
    "gpipe.skip": ["skippable", "stash", "pop", "Namespace", "verify_skippables", "find_skips"],
    "gpipe.schedule": [
        "Action",
        "Kind",
        "Schedule",
        "ScheduleError",
        "SCHEDULES",
        "get_schedule",
        "validate",
        "execution_order",
        "gpipe",
        "one_f_one_b",
        "zero_bubble_h1",
        "interleaved",
        "forward_only",
        "add_skips",
        "add_recompute",
    ],
    "gpipe.schedules": ["traits", "build", "register", "Traits", "Placement"],
    "gpipe.simulate": [
        "Costs",
        "SimResult",
        "simulate",
        "analytic_bubble",
        "closed_form_bubble",
        "closed_form_peak",
        "scenario",
        "compare",
        "predict",
        "measured_costs",
    ],
    "gpipe.memory": ["plan", "profile", "Profile", "MemoryPlan", "ActivationMeter"],
    "gpipe.suggest": ["search"],
    "gpipe.advice": ["bubble", "chunks_advice"],
    "gpipe.trace": ["Event", "Recorder", "to_chrome", "plot_gantt"],
    "gpipe.replicas": ["bucket_size", "shard"],
    "gpipe.models": ["GPTConfig", "build_gpt", "lm_loss", "generate"],
    "gpipe.models.gpt": ["GPTConfig", "build_gpt"],
    "gpipe.models.resnet": ["resnet"],
    "gpipe.distributed": ["Pipeline", "init_process_group"],
    "gpipe.data": [
        "BatchSampler",
        "ByteDataset",
        "check_packed",
        "counts_of",
        "pack",
        "stdlib_corpus",
    ],
    "gpipe.elastic": ["join_process_group"],
    "gpipe.partition": ["materialize"],
    "gpipe.view": ["Measured", "Settings", "write"],
    "gpipe.splitting": ["SplitModel", "split"],
}


def test_the_top_level_names_are_the_public_api():
    assert set(gpipe.__all__) == TOP_LEVEL
    for name in TOP_LEVEL:
        assert getattr(gpipe, name) is not None
    assert callable(gpipe.launch)  # the function, not the module of the same name


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_modules_users_import_have_their_names(module):
    loaded = importlib.import_module(module)
    missing = [name for name in MODULES[module] if not hasattr(loaded, name)]
    assert not missing, f"{module} lacks {missing}"


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_module_name_is_the_module_that_now_holds_it(old):
    assert importlib.import_module(old) is importlib.import_module(_moved.MOVED[old])


def test_old_names_work_as_attributes_and_in_a_fresh_interpreter():
    code = (
        "import gpipe\n"
        "assert gpipe.simulate.simulate is gpipe.planning.simulate.simulate\n"
        "from gpipe.models.gpt import GPTConfig\n"
        "from gpipe.training.models.gpt import GPTConfig as Same\n"
        "assert GPTConfig is Same\n"
        "import gpipe.launch\n"
        "assert callable(gpipe.launch) and gpipe.launch is gpipe.training.launch.launch\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        gpipe.nonexistent  # noqa: B018


def test_the_old_names_raise_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for old in _moved.MOVED:
            importlib.import_module(old)
