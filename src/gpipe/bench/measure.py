"""What runs inside the benchmark's processes: the timing pass, every contender in turn in
one set of processes, and the memory pass, one contender in fresh processes."""

from __future__ import annotations

import resource
import time
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist

from gpipe.bench.contenders import Contender, Runner, contenders
from gpipe.bench.workloads import get_workload
from gpipe.comm.process_group import init_process_group
from gpipe.planning.memory import ActivationMeter

__all__ = ["build_all", "memory_pass", "timing_pass"]

GROUP_TIMEOUT = 3600.0  # seconds: one-process contenders keep the others at a barrier


def _selected(spec: dict[str, Any]) -> list[Contender]:
    every = contenders(tuple(spec["schedules"]), tuple(spec["modes"]))
    return [c for c in every if c.name in spec["contenders"]]


def _build(c: Contender, spec: dict[str, Any], chunks: int) -> Runner | None:
    """This process's part of ``c``; None where it has none (one-process contenders)."""
    if c.single and dist.get_rank() != 0:
        return None
    workload = get_workload(spec["workload"], spec["size"])
    x, y = workload.data()
    try:
        return c.build(workload, chunks, x, y)
    except Exception as exc:
        raise RuntimeError(
            f"{c.name}, {chunks} micro-batches: {type(exc).__name__}: {exc}"
        ) from exc


def build_all(
    chosen: list[Contender], spec: dict[str, Any], chunks: int
) -> tuple[dict[str, Runner | None], dict[str, str]]:
    """Build every contender in ``chosen`` at ``chunks`` micro-batches, in every process:
    (the runners built, why each of the others failed). A contender that fails to build in
    any process is left out in all of them, so that one library's refusal does not end a
    run of hours; the processes agree on it after each build, as all build in step."""
    runners: dict[str, Runner | None] = {}
    failed: dict[str, str] = {}
    for c in chosen:
        error = None
        try:
            runner = _build(c, spec, chunks)
        except Exception as exc:  # reported in the run's report, not raised
            runner, error = None, str(exc.__cause__ or exc)
            error = f"{type(exc.__cause__ or exc).__name__}: {error}"
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        reasons = [e for e in errors if e is not None]
        if reasons:
            failed[c.name] = "failed to build: " + reasons[0]
        else:
            runners[c.name] = runner
    return runners, failed


def _unavailable(c: Contender) -> str | None:
    """Why ``c`` cannot run here at all (an optional package missing), agreed by all ranks."""
    reason = None
    if c.group == "torchgpipe":
        try:
            import torchgpipe  # noqa: F401
        except ImportError as exc:
            reason = f"not installed ({exc}); pip install torchgpipe"
    return reason


def _step(c: Contender, runner: Runner | None, chunks: int) -> None:
    if runner is None:
        return
    try:
        runner.step()
    except Exception as exc:
        raise RuntimeError(
            f"{c.name}, {chunks} micro-batches: {type(exc).__name__}: {exc}"
        ) from exc


def timing_pass(spec: dict[str, Any]) -> dict[str, Any]:
    """Every contender, one step each in turn, the order rotating every cycle so that drifts
    of the machine hit all alike. Returns, per micro-batch count and contender, this
    process's wall and CPU seconds of every measured step."""
    init_process_group(torch.device("cpu"), GROUP_TIMEOUT)
    rank = dist.get_rank()
    selected = _selected(spec)
    skipped = {c.name: r for c in selected if (r := _unavailable(c)) is not None}
    running = [c for c in selected if c.name not in skipped]
    out: dict[str, Any] = {"skipped": skipped, "chunks": {}}
    for chunks in spec["chunks"]:
        not_run = {c.name: r for c in running if (r := c.not_run_at(chunks)) is not None}
        runners, failed = build_all([c for c in running if c.name not in not_run], spec, chunks)
        if rank == 0:
            for name, why in failed.items():
                print(f"  {spec['workload']}, M={chunks}: {name} {why}", flush=True)
        not_run.update(failed)
        here = [c for c in running if c.name in runners]
        seconds: dict[str, list[float]] = {c.name: [] for c in here}
        cpu: dict[str, list[float]] = {c.name: [] for c in here}
        cycles = spec["warmup"] + spec["repeats"] if here else 0  # none left to time at this M
        for cycle in range(cycles):
            turn = cycle % len(here)
            for c in here[turn:] + here[:turn]:
                dist.barrier()
                cpu_start, start = time.process_time(), time.perf_counter()
                _step(c, runners[c.name], chunks)
                dist.barrier()
                if cycle >= spec["warmup"]:
                    seconds[c.name].append(time.perf_counter() - start)
                    cpu[c.name].append(time.process_time() - cpu_start)
            if rank == 0:
                print(
                    f"  {spec['workload']}, M={chunks}: cycle {cycle + 1}/{cycles} done",
                    flush=True,
                )
        del runners
        out["chunks"][str(chunks)] = {"seconds": seconds, "cpu": cpu, "not_run": not_run}
    return out


def _rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process, from /proc; ru_maxrss where there is none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_pass(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """Contender ``name`` alone in fresh processes: one warm-up step, then one step under
    activation meters (one per stage this process holds). Returns this process's resident
    memory before building and at its peak, and each of its stages' activation peaks."""
    init_process_group(torch.device("cpu"), GROUP_TIMEOUT)
    (c,) = [c for c in _selected(spec) if c.name == name]
    chunks = spec["memory_chunks"]
    start_rss = _rss_bytes("VmRSS")
    runner = _build(c, spec, chunks)
    _step(c, runner, chunks)
    stages: dict[str, dict[str, int]] = {}
    if runner is not None:
        meters = [(stage, ActivationMeter(module)) for stage, module in runner.stages]
        with ExitStack() as stack:
            for _, meter in meters:  # the last one entered also sees the loss's saves
                stack.enter_context(meter)
            _step(c, runner, chunks)
        stages = {str(stage): {"activations": m.peak, "saved": m.saved_peak} for stage, m in meters}
    dist.barrier()  # the peak of every process is read after all have finished
    return {"rss_start": start_rss, "rss_peak": _rss_bytes("VmHWM"), "stages": stages}
