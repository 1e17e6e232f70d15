"""The public API, listed: the names the README, the guides and the examples import, and
torchgpipe's, each found in a real module of the package (no import hook, no alias)."""

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import FunctionType

import pytest

import gpipe

TOP_LEVEL = {
    "BalanceError",
    "ConfigError",
    "GPipe",
    "LaunchError",
    "MovingDenied",
    "Pipeline",
    "PipelineConfig",
    "PipelineError",
    "StageError",
    "is_checkpointing",
    "is_recomputing",
    "launch",
    "split",
}

# Modules users reach by name, and what they hold: torchgpipe's (gpipe.balance, gpipe.batchnorm,
# gpipe.skip), the packages, and the modules the guides name by path.
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
    "gpipe.pipeline": ["Pipeline", "PipelineConfig"],
    "gpipe.pipeline_config": ["PipelineConfig"],
    "gpipe.comm": ["init_process_group", "rank_device"],
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
# Older names that are their modules' names too, kept because users call them as the package's
# attributes: each schedule generator (gpipe.schedules.interleaved(...)), and torchgpipe's
# skippable. Their modules are reached through sys.modules or the generator's __module__.
NAMED_AS_THEIR_MODULES = {
    "gpipe.schedules": {"interleaved", "looped_bfs", "one_f_one_b", "seq_chunked", "validate"},
    "gpipe.skip": {"skippable"},
}
ROOT = Path(__file__).resolve().parents[1]
USER_FILES = sorted(
    [
        ROOT / "README.md",
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("examples/*.py"),
        *ROOT.glob("benchmarks/*.py"),
    ]
)
# from gpipe.<package>.<module> import names: one line (a comment may follow) or in parentheses
IMPORT = re.compile(r"^\s*from (gpipe\.[a-z_]+)(\.[a-z_0-9.]+) import (\([^)]*\)|[^(\n]+)$", re.M)


def _imported_names(names: str) -> list[str]:
    """The names an import binds from, as they are in the module (``x as y`` is ``x``)."""
    found = []
    for line in names.strip("()").splitlines():
        for part in line.split("#")[0].split(","):
            if part.strip():
                found.append(part.split()[0])
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_exports_its_public_names_from_its_init(package):
    loaded = importlib.import_module(package)
    missing = [name for name in loaded.__all__ if not hasattr(loaded, name)]
    assert not missing, f"{package}.__all__ names what it lacks: {missing}"
    foreign = [
        name
        for name in loaded.__all__
        if isinstance(getattr(loaded, name), (type, FunctionType))
        and not getattr(loaded, name).__module__.startswith("gpipe")
    ]
    assert not foreign, f"{package} exports what gpipe did not define: {foreign}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_exported_name_is_also_a_submodule_of_its_package(package):
    """Importing a submodule sets the package attribute of its name to the module, so an
    export named as a submodule would be the function or the module depending on what was
    imported before."""
    loaded = importlib.import_module(package)
    submodules = {info.name for info in pkgutil.iter_modules(loaded.__path__)}
    assert set(loaded.__all__) & submodules == NAMED_AS_THEIR_MODULES.get(package, set())


def test_the_guides_import_what_a_package_exports_from_the_package():
    """A name the README, a guide, an example or a benchmark imports from a module of one of
    PACKAGES, and that package's __init__ also exports (the same object), is imported from
    the package."""
    assert len(USER_FILES) > 20, USER_FILES
    deeper = []
    for path in USER_FILES:
        for package, module, names in IMPORT.findall(path.read_text()):
            if package not in PACKAGES:
                continue
            exported = importlib.import_module(package)
            source = importlib.import_module(package + module)
            same = [
                name
                for name in _imported_names(names)
                if name in exported.__all__
                and getattr(exported, name) is getattr(source, name, None)
            ]
            if same:
                where = path.relative_to(ROOT)
                deeper.append(f"{where}: from {package}{module} import {same}")
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
        "gpipe.balance.balance_by_time, gpipe.batchnorm.DeferredBatchNorm, gpipe.skip.stash\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        gpipe.nonexistent  # noqa: B018
