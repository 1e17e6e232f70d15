"""What each process runs in tests/test_save_process.py: a 2-stage pipeline whose checkpoints
a helper process per rank writes, in the background, while the weights go on changing."""

import json
import os
from pathlib import Path

import torch
from torch.nn.functional import mse_loss

from gpipe import Pipeline
from gpipe.training.checkpoint_writer import CheckpointWriter
from gpipe.training.checkpoints import load_model_weights
from gpipe.training.retention import Retention

from .models import batch, mlp


def saves(root: str, steps: int) -> None:
    """Steps 1..``steps``, each saved in the background and its weights then changed at
    once; each rank notes its helper's pid and, once the writer is closed, whether the
    newest checkpoint holds its stage's weights as they were at ``save``."""
    pipe = Pipeline(mlp(), [4, 4], chunks=2, loss_fn=mse_loss)
    optimizer = torch.optim.AdamW(pipe.parameters())
    writer = CheckpointWriter(Path(root) / "checkpoints", pipe, retention=Retention(keep=2),
                              process=True)  # fmt: skip
    x, y = batch(8)
    saved = {}
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        optimizer.step()
        writer.save(step, pipe, optimizer, {"step": step}, {"test": "save process"})
        saved = {k: v.clone() for k, v in pipe.state_dict().items()}
        with torch.no_grad():  # while the helper may still be writing
            for p in pipe.parameters():
                p.add_(1.0)
        rank = int(os.environ["RANK"])
        Path(root, f"helper-{rank}").write_text(str(writer._helper._process.pid))
    last = writer.close()
    loaded = Pipeline(mlp(seed=5), [4, 4], chunks=2, loss_fn=mse_loss)
    load_model_weights(last, loaded)
    same = all(torch.equal(v, saved[k]) for k, v in loaded.state_dict().items())
    removed = [p.name for p in writer.removed]
    Path(root, f"result-{rank}.json").write_text(json.dumps({"same": same, "removed": removed}))
