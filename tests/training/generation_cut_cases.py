"""What each process runs in tests/training/test_generation_cut.py: a GPT-2 cut by tracing,
as `gpipe train --model hf:` cuts it, given to ``cut_for_generation``."""

from pathlib import Path

import torch

from gpipe.engine.generation import GenerationRefused
from gpipe.pipeline import Pipeline
from gpipe.training.hf.generation_cut import cut_for_generation
from gpipe.training.models.sources import TrainModel


def cut(config: str, split_at: list[str]) -> dict:
    """The traced stages of the GPT-2 at ``config`` begun at ``split_at``, and what
    ``cut_for_generation`` makes of them: this rank's new stage and the tokens it generates
    with the others, or the refusal."""
    model = TrainModel(
        source=f"hf:{Path(config).parent}", vocab_size=64, seq_len=16, split_at=split_at,
        hf_config=config,
    )  # fmt: skip
    traced = model.layers(2, 0, "parameters")

    def make(stages, balance):
        return Pipeline(stages, balance, timeout=30)

    pipe = make(traced, [1, 1])
    torch.manual_seed(0)  # weights for the probe, as a run's checkpoint gives them
    with torch.no_grad():
        for param in pipe.parameters():
            param.normal_(0.0, 0.2)
    try:
        found = cut_for_generation(pipe, traced, model, make)
    except GenerationRefused as exc:
        return {"refused": str(exc)}
    stage = dict(found.named_children())[str(found.stage_index)]
    return {"stage": type(stage).__name__, "generates": found.generate([[1, 2, 3], [4]], 3)}
