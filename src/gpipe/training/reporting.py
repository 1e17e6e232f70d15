"""What a training run shows and logs as it goes: progress, metrics.jsonl (and the trackers of
``--report-to``), peak memory."""

from __future__ import annotations

import json
import resource
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gpipe.training.options import TrainOptions
from gpipe.training.trackers import Tracker, open_trackers

__all__ = ["Reporter", "peak_memory"]


class Reporter:
    """What the user sees (progress bar or plain lines), the metrics log and the trackers of
    ``--report-to``; rank 0 only."""

    def __init__(self, opts: TrainOptions, out: Path, first_step: int, enabled: bool) -> None:
        self.opts, self.enabled = opts, enabled
        self.bar = None
        self.log = None
        self.trackers: list[Tracker] = []
        if not enabled:
            return
        self.log = open(out / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        self.trackers = open_trackers(opts.report_to, out, first_step, asdict(opts))
        if not opts.quiet:
            from tqdm import tqdm

            self.bar = tqdm(total=opts.steps, initial=first_step, unit="step", dynamic_ncols=True)

    def step(self, record: dict[str, Any]) -> None:
        """Log one step's metrics and show them."""
        if not self.enabled:
            return
        assert self.log is not None
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()
        for tracker in self.trackers:
            tracker.log(record)
        shown = {
            "loss": f"{record['loss']:.3f}",
            "tok/s": f"{record['tokens_per_s']:.0f}",
            "bubble": f"{record['bubble']:.0%}",
        }
        if "val_loss" in record:
            shown["val"] = f"{record['val_loss']:.3f}"
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)
        elif record["step"] % 10 == 0 or "val_loss" in record or record["step"] == 1:
            text = " ".join(f"{k} {v}" for k, v in shown.items())
            print(f"step {record['step']}/{self.opts.steps} {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            self.log.close()
        for tracker in self.trackers:
            tracker.close()


def peak_memory(device: torch.device) -> int:
    """The most memory this process has held: allocated on a GPU, resident on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
