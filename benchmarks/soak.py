"""A long run hurt on purpose: ``gpipe train`` under ``--max-restarts`` while a rank is killed
at random every few hundred steps and one checkpoint write is interrupted, beside the same
run left alone.

It reports the steps done, the restarts, the loss curve against the uninterrupted run's,
every worker process's resident memory over time and the disk the checkpoints use over
time, and judges them: every kill recovered, the same loss at every step, each process's
memory flat after warm-up (within 5 %), the checkpoints on disk bounded by ``--keep``, every
restart continued from a finished checkpoint. tests/training/test_restart.py runs a short one.

    python -m benchmarks.soak                          # 3,000 steps, a kill every 300-500
    python -m benchmarks.soak --steps 600 --every 150  # a shorter one
    python -m benchmarks.soak --save-writer process    # checkpoints by helper processes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import machine, write_results

# The tiny GPT, 2 stages: a step takes tens of milliseconds, so thousands of steps and a
# dozen restarts fit in minutes.
TRAIN = [
    "--preset", "tiny", "--stages", "2", "--batch-size", "8", "--seq-len", "32", "--chunks", "4",
    "--lr", "1e-2", "--warmup", "20", "--quiet", "--balance", "even", "--timeout", "10",
    "--threads", "1", "--sample-tokens", "16",
]  # fmt: skip
RESTARTED = re.compile(r"restarted (?:from (\S+): training from step (\d+)|with no checkpoint)")
FLAT = 1.05  # a process's memory late in its life against early on, after warm-up


def plan_kills(steps: int, every: int, save_every: int, ranks: int, seed: int, flags: Path
               ) -> list[dict[str, Any]]:  # fmt: skip
    """A kill of a random rank at a random step in each stretch of about ``every`` steps,
    and one of rank 0 as it writes a checkpoint in the middle of the run; each fires once."""
    rng = random.Random(seed)
    kills, step = [], 0
    while True:
        step += rng.randint(every * 3 // 4, every * 5 // 4)
        if step >= steps:
            break
        kills.append({"rank": rng.randrange(ranks), "step": step, "at": "step"})
    saved = max(save_every, (steps // 2) // save_every * save_every)
    kills.append({"rank": 0, "step": saved, "at": "save"})
    for i, kill in enumerate(kills):
        kill["once"] = str(flags / f"kill-{i}")
    return kills


def _children(root: int) -> list[int]:
    """The processes below ``root``, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(text.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _worker_rss(root: int) -> dict[int, int]:
    """Resident bytes of each stage process under ``root`` (the spawned workers)."""
    rss = {}
    for pid in _children(root):
        try:
            if b"spawn_main" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        kb = re.search(r"VmRSS:\s+(\d+) kB", status)
        if kb:
            rss[pid] = int(kb.group(1)) * 1024
    return rss


def _disk(folder: Path) -> tuple[int, int]:
    """Bytes under ``folder`` and the checkpoint folders in it (finished or partial)."""
    if not folder.is_dir():
        return 0, 0
    total = folders = 0
    for entry in folder.iterdir():
        folders += entry.is_dir()
        for file in entry.rglob("*"):
            with contextlib.suppress(OSError):  # removed while counted: pruned or renamed
                total += file.stat().st_size if file.is_file() else 0
    return total, folders


@dataclass
class Run:
    """One ``gpipe train`` command and what was sampled while it ran."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    samples: list[dict[str, Any]] = field(default_factory=list)


def train(out: Path, args: list[str], kills: list[dict] | None = None, *,
          interval: float = 0.5, timeout: float = 3600) -> Run:  # fmt: skip
    """Run ``gpipe train`` into ``out``, sampling its workers' memory and its checkpoints'
    disk use every ``interval`` seconds."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    if kills:
        env["GPIPE_TEST_KILL"] = json.dumps(kills)
    command = [sys.executable, "-m", "gpipe.cli", "train", *args, "--out", str(out)]
    started = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    samples: list[dict[str, Any]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval):
            size, folders = _disk(out / "checkpoints")
            samples.append(
                {
                    "t": time.monotonic() - started,
                    "rss": _worker_rss(process.pid),
                    "disk_bytes": size,
                    "checkpoints": folders,
                }
            )

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        done.set()
        process.kill()
    sampler.join()
    return Run(process.returncode, stdout, stderr, time.monotonic() - started, samples)


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def _memory(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Each worker process's peak, and its growth: the median of the last quarter of its
    samples over the median of the second (the first quarter is start-up and warm-up)."""
    series: dict[int, list[int]] = {}
    for s in samples:
        for pid, rss in s["rss"].items():
            series.setdefault(pid, []).append(rss)
    found = {}
    for pid, values in series.items():
        quarter = len(values) // 4
        growth = (
            statistics.median(values[-quarter:]) / statistics.median(values[quarter : 2 * quarter])
            if quarter >= 2
            else None
        )
        found[str(pid)] = {"samples": len(values), "peak": max(values), "growth": growth}
    return found


def judge(run: Run, out: Path, alone: Run | None, reference: Path, kills: list[dict],
          keep: int) -> dict[str, Any]:  # fmt: skip
    """The soak's figures and verdicts (each ``ok_*`` must be true). Memory is judged on the
    uninterrupted run's processes, which live the whole run (each flat after warm-up), and
    on the hurt run's, which live between kills (none above the uninterrupted run's peak);
    without ``alone`` (a run too short to judge memory by), it is not judged."""
    ours, theirs = losses(out), losses(reference)
    restarts = RESTARTED.findall(run.stdout)
    memory, steady = _memory(run.samples), _memory(alone.samples if alone else [])
    growths = [m["growth"] for m in steady.values() if m["growth"] is not None]
    peak = max((m["peak"] for m in steady.values()), default=0)
    folders = max((s["checkpoints"] for s in run.samples), default=0)
    verdict = {
        "steps": max(ours, default=0),
        "restarts": len(restarts),
        "resumed_from": [int(step) if path else 0 for path, step in restarts],
        "seconds": run.seconds,
        "max_checkpoint_folders": folders,
        "max_disk_bytes": max((s["disk_bytes"] for s in run.samples), default=0),
        "memory": memory,
        "memory_alone": steady,
        "ok_finished": run.returncode == 0 and max(ours, default=0) == max(theirs),
        "ok_every_kill_recovered": len(restarts) == len(kills),
        "ok_same_losses": ours == theirs,
        # the newest --keep, one being written beside them, and nothing else
        "ok_disk_bounded": folders <= keep + 1,
        "ok_finished_checkpoints_only": all(
            re.fullmatch(r"step-\d{6}", Path(path).name) for path, _ in restarts if path
        ),
    }
    if alone is not None:
        verdict["ok_memory_flat"] = bool(growths) and all(g <= FLAT for g in growths)
        verdict["ok_memory_after_restarts"] = all(m["peak"] <= FLAT * peak for m in memory.values())
    return verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=400, help="steps between kills, about")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--save-writer",
        choices=["auto", "process", "thread"],
        default="auto",
        help="gpipe train's: what writes the checkpoints in the background",
    )
    args = parser.parse_args()
    common = [*TRAIN, "--steps", str(args.steps), "--save-every", str(args.save_every),
              "--keep", str(args.keep), "--eval-every", str(args.save_every),
              "--save-writer", args.save_writer]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        kills = plan_kills(args.steps, args.every, args.save_every, 2, args.seed, Path(tmp))
        hurt = train(Path(tmp) / "hurt", [*common, "--max-restarts", str(len(kills))], kills)
        alone = train(Path(tmp) / "alone", common)
        assert alone.returncode == 0, alone.stderr[-3000:]
        verdict = judge(hurt, Path(tmp) / "hurt", alone, Path(tmp) / "alone", kills, args.keep)
        series = {"hurt": hurt.samples, "alone": alone.samples}
    print(
        f"{verdict['steps']} steps in {verdict['seconds']:.0f} s (alone: {alone.seconds:.0f} s)"
        f", {verdict['restarts']} restarts for {len(kills)} kills, resumed from "
        f"{verdict['resumed_from']}"
    )
    print(
        f"checkpoints on disk: at most {verdict['max_checkpoint_folders']} folders, "
        f"{verdict['max_disk_bytes'] / 2**20:.1f} MiB"
    )
    for run in ("memory_alone", "memory"):
        for pid, m in verdict[run].items():
            growth = "n/a" if m["growth"] is None else f"{m['growth']:.3f}"
            print(
                f"{'alone' if run == 'memory_alone' else 'hurt'} process {pid}: "
                f"{m['samples']} samples, peak {m['peak'] / 2**20:.0f} MiB, "
                f"late / early {growth}"
            )
    for key, value in verdict.items():
        if key.startswith("ok_"):
            print(f"{key[3:]}: {'yes' if value else 'NO'}")
    path = write_results(
        "soak",
        {
            "machine": machine(),
            "args": vars(args),
            "kills": kills,
            "verdict": verdict,
            "samples": series,
        },
    )
    print(f"written to {path}")
    sys.exit(0 if all(v for k, v in verdict.items() if k.startswith("ok_")) else 1)


if __name__ == "__main__":
    main()
