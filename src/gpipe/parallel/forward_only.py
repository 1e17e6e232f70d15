"""Forward-only passes through a ``Pipeline`` that return per-token log-probabilities of given
targets: the reference and old-policy passes of RL, or scoring, with the step's micro-batching
and no activation kept for a backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gpipe.parallel.presplit import Presplit, presplit
from gpipe.runtime.logprobs import IGNORE_INDEX, TokenLogprobs
from gpipe.schedules import Schedule, add_skips, forward_only

__all__ = ["forward_logprobs", "forward_schedule"]


def forward_schedule(pipe: Any, n_microbatches: int) -> Schedule:
    """The schedule of a forward alone through ``pipe``'s stages (``evaluate``, ``forward``,
    log-probabilities), skips routed."""
    schedule = forward_only(
        pipe.n_stages, n_microbatches, pipe.n_ranks, pipe.placement.stage_to_rank
    )
    return add_skips(schedule, pipe.skip_layout.routes)


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
    pipe: Any,
    inputs: Any = None,
    targets: Tensor | None = None,
    *,
    microbatches: Sequence[tuple[Any, Tensor]] | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor | list[Tensor] | None:
    """``log_softmax(logits).gather(targets)`` of every token, from a forward alone of
    ``pipe`` (a ``gpipe.Pipeline``; typed loosely so that this module imports nothing above
    ``parallel``, and ``Pipeline.forward_only`` can call it from a lower layer).

    As ``pipe.evaluate``: ``inputs`` (read on the first stage) split into ``pipe.chunks``
    micro-batches and ``targets`` (token ids, ``(rows, ...)``, read on the last stage), or
    your own ``microbatches=[(inputs, targets), ...]``, the same list on every rank. The last
    stage's outputs are its logits (a tensor, a tuple's first, or ``.logits``); each
    micro-batch's are turned into log-probabilities as soon as it is computed and then
    dropped. Returns, on the rank of the last stage, a tensor shaped like ``targets`` (with
    ``microbatches=``, one per micro-batch, in order), 0 where the target is
    ``ignore_index``; None on every other rank. Collective: every rank of the pipeline calls
    it.
    """
    if microbatches is not None and (inputs is not None or targets is not None):
        raise ValueError(
            "give inputs and targets, or microbatches=[(inputs, targets), ...], not both"
        )
    given = None if microbatches is None else presplit(microbatches)
    if pipe.is_last:
        _check_targets(targets, given)
    runner = pipe._runner
    _, sizes, parts = runner._start(inputs, given)
    m = len(sizes)
    data = runner._data(parts, build_graph=False)
    if pipe.is_last:
        data.outputs = TokenLogprobs(_last_targets(targets, given, sizes), ignore_index)
    runner._run(forward_schedule(pipe, m), data, pipe.training)
    if not pipe.is_last:
        return None
    found = [data.outputs[i] for i in range(m)]
    return found if given is not None else torch.cat(found)
