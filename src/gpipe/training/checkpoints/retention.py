"""Which checkpoints a run keeps: the newest few that verify, and milestones kept for good, so
that a run of weeks does not fill its disk and never loses its last good checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpipe.training.checkpoints.format import checkpoint_dirs, remove_folder, verify_checkpoint

__all__ = ["Retention", "prune_checkpoints"]


@dataclass(frozen=True)
class Retention:
    """``keep``: how many of the newest verified checkpoints stay (at least 1; None keeps all).
    ``keep_every``: checkpoints at multiples of this many steps stay for good (0: none)."""

    keep: int | None = 3
    keep_every: int = 0

    def __post_init__(self) -> None:
        if self.keep is not None and (isinstance(self.keep, bool) or self.keep < 1):
            raise ValueError(
                f"keep must be a positive number of checkpoints or None, got {self.keep!r}"
            )
        if isinstance(self.keep_every, bool) or self.keep_every < 0:
            raise ValueError(f"keep_every must be a number of steps >= 0, got {self.keep_every!r}")

    def pinned(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` is a milestone, never removed."""
        return self.keep_every > 0 and step % self.keep_every == 0


def _step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def prune_checkpoints(
    root: Path, retention: Retention, *, checksums: bool = False, written: Path | None = None
) -> list[Path]:
    """Remove the checkpoints under ``root`` that ``retention`` no longer keeps; returns them.

    Kept: milestones; the newest ``keep`` that verify (sizes only unless ``checksums``: each
    was checked in full when it was written); and any damaged one newer than the newest good
    one, for people to look at. Removed: the other good ones, and damaged ones older than the
    newest good one, which a resume would never choose. With no good checkpoint, nothing is
    removed. ``written``, the checkpoint just saved: any newer one is one a resume skipped
    as damaged (a run goes on from its newest good checkpoint), whatever its sizes say, so
    it is kept for people to look at and never counted as good. Call it on one process,
    while no save is renaming a folder into place.
    """
    if retention.keep is None:
        return []
    found = checkpoint_dirs(root)
    last = _step(written) if written is not None else None
    good = [
        p
        for p in found
        if (last is None or _step(p) <= last) and not verify_checkpoint(p, checksums=checksums)
    ]
    if not good:
        return []
    kept = set(good[-retention.keep :])
    newest_good = _step(good[-1])
    removed = []
    for path in found:
        step = _step(path)
        if path in kept or retention.pinned(step) or step > newest_good:
            continue
        # renamed first, so a folder half deleted is never taken for a checkpoint
        doomed = path.with_name(f".{path.name}.stale")
        remove_folder(doomed)
        path.rename(doomed)
        remove_folder(doomed)
        removed.append(path)
    return removed
