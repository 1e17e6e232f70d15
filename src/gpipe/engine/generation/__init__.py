"""Generation through a pipeline: a KV cache per group of sequences in flight on every stage,
prompts prefilled in chunks, finished sequences replaced by waiting ones.

``pipelined.Generation`` runs it on every rank (``Pipeline.generate``); ``scheduler`` plans the
lanes on the first stage, ``lanes`` keeps each stage's caches, ``sampling`` picks the tokens on
the last, ``messages`` is what travels, ``checks`` refuses bad arguments in one line.
"""

from gpipe.engine.generation.lanes import GenerationRefused
from gpipe.engine.generation.pipelined import Generation, Timing
from gpipe.engine.generation.sampling import Sampler, Sampling
from gpipe.engine.generation.scheduler import Piece, Scheduler, Task

__all__ = [
    "GenerationRefused",
    "Generation",
    "Piece",
    "Sampler",
    "Sampling",
    "Scheduler",
    "Task",
    "Timing",
]
