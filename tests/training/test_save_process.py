"""Checkpoints written by a helper process of each rank
(``gpipe.training.checkpoints.save_process``): the state as it was at ``save``, retention
as the thread's, and a rank lost after writing its files leaves a ``.partial`` folder that is
never loaded, its helper gone with it.

Real processes over gloo, with processes of their own (a rank is killed): ``gpipe.launch``.
"""

import json
import os
import time

import pytest
import torch

from gpipe import LaunchError, launch
from gpipe.training.checkpoints.format import checkpoint_dirs, load_model_weights, verify_checkpoint

from ..small_models import mlp
from .launch_cases import gone
from .save_process_cases import saves


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see the helpers end")
def test_helpers_write_the_state_at_save_and_die_with_their_rank(tmp_path, monkeypatch):
    """Steps 1 and 2 saved whole (step 1 then removed: keep 1); rank 1 lost once its helper
    has written its files of step 3's checkpoint."""
    kill = {"rank": 1, "step": 3, "at": "save", "once": str(tmp_path / "killed")}
    monkeypatch.setenv("GPIPE_TEST_KILL", json.dumps(kill))
    with pytest.raises(LaunchError) as failed:  # the first failure the agent sees
        launch(saves, 2, (str(tmp_path), 4), threads=1)
    message = str(failed.value)
    assert "SIGKILL" in message or "checkpoint of step 3 failed in the writing process" in message
    assert (tmp_path / "killed").exists()
    root = tmp_path / "checkpoints"
    assert [p.name for p in checkpoint_dirs(root)] == ["step-000002"]
    assert verify_checkpoint(root / "step-000002") == []
    assert (root / ".step-000003.partial").is_dir()  # never loaded; the next start clears it

    whole = {}  # both stages' weights as they were at save(), not as changed after it
    for rank in (0, 1):
        whole |= torch.load(tmp_path / f"weights-{rank}-2.pt")
    loaded = mlp(seed=5)  # the whole model in this process: checkpoints are keyed by layer
    load_model_weights(root / "step-000002", loaded)
    assert set(loaded.state_dict()) == set(whole)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, whole[name]), name

    helpers = [int((tmp_path / f"helper-{rank}").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 30
    while not all(map(gone, helpers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(map(gone, helpers)), helpers
