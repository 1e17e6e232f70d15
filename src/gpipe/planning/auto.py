"""``schedule="auto"``: of every schedule, stages per process and number of micro-batches that
the memory planner fits in the budget, the one the simulator predicts fastest for the model's
measured layer costs (``gpipe plan --suggest``'s search, with the processes fixed).

The costs are timed on the real device (``timed_costs``), so they carry each layer's fixed
cost per call: a schedule that would cut the mini-batch into many small micro-batches pays
for it here as it would in the step. Messages are taken as free, as in the search."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.comm.agreement import on_first_rank
from gpipe.planning.memory import format_bytes, profile
from gpipe.planning.suggest import (
    Candidate,
    LayerCosts,
    first_rows,
    rows_of,
    search,
    timed_costs,
)
from gpipe.runtime.partitions import as_sequential
from gpipe.runtime.recompute import CHECKPOINT_MODES
from gpipe.schedules import Placement, traits

__all__ = [
    "AUTO",
    "VIRTUAL_STAGES",
    "AutoChoice",
    "agreed_choice",
    "check_auto",
    "choose",
    "device_memory",
]

AUTO = "auto"
VIRTUAL_STAGES = (2, 3, 4)  # stages per process tried for the looped placements


@dataclass(frozen=True)
class AutoChoice:
    """The configuration chosen, and the fastest one of another schedule (or other stages
    per process), for comparison; ``searched`` configurations were tried."""

    chosen: Candidate
    runner_up: Candidate | None
    searched: int
    budget: float

    @property
    def schedule(self) -> str:
        return self.chosen.schedule

    @property
    def chunks(self) -> int:
        return self.chosen.chunks

    @property
    def balance(self) -> list[int]:
        return list(self.chosen.balance)

    def announcement(self) -> str:
        """One line: the choice and the runner-up, each with its predicted bubble and peak
        memory per process."""
        line = f"schedule auto: {_describe(self.chosen)}"
        if self.runner_up is not None:
            ratio = self.runner_up.step_time / self.chosen.step_time
            line += f"; runner-up {_describe(self.runner_up)}, {ratio:.2f}x the step time"
        return line + f" ({self.searched} searched, {format_bytes(self.budget)} per process)"


def _describe(c: Candidate) -> str:
    looped = traits(c.schedule).placement is Placement.LOOPED
    name = f"{c.schedule} v={c.virtual_stages}" if looped else c.schedule
    return (
        f"{name}, {c.chunks} micro-batch{'es' if c.chunks > 1 else ''}, balance "
        f"{list(c.balance)}: bubble {c.bubble:.1%}, peak {format_bytes(c.peak_bytes)}"
    )


def device_memory(device: torch.device | str) -> float:
    """Bytes one process may use on ``device``: a GPU's memory, or on CPU this machine's
    memory shared by its processes (``LOCAL_WORLD_SIZE``, as torchrun sets it)."""
    device = torch.device(device)
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _to(sample: Any, device: torch.device) -> Any:
    if isinstance(sample, Tensor):
        return sample.to(device)
    return type(sample)(t.to(device) if isinstance(t, Tensor) else t for t in sample)


def choose(
    layers: nn.Sequential | Iterable[nn.Module],
    sample: Any,
    *,
    n_ranks: int,
    device_bytes: float,
    chunks: int | None = None,
    checkpoint: str = "except_last",
    optimizer: str = "adam",
    timeout: float = 1.0,
    device: torch.device | str | None = None,
    costs: LayerCosts | None = None,
) -> AutoChoice:
    """Choose for ``layers`` on ``n_ranks`` processes, for mini-batches like ``sample`` (one
    whole mini-batch of inputs, as ``step`` takes it): each layer is profiled and timed
    (``costs``, if not given) on a micro-batch's share of its rows, then every schedule,
    ``VIRTUAL_STAGES`` for the looped ones and every ``chunk_choices`` of its rows (only
    ``chunks`` if given) is planned and simulated. Raises ValueError if none fits in
    ``device_bytes`` per process."""
    _check_checkpoint(checkpoint)
    module = as_sequential(layers)
    rows = rows_of(sample)
    micro = first_rows(sample, max(1, rows // max(2, n_ranks)))
    if costs is None:
        costs = timed_costs(module, micro, timeout=timeout, device=device)
    where = next((p.device for p in module.parameters()), torch.device("cpu"))
    found = search(
        profile(module, _to(micro, where)),  # on the meta device if the layers are there
        costs,
        batch_size=rows,
        device_bytes=device_bytes,
        optimizer=optimizer,
        stages=[n_ranks],
        chunks=None if chunks is None else [chunks],
        checkpoints=[checkpoint],
        virtual_stages=VIRTUAL_STAGES,
    )
    if not found.ranked:
        if found.least is None:
            raise ValueError(
                f"schedule='auto' found no schedule for {len(module)} layers on {n_ranks} "
                f"processes with mini-batches of {rows} rows"
                + ("" if chunks is None else f" in {chunks} micro-batches")
            )
        raise ValueError(
            f"schedule='auto': nothing fits in {format_bytes(device_bytes)} per process; the "
            f"least memory of {found.searched} configurations is "
            f"{format_bytes(found.least.peak_bytes)} ({_describe(found.least)})"
        )
    chosen = found.ranked[0]
    runner_up = next(
        (
            c
            for c in found.ranked[1:]
            if (c.schedule, c.virtual_stages) != (chosen.schedule, chosen.virtual_stages)
        ),
        None,
    )
    return AutoChoice(chosen, runner_up, found.searched, float(device_bytes))


def check_auto(schedule: object, balance: object, checkpoint: object) -> bool:
    """Whether ``schedule`` is ``"auto"``, whose choice includes the cut: a given ``balance``,
    or a ``Layers`` policy the search cannot weigh, is refused."""
    if schedule != AUTO:
        return False
    if balance is not None:
        raise ValueError("schedule='auto' chooses the balance too: leave balance=None")
    _check_checkpoint(checkpoint)
    return True


def _check_checkpoint(checkpoint: object) -> None:
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(
            f"schedule='auto' searches with checkpoint 'always', 'except_last' or 'never', got "
            f"{checkpoint!r}: pass one of them, or name the schedule"
        )


def agreed_choice(
    module: nn.Sequential,
    sample: Any,
    *,
    n_ranks: int,
    chunks: int | None,
    checkpoint: str,
    memory_budget: float | None,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> AutoChoice:
    """``schedule="auto"``: chosen on the first rank of ``group`` (``gpipe.planning.auto``),
    told to the others and announced in one line on the world's first rank."""
    budget = device_memory(device) if memory_budget is None else float(memory_budget)

    def decide() -> AutoChoice:
        if sample is None:
            raise ValueError("schedule='auto' needs sample=, one mini-batch of the model's input")
        return choose(
            module,
            sample,
            n_ranks=n_ranks,
            device_bytes=budget,
            chunks=chunks,
            checkpoint=checkpoint,
            device=device,
        )

    choice = on_first_rank(decide, group, "choosing the schedule (schedule='auto')")
    if dist.get_rank() == 0:
        print(choice.announcement(), file=sys.stderr, flush=True)
    return choice
