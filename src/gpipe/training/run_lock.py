"""One run at a time in a run folder: the process that starts a run's local processes holds
a lock on its folder while they train, so that a second run pointed at it (``--resume``
while it trains, ``--force`` over it) is refused instead of writing checkpoints and metrics
over the first one's."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from gpipe.errors import ConfigError

__all__ = ["LOCK_FILE", "holding_run_folder"]

LOCK_FILE = ".gpipe.lock"
"""In the run folder: locked while a run trains there, and naming its process."""


@contextlib.contextmanager
def holding_run_folder(out: Path, flag: str = "--out") -> Iterator[None]:
    """Hold ``out``'s lock until the block ends (creating ``out``); ConfigError, naming the
    process that holds it, if another run does, or ``flag`` and why where the folder cannot
    be made. The lock is the kernel's (``flock``): it goes with the process that holds it,
    however that ends. Where the file system cannot lock (some network file systems), the
    run goes on unlocked."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{flag} {out}: cannot write the run folder ({exc.strerror}: {exc.filename})"
        ) from None
    if sys.platform == "win32":  # no flock: runs are not locked
        yield
        return
    path = out / LOCK_FILE
    try:  # never through a link: a run folder may come from someone else
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise ConfigError(
            f"run folder {out}: cannot open its lock {path} ({exc.strerror})"
        ) from None
    try:
        if _locked(fd, out, path):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _locked(fd: int, out: Path, path: Path) -> bool:
    """Lock ``fd``; False where this file system cannot lock."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").split()
        who = f"process {holder[0]} on {holder[1]}" if len(holder) == 2 else "another process"
        raise ConfigError(
            f"run folder {out} is in use by another run ({who} holds {path}); two runs in "
            "one folder would write over each other's checkpoints: wait for it to end, or "
            "pass another --out"
        ) from None
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise
    return True
