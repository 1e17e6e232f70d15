"""docs/design.md is a true map of the code: every module, package and path it names exists,
and every package of src/gpipe (and every module at its top) is on it."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gpipe"
DESIGN = ROOT / "docs" / "design.md"

# ``gpipe.engine.runner``, ``gpipe.schedules.from_csv``: a module or package, or a name in one
DOTTED = re.compile(r"(?<![\w.])gpipe(?:\.[A-Za-z_]\w*)+")
# ``engine/runner.py``, ``training/checkpoints/``, ``view/assets/schedule.js``, ``pipe.py``,
# ``tests/test_layout.py``, ``schedules.md``: relative to src/gpipe, or to the repository
# where they start with one of its folders; guides beside this page by their file name
PATH = re.compile(
    r"(?<![\w*./-])(?:[\w-]+/)+(?:[\w-]+\.(?:py|js|css|html|md|toml|json))?"
    r"|(?<![\w*./-])[\w-]+\.(?:py|md)\b"
)
REPOSITORY_FOLDERS = ("src/", "tests/", "docs/", "examples/", "benchmarks/", "scripts/")


def _text() -> str:
    return DESIGN.read_text()


def _resolve(name: str) -> object:
    """The module, package or name that a dotted ``gpipe....`` name stands for."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(name)


def _path(token: str) -> Path:
    if token.startswith(REPOSITORY_FOLDERS):
        return ROOT / token
    if token.endswith(".md") and "/" not in token:
        return DESIGN.parent / token
    return PACKAGE / token


def _named_paths() -> set[str]:
    return {m.group(0) for m in PATH.finditer(_text())}


def test_every_dotted_name_on_the_map_exists():
    missing = []
    for name in sorted({m.group(0) for m in DOTTED.finditer(_text())}):
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, f"docs/design.md names what does not exist: {missing}"


def test_every_path_on_the_map_exists():
    missing = sorted(token for token in _named_paths() if not _path(token).exists())
    assert not missing, f"docs/design.md names paths that do not exist: {missing}"


def test_every_package_and_top_level_module_is_on_the_map():
    named = {_path(token).resolve() for token in _named_paths()}
    named |= {
        PACKAGE.joinpath(*m.group(0).split(".")[1:]).resolve() for m in DOTTED.finditer(_text())
    }
    rooms = [p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE]
    rooms += [p for p in PACKAGE.glob("*.py")]
    missing = sorted(
        str(room.relative_to(PACKAGE)) for room in rooms if room.resolve() not in named
    )
    assert not missing, f"add these to docs/design.md: {missing}"
