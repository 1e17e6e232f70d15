"""``gpipe bench``: workloads, the contenders timed side by side on them, the measurement, and
the report with its targets and plots."""

from gpipe.bench.report import summary, targets
from gpipe.bench.run import BenchOptions, machine, run_bench

__all__ = ["BenchOptions", "machine", "run_bench", "summary", "targets"]
