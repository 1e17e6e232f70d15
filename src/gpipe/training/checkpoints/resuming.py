"""Continuing a run: which checkpoint every rank starts from, and the metrics log cut to it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from gpipe.comm.agreement import on_first_rank
from gpipe.training.checkpoints.format import (
    checkpoint_dirs,
    discard_partial,
    latest_checkpoint,
    verify_checkpoint,
)

__all__ = [
    "RUN_OUTPUTS",
    "NothingToResume",
    "check_outputs_unlinked",
    "continuing_line",
    "resume_point",
    "trim_metrics",
]

RUN_OUTPUTS = (
    "metrics.jsonl",
    "sample.txt",
    "trace.json",
    "bubble.json",
    "view.html",
    "timeline.png",
)
"""The files a run writes at the top of its folder, again when it is continued."""


class NothingToResume(FileNotFoundError):
    """``--resume`` of a run none of whose checkpoints verifies (each was warned of)."""


def resume_point(
    out: Path, required: bool, restarted: bool, verified: str | None = None
) -> Path | None:
    """The checkpoint to continue from, the same for every rank: rank 0 clears what unfinished
    saves left and takes the newest checkpoint that verifies (warning of each newer one that
    does not), unless the launching command has just verified one (``verified``, its name:
    taken on the first start, not after a restart). None for a new run, or a restarted one
    that has no good checkpoint yet."""
    if not (required or restarted):
        return None
    root = out / "checkpoints"

    def choose() -> str | None:
        discard_partial(root)
        if verified is not None and not restarted:
            return verified
        path = latest_checkpoint(root, run=True)
        return None if path is None else path.name

    choice = on_first_rank(choose, None, "choosing the checkpoint to continue from")
    if choice is None:
        if required and not restarted:
            raise NothingToResume(f"no checkpoint in {root} verifies; nothing to resume from")
        return None
    return root / choice


def continuing_line(out: Path) -> str:
    """What a run that failed or was stopped leaves to continue from, for its error: its
    newest complete checkpoint (sizes checked; a resume checks the rest) and the command."""
    for path in reversed(checkpoint_dirs(out / "checkpoints")):
        if not verify_checkpoint(path, checksums=False):
            return f"newest complete checkpoint: {path}; gpipe train --resume {out} continues"
    return f"no checkpoint of {out} was completed: the run would start again from step 0"


def check_outputs_unlinked(out: Path) -> None:
    """ValueError, naming it, if a file the run writes in ``out`` is a link: a run folder may
    come from someone else, and continuing it would write through the link, over a file
    outside the folder."""
    for name in RUN_OUTPUTS:
        path = out / name
        if path.is_symlink():
            raise ValueError(
                f"--resume {out}: {path} is a link to {os.readlink(path)}, and the run would "
                "write through it; a run writes its files in its own folder: remove the link"
            )


def trim_metrics(path: Path, step: int) -> None:
    """Keep the metrics of steps up to ``step``: a restarted run logs the steps after its
    checkpoint again, so its log reads as one uninterrupted run's."""
    if not path.is_file():
        return
    text = path.read_bytes().decode(errors="replace")  # a line cut mid-character too
    kept = [line for line in text.splitlines() if _step_of(line) <= step]
    temporary = path.with_name(f".{path.name}.tmp")  # renamed, so the log is never half gone
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)


def _step_of(line: str) -> float:
    """The step a metrics line is of; infinite for a line cut short by a lost process (or
    any other line that names no whole step)."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
    return step if isinstance(step, int) and not isinstance(step, bool) else math.inf
