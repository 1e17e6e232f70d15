"""What each process runs in tests/training/test_generation_cut.py: a GPT-2 cut by tracing,
as `gpipe train --model hf:` cuts it, given to ``cut_for_generation``."""

from pathlib import Path

import torch

from gpipe.pipeline import Pipeline
from gpipe.training.hf.generation_cut import cut_for_generation
from gpipe.training.models.sources import TrainModel


def cut(config: str, split_at: list[str]) -> dict:
    """The traced stages of the GPT-2 at ``config`` begun at ``split_at``, and what
    ``cut_for_generation`` makes of them: whether it gave new stages and what they are."""
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
    found = cut_for_generation(pipe, traced, model, make)
    stage = dict(found.named_children())[str(found.stage_index)]
    return {"new": found is not pipe, "stage": type(stage).__name__, "generates": _greedy(found)}


def _greedy(pipe: Pipeline) -> list[list[int]] | str:
    try:
        return pipe.generate([[1, 2, 3], [4]], 3)
    except ValueError as exc:  # GenerationRefused
        return str(exc).splitlines()[0]
