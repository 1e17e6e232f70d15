"""The public API, listed: the names the README, the guides and the examples import, and
torchgpipe's, each found in a real module of the package (no import hook, no alias)."""

import importlib
import subprocess
import sys

import pytest

import gpipe

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

# The modules the README, the guides and the examples name, and what they import from them;
# torchgpipe's module names (gpipe.balance, gpipe.batchnorm, gpipe.skip) among them.
MODULES = {
    "gpipe.balance": ["balance_by_time", "balance_by_size", "balance_by_params"],
    "gpipe.batchnorm": ["DeferredBatchNorm", "convert_deferred_batch_norm"],
    "gpipe.runtime.recompute": ["Layers", "is_checkpointing", "is_recomputing", "CHECKPOINT_MODES"],
    "gpipe.skip": ["skippable", "stash", "pop", "Namespace", "verify_skippables", "find_skips"],
    "gpipe.schedules": [
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
        "traits",
        "build",
        "register",
        "Traits",
        "Placement",
    ],
    "gpipe.planning.simulate": [
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
    "gpipe.planning.memory": ["plan", "profile", "Profile", "MemoryPlan", "ActivationMeter"],
    "gpipe.planning.suggest": ["search"],
    "gpipe.planning.advice": ["bubble", "chunks_advice"],
    "gpipe.runtime.timeline": ["Event", "Recorder", "to_chrome", "plot_gantt"],
    "gpipe.parallel.replicas": ["bucket_size", "shard"],
    "gpipe.models": ["GPTConfig", "build_gpt", "lm_loss", "generate"],
    "gpipe.models.gpt": ["GPTConfig", "build_gpt"],
    "gpipe.models.resnet": ["resnet"],
    "gpipe.pipeline": ["Pipeline", "init_process_group"],
    "gpipe.data": [
        "BatchSampler",
        "ByteDataset",
        "check_packed",
        "counts_of",
        "pack",
        "stdlib_corpus",
    ],
    "gpipe.training.elastic": ["join_process_group"],
    "gpipe.training.launch": ["threads_per_process"],
    "gpipe.runtime.partitions": ["materialize"],
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


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_users_import_is_a_real_module_of_that_name(module):
    loaded = importlib.import_module(module)
    assert loaded.__name__ == module and loaded.__spec__.origin.endswith(".py")


def test_the_packages_users_import_load_first_in_a_fresh_interpreter():
    code = (
        "from gpipe.models.gpt import GPTConfig\n"
        "import gpipe.models\n"
        "assert gpipe.models.GPTConfig is GPTConfig\n"
        "from gpipe.data import pack\n"
        "import gpipe.data.packing\n"
        "assert pack is gpipe.data.packing.pack\n"
        "import gpipe\n"
        "assert callable(gpipe.launch)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        gpipe.nonexistent  # noqa: B018
