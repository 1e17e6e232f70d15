"""What every benchmark shares: a description of the machine, summary statistics, results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpipe.bench.report import summary
from gpipe.bench.run import machine

__all__ = ["RESULTS", "machine", "summary", "write_results"]

RESULTS = Path(__file__).parent / "results"


def write_results(name: str, results: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path
