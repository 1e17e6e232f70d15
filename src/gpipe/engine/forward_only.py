"""Forward-only passes that return per-token log-probabilities of given targets.

They serve the reference and old-policy passes of RL, or scoring: the step's micro-batching, and
no activation kept for a backward; ``logprobs`` computes them on the last stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gpipe.engine.logprobs import IGNORE_INDEX, TokenLogprobs
from gpipe.engine.presplit import Presplit, given_microbatches
from gpipe.engine.runner import StepRunner

__all__ = ["forward_logprobs"]


def _check_targets(targets: Any, given: Presplit | None) -> None:
    """Refuse missing targets on the last stage before any message is sent."""
    if given is not None and given.targets is None:
        raise ValueError(
            "forward_logprobs needs targets: give microbatches=[(inputs, targets), ...]"
        )
    if given is None and not isinstance(targets, Tensor):
        raise ValueError(
            "forward_logprobs needs targets on the last stage: a tensor of token ids with "
            f"the inputs' rows, got {type(targets).__name__}"
        )


def _last_targets(targets: Any, given: Presplit | None, sizes: list[int]) -> list[Tensor]:
    """Each micro-batch's targets on the last stage: those given with it, or ``targets``
    split as the inputs were."""
    if given is not None:
        assert given.targets is not None
        return list(given.targets)
    if targets.size(0) != sum(sizes):
        raise ValueError(f"targets have {targets.size(0)} rows but inputs have {sum(sizes)}")
    return list(targets.split(sizes))


@torch.no_grad()
def forward_logprobs(
    runner: StepRunner,
    inputs: Any = None,
    targets: Tensor | None = None,
    *,
    training: bool = False,
    microbatches: Sequence[tuple[Any, Tensor]] | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor | list[Tensor] | None:
    """``log_softmax(logits).gather(targets)`` of every token, from a forward alone through
    ``runner``'s stages (``Pipeline.forward_only`` calls it with its own; ``training``: the
    modules' mode).

    As ``Pipeline.evaluate``: ``inputs`` (read on the first stage) split into ``chunks``
    micro-batches and ``targets`` (token ids, ``(rows, ...)``, read on the last stage), or
    your own ``microbatches=[(inputs, targets), ...]``, the same list on every rank. The last
    stage's outputs are its logits (a tensor, a tuple's first, or ``.logits``); each
    micro-batch's are turned into log-probabilities as soon as it is computed and then
    dropped. Returns, on the rank of the last stage, a tensor shaped like ``targets`` (with
    ``microbatches=``, one per micro-batch, in order), 0 where the target is
    ``ignore_index``; None on every other rank. Collective: every rank of the pipeline calls
    it.
    """
    given = given_microbatches(inputs, targets, microbatches)
    if runner.placement.is_last:
        _check_targets(targets, given)

    def logprobs_for(sizes: list[int]) -> TokenLogprobs:
        return TokenLogprobs(_last_targets(targets, given, sizes), ignore_index)

    found = runner.forward_each(inputs, training, given=given, outputs_for=logprobs_for)
    if found is None:
        return None
    return found if given is not None else torch.cat(found)
