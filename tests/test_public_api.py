"""The public API, listed: the names the README, the guides and the examples import, and
torchgpipe's, each found in a real module of the package (no import hook, no alias)."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpipe

TOP_LEVEL = {
    "BalanceError",
    "ConfigError",
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


# The packages whose __init__ is their public surface: what the guides, the examples and the
# benchmarks import from them (checked below against every import those files make).
PACKAGES = (
    "gpipe.bench",
    "gpipe.comm",
    "gpipe.data",
    "gpipe.engine",
    "gpipe.models",
    "gpipe.parallel",
    "gpipe.planning",
    "gpipe.runtime",
    "gpipe.schedules",
    "gpipe.skip",
    "gpipe.splitting",
    "gpipe.training",
    "gpipe.view",
)
USER_FILES = (
    Path("README.md"),
    *Path("docs").glob("*.md"),
    *Path("examples").glob("*.py"),
    *Path("benchmarks").glob("*.py"),
)


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_exports_its_public_names_from_its_init(package):
    loaded = importlib.import_module(package)
    assert loaded.__spec__.origin.endswith("__init__.py")
    missing = [name for name in loaded.__all__ if not hasattr(loaded, name)]
    assert not missing, f"{package}.__all__ names what it lacks: {missing}"
    private = [name for name in loaded.__all__ if name.startswith("_")]
    assert not private, private


def test_the_guides_import_what_a_package_exports_from_the_package():
    """A name the README, a guide, an example or a benchmark imports from a module of one of
    PACKAGES, that package's __init__ also exports, is imported from the package."""
    root = Path(__file__).resolve().parents[1]
    found = re.compile(
        r"^\s*from (gpipe\.[a-z_]+)\.[a-z_.]+ import (\([^)]*\)|[A-Za-z_, ]+$)", re.M
    )
    deeper = []
    for path in USER_FILES:
        for package, names in found.findall((root / path).read_text()):
            if package not in PACKAGES:
                continue
            exported = set(importlib.import_module(package).__all__)
            named = {name.strip(" \n()") for name in names.split(",")} & exported
            if named:
                deeper.append(f"{path}: from {package}.... import {sorted(named)}")
    assert not deeper, "\n".join(deeper)


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
