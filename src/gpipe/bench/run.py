"""``gpipe bench`` end to end: the timing pass, the memory passes, the report on disk."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpipe.bench.contenders import K, contenders
from gpipe.bench.measure import memory_pass, timing_pass
from gpipe.bench.report import figures, markdown, targets
from gpipe.bench.workloads import get_workload
from gpipe.runtime.recompute import CHECKPOINT_MODES
from gpipe.schedules import SCHEDULES
from gpipe.training.launch import launch

__all__ = ["BenchOptions", "FEWEST_REPEATS", "caveats", "machine", "matches", "run_bench"]

# The house rule for a figure (BENCHMARKS.md): the median of 7 or more alternating repeats.
FEWEST_REPEATS = 7


@dataclass
class BenchOptions:
    workloads: tuple[str, ...] = ("mlp", "gpt", "cnn", "mlp64")
    size: str = "full"  # or "tiny": seconds instead of an hour, to check that it all runs
    chunks: tuple[int, ...] = (1, 2, 4, 8, 16)
    memory_chunks: int | None = 8  # None: no memory pass
    repeats: int = 3
    warmup: int = 1
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    modes: tuple[str, ...] = CHECKPOINT_MODES
    skip: tuple[str, ...] = ()  # contender names (or name prefixes) left out
    threads: int = 1
    out: Path = Path("benchmarks/results")
    plots: bool = True
    command: str = "gpipe bench"
    # "forkserver" starts each pass's processes in a fraction of a second from a server that
    # imported torch and gpipe and ran nothing else, so they are as fresh as spawned ones.
    start_method: str = "forkserver"
    # Memory passes at once: each measures its own processes' peak RSS and saved activations,
    # which other processes do not change, so they need not wait for each other. (With
    # start_method "fork" they run one at a time: a process running agents in threads must
    # not fork.)
    memory_jobs: int = 2
    progress: Callable[[str], None] = field(default=print)


def machine() -> dict[str, Any]:
    """Enough about the machine to read a figure against."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    with contextlib.suppress(ValueError, OSError):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    versions: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        from importlib.metadata import version

        versions["torchgpipe"] = version("torchgpipe")
    except Exception:
        versions["torchgpipe"] = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": None if memory is None else round(memory / 2**30, 1),
        **versions,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
    }


def matches(name: str, pattern: str) -> bool:
    """Whether contender ``name`` is ``pattern`` or lies under it ("pytorch" matches
    "pytorch/Schedule1F1B")."""
    return name == pattern or name.startswith(pattern.rstrip("/") + "/")


def caveats(options: BenchOptions, cores: int | None = None) -> list[str]:
    """What makes this run's figures weaker than BENCHMARKS.md's, each in one line: fewer
    repeats than its medians take, more threads than the machine has cores (``cores``: by
    default this machine's)."""
    notes = []
    if options.repeats < FEWEST_REPEATS:
        notes.append(
            f"{options.repeats} measured step(s) per contender: a figure is the median of "
            f"{FEWEST_REPEATS} or more in BENCHMARKS.md, so read these as a check that it "
            f"runs, not as measurements (--repeats {FEWEST_REPEATS})"
        )
    cores = os.cpu_count() if cores is None else cores
    wanted = K * options.threads
    if cores is not None and wanted > cores:
        notes.append(
            f"{K} processes of {options.threads} thread(s) each want {wanted} cores, but this "
            f"machine has {cores}: the processes take turns, and the times measure that"
        )
    return notes


def _memory_passes(
    workload: str, spec: dict[str, Any], names: list[str], options: BenchOptions
) -> dict[str, list[dict[str, Any]]]:
    """Each contender's memory pass in fresh processes, ``options.memory_jobs`` at a time;
    contender -> its processes' figures by rank, in the order of ``names``."""

    def one(name: str) -> list[dict[str, Any]]:
        per_rank = launch(
            memory_pass,
            K,
            (spec, name),
            threads=options.threads,
            start_method=options.start_method,
        )
        peak = max(r["rss_peak"] for r in per_rank.values()) / 2**20
        options.progress(f"{workload}: memory of {name}: peak RSS {peak:.0f} MiB")
        return [per_rank[r] for r in range(K)]

    jobs = 1 if options.start_method == "fork" else max(1, options.memory_jobs)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


def run_bench(options: BenchOptions) -> dict[str, Any]:
    """Run every pass, write ``bench.json``, ``bench.md`` and the plots into
    ``options.out``, and return the report."""
    say = options.progress
    options.out.mkdir(parents=True, exist_ok=True)  # before hours of measuring, not after
    for note in caveats(options):
        say(f"note: {note}")
    chosen = [
        c
        for c in contenders(options.schedules, options.modes)
        if not any(matches(c.name, s) for s in options.skip)
    ]
    for needed, what in (("at-once", "ideal"), ("accumulation", "naive ideal")):
        if needed not in {c.name for c in chosen}:
            say(f"note: without {needed} there is no {what}")
    spec_base = {
        "size": options.size,
        "chunks": list(options.chunks),
        "memory_chunks": options.memory_chunks,
        "repeats": options.repeats,
        "warmup": options.warmup,
        "schedules": list(options.schedules),
        "modes": list(options.modes),
        "contenders": [c.name for c in chosen],
    }
    results: dict[str, Any] = {}
    for name in options.workloads:
        workload = get_workload(name, options.size)
        spec = {**spec_base, "workload": name}
        say(f"{name}: {workload.description}")
        say(
            f"{name}: timing {len(chosen)} contenders at M = "
            f"{', '.join(map(str, options.chunks))}, {options.warmup} + {options.repeats} "
            "steps each"
        )
        started = time.perf_counter()
        per_rank = launch(
            timing_pass, K, (spec,), threads=options.threads, start_method=options.start_method
        )
        timing = [per_rank[r] for r in range(K)]
        say(f"{name}: timing done in {time.perf_counter() - started:.0f} s")
        memory: dict[str, list[dict[str, Any]]] = {}
        if options.memory_chunks is not None:
            timed = timing[0]["chunks"].get(str(options.memory_chunks), {})
            measured = [
                c.name
                for c in chosen
                if c.name not in timing[0]["skipped"]
                and c.name not in timed.get("not_run", {})
                and c.not_run_at(options.memory_chunks) is None
            ]
            memory = _memory_passes(name, spec, measured, options)
        results[name] = figures(
            workload, chosen, timing, memory, list(options.chunks), options.memory_chunks
        )
    report = {
        "command": options.command,
        "machine": machine(),
        "settings": {
            "processes": K,
            "threads": options.threads,
            "size": options.size,
            "repeats": options.repeats,
            "warmup": options.warmup,
            "chunks": list(options.chunks),
            "memory_chunks": options.memory_chunks,
        },
        "caveats": caveats(options),
        "workloads": results,
        "targets": targets(results, options.memory_chunks),
    }
    _write(report, options)
    return report


def _write(report: dict[str, Any], options: BenchOptions) -> None:
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "bench.md").write_text(markdown(report))
    report["files"] = [str(out / "bench.json"), str(out / "bench.md")]
    if options.plots:
        from gpipe.bench.plots import plot_memory, plot_step_times

        for name, w in report["workloads"].items():
            report["files"].append(str(plot_step_times(w, out / f"bench-{name}-step-time.png")))
            if w["memory"]:
                report["files"].append(str(plot_memory(w, out / f"bench-{name}-memory.png")))
