"""Loss scaling across stages: ``torch.amp.GradScaler`` with a pipeline whose ranks each hold
only some of the gradients, so that either every rank steps or every rank skips.

The loss is scaled on the last stage (``Pipeline.step(..., scaler=scaler)``); each rank
unscales its own gradients; the found-inf flag is then reduced over the whole pipeline (and
its replicas), so every rank's ``scaler.step`` makes the same decision and every
``scaler.update`` the same scale. Each reduction waits at most the pipeline's timeout.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState
from torch.optim import Optimizer

from gpipe.comm.process_group import bounded_wait
from gpipe.runtime.dtensors import is_dtensor, local_part

__all__ = ["unscale_"]


def _found_inf(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> list[torch.Tensor]:
    """The scaler's found-inf flags for ``optimizer`` after its ``unscale_``."""
    try:
        state = scaler._per_optimizer_states[id(optimizer)]
        return list(state["found_inf_per_device"].values())
    except (AttributeError, KeyError) as exc:  # a GradScaler unlike torch's own
        raise TypeError(
            f"cannot read the found-inf flags of {type(scaler).__name__}: gpipe needs "
            "torch.amp.GradScaler"
        ) from exc


def _has_split_gradients(optimizer: Optimizer) -> bool:
    return any(is_dtensor(p.grad) for group in optimizer.param_groups for p in group["params"])


def _unscale_split(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> None:
    """``scaler.unscale_(optimizer)`` for a tensor-parallel stage, whose split gradients
    (DTensors) sit beside whole ones: torch's unscaling takes them in one call, which DTensor
    refuses, so each rank unscales its own part and records the found-inf flags as torch
    would. The flags are then reduced over every group by ``unscale_``."""
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.UNSCALED:
        raise RuntimeError("unscale_() has already been called on this optimizer this step")
    inverse = 1.0 / scaler.get_scale()
    found: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = local_part(param.grad)
                flag = found.setdefault(grad.device, torch.zeros(1, device=grad.device))
                flag.add_((~torch.isfinite(grad)).any().reshape(1))
                grad.mul_(inverse)
    state["found_inf_per_device"] = found
    state["stage"] = OptState.UNSCALED


def unscale_(
    scaler: torch.amp.GradScaler,
    optimizer: Optimizer,
    groups: Iterable[dist.ProcessGroup | None],
    *,
    timeout: float,
    stage: int,
) -> bool:
    """``scaler.unscale_(optimizer)``, then its found-inf flags made the maximum over every
    rank of ``groups`` (a pipeline, its replicas); returns whether the step will be skipped.
    Each reduction waits at most ``timeout`` seconds for the other ranks, then raises
    StageError naming ``stage``, this rank's. Call it once per step, after the backward and
    before clipping or ``scaler.step``."""
    if not scaler.is_enabled():
        return False
    if _has_split_gradients(optimizer):
        _unscale_split(scaler, optimizer)
    else:
        scaler.unscale_(optimizer)
    flags = _found_inf(scaler, optimizer)
    found = torch.zeros(1, dtype=torch.float32)
    for flag in flags:
        found = torch.maximum(found, flag.detach().float().cpu().reshape(1))
    for group in groups:
        work = dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group, async_op=True)
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        what = f"waiting for loss scaling's found-inf flag from ranks {ranks}"
        bounded_wait(work, timeout, stage, what)
    for flag in flags:
        flag.fill_(found.item())
    if not flags:  # nothing of this optimizer's had a gradient here: the others decide
        state = scaler._per_optimizer_states[id(optimizer)]
        device = scaler._scale.device if scaler._scale is not None else torch.device("cpu")
        state["found_inf_per_device"][device] = found.to(device)
    return bool(found.item())
