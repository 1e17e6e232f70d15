"""How long the simulator takes on internet-size pipelines (K = 128, M = 1024).

python -m benchmarks.bench_simulate        # writes benchmarks/results/simulate.json
"""

from __future__ import annotations

import json
import statistics
from time import perf_counter

from gpipe.planning import Costs
from gpipe.planning.simulate import simulate
from gpipe.schedules import SCHEDULES, interleaved

from .common import machine, summary, write_results

K, M, REPEATS = 128, 1024, 5


def main() -> None:
    costs = Costs(forward=1.0, backward=1.0, weight=1.0)
    report = {"machine": machine(), "stages": K, "microbatches": M, "seconds": {}}
    for name, generator in SCHEDULES.items():
        fn = generator.__wrapped__ if hasattr(generator, "__wrapped__") else generator
        schedule = interleaved(2 * K, M, K) if name == "interleaved" else fn(K, M)
        actions = sum(map(len, schedule.programs))
        times = []
        for _ in range(REPEATS):
            start = perf_counter()
            simulate(schedule, costs)
            times.append(perf_counter() - start)
        report["seconds"][name] = summary(times) | {"actions": actions}
        print(f"{name:12s} {actions:9,d} actions  {statistics.median(times):.3f} s", flush=True)
    path = write_results("simulate", report)
    print(json.dumps(report["seconds"]))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
