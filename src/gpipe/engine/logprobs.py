"""Per-token log-probabilities of given targets, micro-batch by micro-batch on the last stage.

No micro-batch's logits outlive it (the reference and old-policy passes of RL, and scoring);
``forward_only`` runs the forward that feeds them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from gpipe.runtime.dtensors import is_dtensor
from gpipe.runtime.stage import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "TokenLogprobs", "logits_of", "token_logprobs"]


def logits_of(outputs: Any) -> Tensor:
    """The logits in a last stage's outputs: the tensor itself, the first of a tuple, or the
    ``logits`` of a mapping or of an object such as a Hugging Face ``ModelOutput``; whole,
    where they come split by vocabulary over tensor ranks (``loss_parallel``)."""
    logits = _logits(outputs)
    return logits.full_tensor() if is_dtensor(logits) else logits


def _logits(outputs: Any) -> Tensor:
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    if isinstance(getattr(outputs, "logits", None), Tensor):
        return outputs.logits
    if isinstance(outputs, tuple) and outputs and isinstance(outputs[0], Tensor):
        return outputs[0]
    raise TypeError(
        "the last stage's outputs hold no logits: give a tensor, a tuple whose first item is "
        f"one, or a mapping or object with 'logits'; got {type(outputs).__name__}"
    )


def token_logprobs(logits: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``log_softmax(logits)`` at each target (logits ``(..., vocab)``, targets ``(...)``), in
    the logits' dtype (float32 at least); 0 where the target is ``ignore_index``."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not fit targets of shape "
            f"{tuple(targets.shape)}: expected logits of shape (*targets.shape, vocab)"
        )
    _check_ids(targets)
    if not logits.dtype.is_floating_point or logits.element_size() < 4:
        logits = logits.float()
    kept = targets != ignore_index
    index = torch.where(kept, targets, torch.zeros_like(targets)).long().unsqueeze(-1)
    picked = logits.log_softmax(dim=-1).gather(-1, index).squeeze(-1)
    return torch.where(kept, picked, torch.zeros_like(picked))


class TokenLogprobs(dict[int, Tensor]):
    """Where the last stage puts each micro-batch's outputs (``StepData.outputs``): it keeps
    only their log-probabilities of ``targets[microbatch]``, so that the logits of one
    micro-batch are freed as soon as the next one runs.

    Targets that do not fit their logits are not raised here, mid-forward: the first refusal
    is kept in ``refused`` (``names[microbatch]`` says which targets) and later micro-batches
    are still received, so that the pipeline's channels hold nothing of this forward when the
    caller raises it (``forward_only`` does, on every rank)."""

    def __init__(
        self,
        targets: Sequence[Tensor],
        ignore_index: int = IGNORE_INDEX,
        *,
        names: Sequence[str] | None = None,
        refused: str | None = None,
    ) -> None:
        super().__init__()
        self.targets = targets
        self.ignore_index = ignore_index
        self.names = names
        self.refused = refused

    def __setitem__(self, microbatch: int, outputs: Any) -> None:
        logits = logits_of(outputs).detach()
        if self.refused is None:
            target = self.targets[microbatch]
            try:  # checked where the targets are (the user's, mostly on the CPU): no device sync
                _check_vocabulary(target, logits.shape[-1], self.ignore_index)
                target = target.to(logits.device)
                super().__setitem__(microbatch, token_logprobs(logits, target, self.ignore_index))
                return
            except ValueError as exc:
                name = self.names[microbatch] if self.names else "targets"
                self.refused = f"{name}: {exc}"
        super().__setitem__(microbatch, logits.new_empty(0))  # refused: nothing to return


def _check_ids(targets: Tensor) -> None:
    """Refuse targets that are not token ids: floats, complex numbers, booleans."""
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be token ids (an integer tensor), got {targets.dtype}")


def _check_vocabulary(targets: Tensor, vocab: int, ignore_index: int) -> None:
    """Refuse targets that are not token ids, or a target outside the vocabulary (other than
    ``ignore_index``), before ``gather`` meets it (on CUDA, a device-side assertion that ends
    the process)."""
    _check_ids(targets)
    kept = targets != ignore_index
    outside = kept & ((targets < 0) | (targets >= vocab))
    if outside.any():
        found = int(targets[outside][0])
        raise ValueError(
            f"token id {found} is outside the vocabulary of {vocab} logits (and is not "
            f"ignore_index={ignore_index})"
        )
