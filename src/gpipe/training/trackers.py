"""Where a run's metrics go besides ``metrics.jsonl`` (``--report-to``): TensorBoard, through
``torch.utils.tensorboard``, and Weights & Biases, through ``wandb``. Each step's record is
logged as it is written to ``metrics.jsonl``, key for key, at the record's step; only the
process that writes ``metrics.jsonl`` reports.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Protocol

from gpipe.errors import ConfigError

__all__ = ["TRACKERS", "Tracker", "check_report_to", "open_trackers", "report_to_names"]

# --report-to's names: the package each needs, and the extra that installs it
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
}


class Tracker(Protocol):
    """One destination of the metrics."""

    def log(self, record: dict[str, Any]) -> None:
        """Log a step's record: every key but ``step``, at ``record["step"]``."""

    def close(self) -> None:
        """Flush what is logged and let go of the destination."""


def report_to_names(value: str) -> list[str]:
    """The trackers ``--report-to value`` names (``none``: none); ConfigError naming the flag
    for anything else."""
    names = [name.strip() for name in value.split(",")]
    if names == ["none"]:
        return []
    if not all(name in TRACKERS for name in names) or len(set(names)) != len(names):
        raise ConfigError(
            f"--report-to must be none or a comma-separated list of {', '.join(TRACKERS)}, "
            f"got {value!r}"
        )
    return names


def check_report_to(value: str) -> None:
    """ConfigError for a tracker ``--report-to value`` names whose package is not installed,
    naming the extra that installs it (checked before any process starts)."""
    for name in report_to_names(value):
        package, extra = TRACKERS[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"--report-to {name} needs the {package} package: "
                f"pip install 'gpipe-parallel[{extra}]'"
            )


def open_trackers(value: str, out: Path, first_step: int, config: dict[str, Any]) -> list[Tracker]:
    """The trackers ``--report-to value`` names, writing under the run folder ``out``; a run
    continued from ``first_step`` drops what an earlier start logged after it (TensorBoard),
    or logs to a new run in the run folder's group (W&B). ``config`` is the run's options."""
    trackers: list[Tracker] = []
    for name in report_to_names(value):
        if name == "tensorboard":
            trackers.append(_TensorBoard(out, first_step))
        else:
            trackers.append(_WandB(out, first_step, config))
    return trackers


class _TensorBoard:
    """Scalars in ``out/tensorboard``, one tag per key of the record."""

    def __init__(self, out: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # steps after first_step that an earlier start logged are hidden, as trim_metrics
        # cuts them from metrics.jsonl
        purge = first_step + 1 if first_step else None
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step":
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """A W&B run named after the run folder, its files in ``out/wandb``; the mode (online,
    offline) and project come from W&B's own settings (``WANDB_MODE``, ``WANDB_PROJECT``,
    default project ``gpipe``)."""

    def __init__(self, out: Path, first_step: int, config: dict[str, Any]) -> None:
        import wandb

        name = out.resolve().name
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "gpipe"),
            dir=str(out),
            name=f"{name} from step {first_step}" if first_step else name,
            group=name,
            config=config,
            settings=wandb.Settings(console="off", silent=bool(config.get("quiet"))),
        )

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self.run.finish()
