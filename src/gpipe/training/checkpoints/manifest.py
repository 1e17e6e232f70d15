"""A checkpoint's manifest: every file's size and SHA-256, written last, so that a checkpoint
with a file missing, truncated or altered is told apart from a complete one."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST", "Digest", "digest", "listed_files", "verify", "write_manifest"]

MANIFEST = "manifest.json"
_FORMAT = 1

Digest = dict[str, Any]  # {"bytes": size, "sha256": hex digest}


def listed_files(folder: Path) -> list[str]:
    """The names of the files a manifest of ``folder`` covers: all but the manifest, sorted
    (the same list on every process that reads the folder)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)


def digest(path: Path) -> Digest:
    """The size and SHA-256 of the file at ``path``."""
    with open(path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": sha}


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(folder: Path, digests: dict[str, Digest]) -> None:
    """Record ``digests`` (file name -> digest) as the manifest of ``folder``, durably: written
    to a temporary name, synced, then renamed, so a manifest is either whole or absent."""
    missing = sorted(set(listed_files(folder)) - set(digests))
    if missing:
        raise ValueError(f"digests must cover every file in {folder}; missing {missing}")
    text = json.dumps({"format": _FORMAT, "files": digests}, indent=1, sort_keys=True)
    temporary = folder / f".{MANIFEST}.tmp"
    _write_synced(temporary, text + "\n")
    os.replace(temporary, folder / MANIFEST)


def _read(folder: Path) -> dict[str, Digest] | str:
    """The manifest's entries, or what is wrong with it."""
    try:
        held = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST} (the save did not finish)"
    except (OSError, ValueError) as exc:
        return f"{MANIFEST} unreadable ({exc})"
    files = held.get("files") if isinstance(held, dict) else None
    if not isinstance(files, dict) or not files or held.get("format") != _FORMAT:
        return f"{MANIFEST} is not a gpipe manifest of format {_FORMAT}"
    for name, expected in files.items():
        if Path(name).name != name or name in ("", ".", ".."):  # no "../x", "/x" or "a/b"
            return f"{MANIFEST} names {name!r}, which is not a file of the checkpoint's folder"
        if not isinstance(expected, dict):
            return f"{MANIFEST} describes {name} by a {type(expected).__name__}, not a digest"
    return files


def verify(folder: Path, *, checksums: bool = True, required: tuple[str, ...] = ()) -> list[str]:
    """What is wrong with the checkpoint in ``folder``: an empty list if its manifest is whole
    and every file it lists is there, in the folder itself (no link), with its size (and,
    with ``checksums``, its SHA-256). ``required`` names files the manifest must list."""
    if folder.is_symlink():
        return [f"{folder.name} is a link; a run's checkpoints lie in its own folder"]
    files = _read(folder)
    if isinstance(files, str):
        return [files]
    problems = [f"{name} not in {MANIFEST}" for name in required if name not in files]
    for name, expected in sorted(files.items()):
        path = folder / name
        if path.is_symlink():
            problems.append(f"{name} is a link; a checkpoint's files lie in its folder")
            continue
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != expected.get("bytes"):
            problems.append(f"{name} has {size} bytes, expected {expected.get('bytes')}")
        elif checksums and digest(path)["sha256"] != expected.get("sha256"):
            problems.append(f"{name} does not match its SHA-256")
    return problems
