"""A checkpoint's manifest tells a whole checkpoint from one with a file missing, cut short,
altered or unlisted, and is itself written whole or not at all."""

import json

import pytest

from gpipe.training.checkpoints.manifest import (
    MANIFEST,
    digest,
    listed_files,
    verify,
    write_manifest,
)


@pytest.fixture
def folder(tmp_path):
    """A folder of three files and their manifest."""
    (tmp_path / ".metadata").write_bytes(b"index" * 10)
    (tmp_path / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "gpipe.json").write_text('{"step": 3}')
    write_manifest(tmp_path, {name: digest(tmp_path / name) for name in listed_files(tmp_path)})
    return tmp_path


def test_a_whole_folder_verifies(folder):
    assert verify(folder) == []
    assert verify(folder, required=(".metadata", "gpipe.json")) == []
    held = json.loads((folder / MANIFEST).read_text())
    assert sorted(held["files"]) == [".metadata", "__0_0.distcp", "gpipe.json"]
    assert held["files"]["__0_0.distcp"]["bytes"] == 1024
    assert not (folder / f".{MANIFEST}.tmp").exists()


def test_a_missing_file_is_named(folder):
    (folder / "__0_0.distcp").unlink()
    assert verify(folder) == ["__0_0.distcp is missing"]


def test_a_truncated_file_is_named_with_its_sizes(folder):
    path = folder / "__0_0.distcp"
    path.write_bytes(path.read_bytes()[:100])
    assert verify(folder) == ["__0_0.distcp has 100 bytes, expected 1024"]
    assert verify(folder, checksums=False) == ["__0_0.distcp has 100 bytes, expected 1024"]


def test_altered_bytes_of_the_same_size_fail_the_checksum_only(folder):
    path = folder / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[500] ^= 0xFF
    path.write_bytes(bytes(data))
    assert verify(folder) == ["__0_0.distcp does not match its SHA-256"]
    assert verify(folder, checksums=False) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, "no manifest.json (the save did not finish)"),
        ('{"files": ', "manifest.json unreadable"),
        ("[1, 2]", "manifest.json is not a gpipe manifest of format 1"),
        ('{"format": 1, "files": {}}', "manifest.json is not a gpipe manifest of format 1"),
    ],
)
def test_a_missing_or_foreign_manifest_fails(folder, text, expected):
    if text is None:
        (folder / MANIFEST).unlink()
    else:
        (folder / MANIFEST).write_text(text)
    (problem,) = verify(folder)
    assert problem.startswith(expected)


def test_a_required_file_must_be_listed(folder):
    assert verify(folder, required=("model.bin",)) == [f"model.bin not in {MANIFEST}"]


def test_digests_must_cover_every_file(folder):
    (folder / "extra.bin").write_bytes(b"x")
    known = {name: digest(folder / name) for name in (".metadata", "__0_0.distcp", "gpipe.json")}
    with pytest.raises(ValueError, match=r"missing \['extra.bin'\]"):
        write_manifest(folder, known)
