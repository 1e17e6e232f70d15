"""The cluster planner against published runs: each run of ``benchmarks.published_runs``
predicted by ``gpipe plan --cluster ... --json``, beside the figure published, and the time
of ``--search`` for a 1 T model on 3,072 and 4,096 A100s.

    python -m benchmarks.bench_cluster            # ~2 minutes on 2 cores
    python -m benchmarks.bench_cluster --quick    # the four rows issue 43 names only
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from time import perf_counter
from typing import Any

from gpipe.cli import main

from .common import write_results
from .published_runs import RUNS, Run, argv

_1T = argv("--n-layer 128 --d-model 25600 --n-head 160 --vocab-size 51200 --seq-len 2048")


def plan_json(args: list[str]) -> tuple[int, dict[str, Any]]:
    """``gpipe plan ARGS --json``: its exit code and its JSON object."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["plan", *args, "--json"])
    return code, json.loads(out.getvalue())


def predicted(run: Run) -> tuple[float, dict[str, Any]]:
    """The run's figure as predicted (in its metric's unit), and the whole JSON."""
    _, got = plan_json(run.args)
    return got[run.metric], got


def _row(run: Run, value: float, got: dict[str, Any], seconds: float) -> dict[str, Any]:
    ratio = run.ratio(value)
    unit = {"mfu": "%", "step_time_s": " s"}.get(run.metric, "")
    scale = 100 if run.metric == "mfu" else 1
    digits = 2 if run.metric == "step_time_s" else 1
    shown = ".2f" if run.metric == "step_time_s" else "g"
    layout = got["layout"]
    return {
        "name": run.name,
        "metric": run.metric,
        "published": run.published,
        "predicted": value,
        "ratio": ratio,
        "within": abs(ratio - 1) <= run.tolerance,
        "tolerance": run.tolerance,
        "virtual_stages": layout["virtual_stages"],
        "fits": got["fits"],
        "memory_per_gpu_gib": got["memory_per_gpu_gib"],
        "seconds": seconds,
        "command": run.command(),
        "source": run.source,
        "note": run.note,
        "text": f"{run.published * scale:{shown}}{unit} | {value * scale:.{digits}f}{unit}",
    }


def _search_seconds(gpus: int) -> dict[str, Any]:
    start = perf_counter()
    code, got = plan_json(
        [f"--cluster={gpus}xA100-80GB", *_1T, "--global-batch", "3072", "--search"]
    )
    best = got["best"][0]
    return {
        "gpus": gpus,
        "exit_code": code,
        "seconds": perf_counter() - start,
        "searched": got["searched"],
        "fitting": got["fitting"],
        "best": best["layout"],
        "best_step_time_s": best["step_time_s"],
        "best_tflops_per_gpu": best["tflops_per_gpu"],
        "best_memory_per_gpu_gib": best["memory_per_gpu_gib"],
        "train_command": got["train_command"],
    }


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the four rows issue 43 names")
    quick = parser.parse_args().quick
    runs = [r for r in RUNS if r.tolerance < 0.15] if quick else RUNS
    rows = []
    print("| run | published | predicted | ratio | within | v | GiB/GPU |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        start = perf_counter()
        value, got = predicted(run)
        row = _row(run, value, got, perf_counter() - start)
        rows.append(row)
        mark = f"yes (±{run.tolerance:.0%})" if row["within"] else f"no (±{run.tolerance:.0%})"
        print(
            f"| {run.name} | {row['text']} | {row['ratio']:.3f} | {mark} "
            f"| {row['virtual_stages']} | {row['memory_per_gpu_gib']:.1f} |"
        )
    searches = [] if quick else [_search_seconds(g) for g in (3072, 4096)]
    for s in searches:
        print(
            f"--search 1T on {s['gpus']} A100: {s['seconds']:.1f} s, {s['searched']} layouts, "
            f"best {s['best_step_time_s']:.1f} s/step, {s['best_tflops_per_gpu']:.1f} TFLOP/s, "
            f"{s['best_memory_per_gpu_gib']:.1f} GiB"
        )
    results = {"runs": rows, "search": searches}
    path = write_results("cluster-quick" if quick else "cluster", results)
    print(f"written to {path}")


if __name__ == "__main__":
    main_()
