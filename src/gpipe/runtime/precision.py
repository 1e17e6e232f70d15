"""Mixed precision of one rank of a pipeline: the dtype its stages autocast to, and loss
scaling whose decisions (scale, skip or step) every rank of the pipeline shares."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from gpipe.runtime.loss_scaling import unscale_

__all__ = ["Precision", "already_unscaled"]


def already_unscaled(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` ran since the last ``scaler.update``."""
    from torch.amp.grad_scaler import OptState

    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    return state.get("stage") is OptState.UNSCALED


class Precision:
    """``autocast``: the dtype (None: full precision) this rank's stages run under, checked
    by the caller. ``groups``: the process groups whose ranks must agree on a loss scaler's
    found-inf flag (the pipeline's, its replicas'), so that all step or all skip; each
    agreement waits at most ``timeout`` seconds, then raises StageError naming ``stage``."""

    def __init__(
        self,
        autocast: torch.dtype | None,
        device: torch.device,
        groups: Sequence[dist.ProcessGroup | None],
        timeout: float,
        stage: int,
    ) -> None:
        self.autocast = autocast
        self.device = device
        self.groups = list(groups)
        self.timeout = timeout
        self.stage = stage

    def loss_scale(self, scaler: torch.amp.GradScaler | None) -> float:
        """The factor the last stage multiplies the loss by this step (1 without a scaler).

        Called straight from the facade's ``step``, so that a warning names the caller's line.
        """
        if scaler is None or not scaler.is_enabled():
            return 1.0
        if self.autocast is torch.bfloat16:
            warnings.warn(
                "scaler= with autocast=torch.bfloat16: bfloat16 has float32's range, so loss "
                "scaling only costs time",
                stacklevel=3,
            )
        # scale() sets the scaler up on this rank's device, as unscale_ will need everywhere
        return float(scaler.scale(torch.ones((), device=self.device)))

    def unscale_(self, scaler: torch.amp.GradScaler, optimizer: Optimizer) -> bool:
        """``scaler.unscale_(optimizer)`` with the found-inf flag reduced over ``groups``;
        returns whether ``scaler.step`` will skip."""
        return unscale_(scaler, optimizer, self.groups, timeout=self.timeout, stage=self.stage)

    def unscale_once(
        self, scaler: torch.amp.GradScaler | None, optimizer: Optimizer | None
    ) -> None:
        """Before clipping: unscale with a ``scaler`` (which needs its ``optimizer``), unless
        this step's gradients are unscaled already."""
        if scaler is None:
            return
        if optimizer is None:
            raise ValueError("clip_grad_norm_(scaler=...) needs optimizer= to unscale")
        if not already_unscaled(scaler, optimizer):
            self.unscale_(scaler, optimizer)
