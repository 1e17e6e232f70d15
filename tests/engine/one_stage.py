"""Generation on one process that holds the whole model, task by task, for tests that look at
a stage's caches between tasks (what the pipeline runs, without processes)."""

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gpipe.engine.generation import Sampler, Sampling, Scheduler
from gpipe.engine.generation.lanes import CachedStage, StageCaches
from gpipe.engine.generation.sampling import picked


def stepped(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    context: int,
    **plan: Any,
) -> Iterator[tuple[Scheduler, StageCaches]]:
    """Greedy generation of ``prompts`` through ``model`` as one stage, in one lane unless
    ``plan`` says otherwise (``Scheduler``'s options); yields the plan and the stage's caches
    after each task."""
    schedule = Scheduler(prompts, max_new_tokens, **{"lanes": 1, **plan})
    caches = StageCaches(CachedStage(model, 0, torch.device("cpu"), None), context=context)
    sampler = Sampler(Sampling())
    with torch.no_grad():
        while (task := schedule.task(0)) is not None:
            x = torch.tensor(task.inputs)[:, None]
            pieces = [torch.tensor(p.ids)[None] for p in task.pieces]
            x, pieces = caches.run(task, x, pieces)
            schedule.take(0, *picked(sampler, task, x, pieces))
            yield schedule, caches
