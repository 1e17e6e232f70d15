"""Run torchgpipe's own public tests against gpipe, with only the import renamed.

    python scripts/torchgpipe_suite.py /path/to/torchgpipe [-- pytest options]

The path is a checkout of kakaobrain/torchgpipe (only its ``tests/`` folder is read). The
kept test files are copied to a temporary folder, ``torchgpipe`` is renamed to ``gpipe``
in them, and pytest runs them. Left out, because no faithful port can pass them: tests of
torchgpipe's internals (its pipeline, micro-batch, stream, portal and tracker modules), the
GPU-only tests, two tests that use ``pytest.warns(None)`` (an error in current pytest), two
that count torchgpipe's own autograd node names, one DeferredBatchNorm test that breaks on
current PyTorch, and the one that asserts torchgpipe's retired module ``torchgpipe_balancing``
raises an error naming its successor (gpipe never had that module). Nothing from torchgpipe is
committed to this repository.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KEPT = [
    "test_gpipe.py",
    "test_transparency.py",
    "test_inplace.py",
    "test_bugs.py",
    "test_balance.py",
    "test_deferred_batch_norm.py",
    "skip/test_api.py",
    "skip/test_verify_skippables.py",
]

# Module-level imports of torchgpipe internals; the tests that use them are deselected.
DROPPED_IMPORTS = [
    r"from gpipe\.gpipe import verify_module\n",
    r"from gpipe\.balance import balance_by_size, balance_by_time, blockpartition\n",
    r"from gpipe\.balance\.profile import layerwise_sandbox\n",
]
RESTORED_IMPORTS = {
    "test_balance.py": "from gpipe.balance import balance_by_size, balance_by_time\n",
}

DESELECTED = [
    "test_gpipe.py::test_batch_size_indivisible",
    "test_gpipe.py::test_batch_size_small",
    "test_gpipe.py::test_checkpoint_mode",
    "test_gpipe.py::test_checkpoint_eval",
    "test_gpipe.py::test_verify_module_non_sequential",
    "test_gpipe.py::test_verify_module_duplicate_children",
    "test_gpipe.py::test_verify_module_duplicate_parameters_in_distinct_children",
    "test_balance.py::test_blockpartition",
    "test_balance.py::test_blockpartition_zeros",
    "test_balance.py::test_blockpartition_non_positive_partitions",
    "test_balance.py::test_blockpartition_short_sequence",
    "test_balance.py::test_layerwise_sandbox",
    "test_deferred_batch_norm.py::test_input_requiring_grad",
    # asserts that importing torchgpipe_balancing, a name torchgpipe retired, raises an
    # error that names torchgpipe.balance; gpipe never had that module (docs/migration.md)
    "test_balance.py::test_deprecated_gpipe_balancing",  # (the name, renamed)
]


def prepare(source: Path, target: Path) -> None:
    """Copy the kept tests (and the conftest) from ``source/tests`` with the import renamed."""
    tests = source / "tests"
    if not (tests / "test_gpipe.py").is_file():
        raise SystemExit(f"{source} is not a torchgpipe checkout: no tests/test_gpipe.py")
    for name in ["conftest.py", *KEPT]:
        text = (tests / name).read_text().replace("torchgpipe", "gpipe")
        for pattern in DROPPED_IMPORTS:
            text = re.sub(pattern, "", text)
        if name in RESTORED_IMPORTS:
            text = RESTORED_IMPORTS[name] + text
        out = target / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a checkout of kakaobrain/torchgpipe")
    parser.add_argument("pytest_args", nargs="*", help="extra options for pytest (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="torchgpipe-suite-") as tmp:
        target = Path(tmp)
        prepare(args.source, target)
        deselect = [f"--deselect={case}" for case in DESELECTED]
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", tmp]
        command += ["-q", *deselect, *args.pytest_args, "."]
        result = subprocess.run(command, cwd=tmp)
        shutil.rmtree(target / "__pycache__", ignore_errors=True)
        return result.returncode


if __name__ == "__main__":
    sys.exit(main())
