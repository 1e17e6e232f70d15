"""What each process runs in tests/training/test_save_process.py: a 2-stage pipeline whose
checkpoints a helper process per rank writes, in the background, while the weights go on
changing."""

import os
from pathlib import Path

import torch
from torch.nn.functional import mse_loss

from gpipe import Pipeline
from gpipe.training.checkpoints.retention import Retention
from gpipe.training.checkpoints.writer import CheckpointWriter

from ..small_models import batch, mlp


def saves(root: str, steps: int) -> None:
    """Steps 1..``steps``, each saved in the background, this rank's weights as they were at
    ``save`` kept beside (``weights-RANK-STEP.pt``) and then changed at once; each rank
    notes its helper's pid."""
    pipe = Pipeline(mlp(), [4, 4], chunks=2, loss_fn=mse_loss)
    optimizer = torch.optim.AdamW(pipe.parameters())
    writer = CheckpointWriter(
        Path(root) / "checkpoints", pipe, retention=Retention(keep=1), process=True
    )
    rank = int(os.environ["RANK"])
    x, y = batch(8)
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        optimizer.step()
        writer.save(step, pipe, optimizer, {"step": step}, {"test": "save process"})
        torch.save(pipe.state_dict(), Path(root, f"weights-{rank}-{step}.pt"))
        # for the test to kill: the writer keeps no public handle on its helper process
        Path(root, f"helper-{rank}").write_text(str(writer._helper._process.pid))
        with torch.no_grad():  # while the helper may still be writing
            for p in pipe.parameters():
                p.add_(1.0)
    writer.close()
