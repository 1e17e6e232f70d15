"""Checkpoints written by a helper process of each rank (``gpipe.training.save_process``):
the state as it was at ``save``, retention as the thread's, and a rank lost after writing
its files leaves a ``.partial`` folder that is never loaded, its helper gone with it.

Real processes over gloo, with processes of their own (a rank is killed): ``gpipe.launch``.
"""

import json
import os
import time

import pytest

from gpipe import LaunchError, launch
from gpipe.training.checkpoints import checkpoint_dirs, verify_checkpoint

from .save_process_cases import saves


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (reaped, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see the helpers end")
def test_helpers_write_the_state_at_save_and_die_with_their_rank(tmp_path, monkeypatch):
    launch(saves, 2, (str(tmp_path), 3), threads=1)
    root = tmp_path / "checkpoints"
    assert [p.name for p in checkpoint_dirs(root)] == ["step-000002", "step-000003"]
    assert all(verify_checkpoint(p) == [] for p in checkpoint_dirs(root))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert result["same"], rank  # the weights at save(), not those changed after
    assert json.loads((tmp_path / "result-0.json").read_text())["removed"] == ["step-000001"]

    # rank 1 lost once its helper has written its files of step 2's checkpoint
    again = tmp_path / "again"
    again.mkdir()
    kill = {"rank": 1, "step": 2, "at": "save", "once": str(tmp_path / "killed")}
    monkeypatch.setenv("GPIPE_TEST_KILL", json.dumps(kill))
    with pytest.raises(LaunchError) as failed:  # the first failure the agent sees
        launch(saves, 2, (str(again), 3), threads=1)
    message = str(failed.value)
    assert "SIGKILL" in message or "checkpoint of step 2 failed in the writing process" in message
    assert (tmp_path / "killed").exists()
    root = again / "checkpoints"
    assert [p.name for p in checkpoint_dirs(root)] == ["step-000001"]
    assert (root / ".step-000002.partial").is_dir()  # never loaded; the next start clears it
    helpers = [int((again / f"helper-{rank}").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 30
    while not all(map(_gone, helpers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(map(_gone, helpers)), helpers
