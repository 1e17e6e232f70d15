"""Checkpoints are renamed into place only when whole; a damaged newest one is skipped for the
one before it with a warning that names it, and what unfinished saves left is cleared."""

import warnings

import pytest
import torch

from gpipe.training.checkpoints.format import (
    DamagedCheckpointWarning,
    checkpoint_dirs,
    discard_partial,
    latest_checkpoint,
    read_description,
    save_checkpoint,
    verify_checkpoint,
)


@pytest.fixture
def root(tmp_path):
    """Checkpoints of steps 1, 2 and 3 of a small model, saved in this one process."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        for step in (1, 2, 3):
            model(torch.randn(4, 3)).sum().backward()
            optimizer.step()
            save_checkpoint(tmp_path, step, model, optimizer, {"step": step}, {"what": "test"})
    return tmp_path


def test_saved_checkpoints_verify_and_describe_themselves(root):
    assert [p.name for p in checkpoint_dirs(root)] == ["step-000001", "step-000002", "step-000003"]
    for path in checkpoint_dirs(root):
        assert verify_checkpoint(path) == []
    assert read_description(root / "step-000002") == {"what": "test", "step": 2}
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_naming_it(root):
    data = root / "step-000003" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-1])
    (root / "step-000002" / ".metadata").unlink()
    with pytest.warns(DamagedCheckpointWarning) as caught:
        assert latest_checkpoint(root) == root / "step-000001"
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "step-000003 is damaged (__0_0.distcp has" in messages[0]
    assert "step-000002 is damaged (.metadata is missing)" in messages[1]


def test_no_checkpoint_that_verifies_is_none(root):
    for path in checkpoint_dirs(root):
        (path / "manifest.json").unlink()
    with pytest.warns(DamagedCheckpointWarning, match="the save did not finish"):
        assert latest_checkpoint(root) is None


def test_discard_partial_clears_unfinished_saves_only(root):
    (root / ".step-000004.partial").mkdir()
    (root / ".step-000004.partial" / "__0_0.distcp").write_bytes(b"half")
    (root / ".step-000002.stale").mkdir()
    assert [p.name for p in discard_partial(root)] == [".step-000002.stale", ".step-000004.partial"]
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002", "step-000003"]


def test_a_resumed_run_keeps_the_whole_metrics_lines_up_to_its_checkpoint(tmp_path):
    """Lines cut short by a lost process, in the middle of a character too, or naming no
    whole step (an infinite or fractional one) are dropped, not a crash on resume."""
    from gpipe.training.checkpoints.resuming import trim_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [b'{"step": 1}', b'{"step": 2.5}', b'{"step": Infinity}', b'{"step": true}']
    lines += [b'{"step": 3}', b'\xff\xfe{"ste', b'{"step": 5}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    trim_metrics(path, 3)
    assert path.read_text() == '{"step": 1}\n{"step": 3}\n'
