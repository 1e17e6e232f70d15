"""The package's layout holds: imports flow one way between its folders, without cycles, and
the tests mirror its packages.

Layers, from the bottom: schedules, skip and errors (plain data and user decorators); comm
(moving tensors); runtime (a stage's work); parallel (replicas, ties); engine (a step); planning and
splitting (tools that read schedules and costs, and the tracer), data and models (what
scripts feed a pipeline, and the reference models); the facades ``GPipe`` and ``Pipeline``;
training, integrations, view and bench (applications of the facades); cli on top. A module
may import its own layer's or a lower layer's, never a higher one's: the runtime never
reaches the training job or the tools.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "gpipe"

LAYERS = {
    "gpipe.errors": 0,
    "gpipe.schedules": 0,
    "gpipe.skip": 0,
    "gpipe.comm": 1,
    "gpipe.runtime": 2,
    "gpipe.parallel": 3,
    "gpipe.engine": 4,
    "gpipe.planning": 4,
    "gpipe.splitting": 4,
    "gpipe.data": 4,
    "gpipe.models": 4,
    "gpipe.pipe": 5,
    "gpipe.pipeline": 5,
    "gpipe.pipeline_assembly": 5,
    "gpipe.pipeline_config": 5,
    "gpipe.training": 6,
    "gpipe.integrations": 6,
    "gpipe.view": 6,
    "gpipe.bench": 6,
    "gpipe.cli": 7,
}
# The public entry point and torchgpipe's module names: they re-export, nothing imports them.
OUTSIDE = {"gpipe", "gpipe.balance", "gpipe.batchnorm"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _area(module: str) -> str | None:
    """The layer's key of a module: the longest LAYERS entry it is or lies under."""
    for key in sorted(LAYERS, key=len, reverse=True):
        if module == key or module.startswith(key + "."):
            return key
    return None


def _imports(path: Path) -> set[str]:
    """Every gpipe module ``path`` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("gpipe"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gpipe"):
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_every_module_has_a_layer():
    unplaced = [m for m in _modules() if m not in OUTSIDE and _area(m) is None]
    assert not unplaced, f"add these to LAYERS in {__file__}: {unplaced}"


def test_imports_never_go_up_a_layer():
    modules = _modules()
    upward = []
    for module, path in modules.items():
        here = _area(module)
        if here is None:
            continue
        for name in _imports(path):
            there = _area(name)
            if name in modules and there is not None and LAYERS[there] > LAYERS[here]:
                upward.append(f"{module} -> {name}")
    assert not upward, "imports that go up a layer:\n" + "\n".join(sorted(upward))


def test_nothing_in_the_package_imports_its_entry_points():
    """The top-level ``gpipe`` and torchgpipe's module names re-export what lives in the
    layers; a module of the layers imports it from where it lives."""
    modules = _modules()
    found = [
        f"{module} -> {name}"
        for module, path in modules.items()
        if module not in OUTSIDE
        for name in _imports(path)
        if name in OUTSIDE or (name.rpartition(".")[0] in OUTSIDE and name not in modules)
    ]
    assert not found, found


def test_the_folders_import_each_other_without_cycles():
    modules = _modules()
    edges: dict[str, set[str]] = {area: set() for area in LAYERS}
    for module, path in modules.items():
        here = _area(module)
        for name in _imports(path):
            there = _area(name) if name in modules else None
            if here and there and there != here:
                edges[here].add(there)
    done: set[str] = set()

    def visit(area: str, trail: tuple[str, ...]) -> None:
        assert area not in trail, "import cycle: " + " -> ".join((*trail, area))
        if area not in done:
            for nxt in sorted(edges[area]):
                visit(nxt, (*trail, area))
            done.add(area)

    for area in LAYERS:
        visit(area, ())


# The command line and the benchmark harness are read through `gpipe --help` and BENCHMARKS.md:
# the reference covers everything else.
UNREFERENCED = ("gpipe.cli", "gpipe.bench")


def test_the_api_reference_renders_every_library_module():
    reference = SRC.parent / "docs" / "reference"
    rendered = set()
    for page in reference.rglob("*.md"):
        for line in page.read_text().splitlines():
            if line.startswith("::: "):
                rendered.add(line[4:].strip())
    covered = {m for m in rendered if m in _modules()}
    missing = []
    for module in _modules():
        if module.startswith(UNREFERENCED) or module in covered:
            continue
        # A package page renders its modules' public names: a module whose package is on a
        # page and re-exports it (schedules, skip, splitting) is covered there.
        package = module.rsplit(".", 1)[0]
        if package in covered and package in {"gpipe.schedules", "gpipe.skip", "gpipe.splitting"}:
            continue
        missing.append(module)
    assert not missing, f"add these to a page under {reference}: {missing}"


TESTS = SRC.parent / "tests"
# At the top of tests/, beside the helpers that several folders share: the tests of the
# package's top-level modules (the facades GPipe and Pipeline, their promise, torchgpipe's
# names) and of the library as a whole (its layout, public API, README, examples and design
# map).
TOP_LEVEL_TESTS = {
    "test_compat.py",
    "test_cuda.py",
    "test_design_map.py",
    "test_examples.py",
    "test_layout.py",
    "test_pipe.py",
    "test_pipeline.py",
    "test_pipeline_config.py",
    "test_public_api.py",
    "test_readme.py",
    "test_transparency.py",
}


def test_the_tests_mirror_the_packages():
    """A folder of tests per package of src/gpipe (tests/comm for gpipe.comm, ...), each a
    package of its own, and no other test module at the top."""
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == packages, f"missing: {packages - folders}, foreign: {folders - packages}"
    assert not [f for f in folders if not (TESTS / f / "__init__.py").is_file()]
    top = {p.name for p in TESTS.glob("test_*.py")}
    assert top <= TOP_LEVEL_TESTS, (
        f"move into the folder of the package they test: {top - TOP_LEVEL_TESTS}"
    )


# The tests that import a private name of the library, each with its reason.
PRIVATE_IMPORTS_IN_TESTS = {
    # whether an unbalanced pack must refuse depends on first-fit's own row count
    ("tests/data/test_packing.py", "gpipe.data.packing._first_fit_rows"),
    # whether a late-settling step was extended, which its (exact) result cannot show
    ("tests/planning/test_cluster.py", "gpipe.planning.cluster._extended"),
}


def _private_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of each private gpipe name ``path`` imports (``from m import _x``) or
    reads from a module it imported (``import m`` then ``m._x``)."""
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}  # local name -> gpipe module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("gpipe"):
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpipe"):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append((node.module, a.name))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            target = ast.unparse(node.value)
            if target in aliases:
                found.append((aliases[target], node.attr))
    return found


def _package(module: str) -> str:
    """gpipe.engine.runner -> gpipe.engine; a top-level module is a package of its own."""
    return ".".join(module.split(".")[:2])


def test_no_module_reaches_into_another_packages_private_names():
    """A name with a leading underscore is its package's own: another package imports what
    the first exports. Tests too, except those listed with their reason."""
    reached = []
    for module, path in _modules().items():
        for owner, name in _private_imports(path):
            if _package(owner) != _package(module):
                reached.append(f"{module} uses {owner}.{name}")
    assert not reached, reached
    root = TESTS.parent
    in_tests = {
        (str(path.relative_to(root)), f"{owner}.{name}")
        for path in sorted(TESTS.rglob("*.py"))
        for owner, name in _private_imports(path)
    }
    assert in_tests == PRIVATE_IMPORTS_IN_TESTS, in_tests ^ PRIVATE_IMPORTS_IN_TESTS
