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


def _check_given(given: Presplit) -> None:
    """Refuse ``microbatches=`` without targets or with targets other than tensors of token
    ids: every rank holds the list, so every rank refuses it before any message is sent."""
    if given.targets is None:
        raise ValueError(
            "forward_logprobs needs targets: give microbatches=[(inputs, targets), ...]"
        )
    for i, target in enumerate(given.targets):
        if not isinstance(target, Tensor):
            raise ValueError(
                f"microbatches[{i}] targets must be a tensor of token ids, got "
                f"{type(target).__name__}"
            )


def _last_targets(targets: Any, given: Presplit | None, sizes: list[int]) -> list[Tensor]:
    """Each micro-batch's targets on the last stage: those given with it, or ``targets``
    split as the inputs were."""
    if given is not None:
        assert given.targets is not None
        return list(given.targets)
    if not isinstance(targets, Tensor):
        raise ValueError(
            "forward_logprobs needs targets on the last stage: a tensor of token ids with "
            f"the inputs' rows, got {type(targets).__name__}"
        )
    if targets.dim() == 0 or targets.size(0) != sum(sizes):
        rows = "no" if targets.dim() == 0 else targets.size(0)
        raise ValueError(f"targets have {rows} rows but inputs have {sum(sizes)}")
    return list(targets.split(sizes))


def _token_logprobs(
    targets: Any, given: Presplit | None, ignore_index: int, sizes: list[int]
) -> TokenLogprobs:
    """What the last stage puts the outputs of micro-batches of ``sizes`` rows in; targets it
    refuses are kept as its refusal, so that the forward still runs to its end."""
    try:
        found = _last_targets(targets, given, sizes)
    except ValueError as exc:
        return TokenLogprobs([], ignore_index, refused=str(exc))
    name = "microbatches[{}] targets" if given is not None else "targets (micro-batch {})"
    return TokenLogprobs(found, ignore_index, names=[name.format(i) for i in range(len(found))])


def _agree(runner: StepRunner, refused: str | None) -> None:
    """Raise the last stage's refusal of its targets on every rank, once the forward has run
    to its end (nothing of it is left in the channels for the next one to read): its length
    goes to every rank, and its words only where there is one."""
    placement = runner.placement
    if placement.n_ranks > 1:
        last = placement.rank_of(placement.n_stages - 1)
        what = "the last stage's check of its targets"
        said = b"" if refused is None else refused.encode()
        size = torch.tensor([len(said)], dtype=torch.int64, device=runner.device)
        runner.broadcast_number(size, last, what)
        if int(size):
            if placement.is_last:
                words = torch.frombuffer(bytearray(said), dtype=torch.uint8)
            else:
                words = torch.zeros(int(size), dtype=torch.uint8)
            words = runner.broadcast(words.to(runner.device), last, what)
            if not placement.is_last:
                text = words.cpu().numpy().tobytes().decode(errors="replace")
                refused = f"the last stage refused its targets: {text}"
    if refused is not None:
        raise ValueError(refused)


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
    it. Targets the last stage refuses (not of the logits' shape, a token id outside the
    vocabulary) are a ValueError on every rank once the forward has run to its end, so that
    the next call reads none of this one's messages.
    """
    given = given_microbatches(inputs, targets, microbatches)
    if given is not None:
        _check_given(given)
    made: list[TokenLogprobs] = []  # the last stage's, once it knows the micro-batches' rows

    def outputs_for(sizes: list[int]) -> TokenLogprobs:
        made.append(_token_logprobs(targets, given, ignore_index, sizes))
        return made[-1]

    found = runner.forward_each(inputs, training, given=given, outputs_for=outputs_for)
    _agree(runner, made[0].refused if made else None)
    if found is None:
        return None
    return found if given is not None else torch.cat(found)
