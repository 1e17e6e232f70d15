"""Everything a benchmark compares, built the same way: one step of training on a workload.

A contender runs either in every process (a pipeline, or the "stages at once" baseline) or
in the first process alone while the others wait (the single-process baselines and
libraries). Each hands back a ``step`` and the layers each of its stages holds on this
process, so that its activation memory can be metered stage by stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.bench.workloads import Workload
from gpipe.pipe import GPipe
from gpipe.pipeline import Pipeline
from gpipe.runtime.partitions import stage_bounds
from gpipe.runtime.recompute import CHECKPOINT_MODES
from gpipe.schedules import SCHEDULES, traits

if TYPE_CHECKING:
    import torchgpipe

__all__ = ["STAGES_PER_PROCESS", "Contender", "Runner", "contenders"]

K = 2  # processes: the machine this runs on in CI has two cores
# Stages per process under a schedule that places several on each (the workloads'
# ``interleaved_balance`` cuts K times as many stages).
STAGES_PER_PROCESS = 2


@dataclass
class Runner:
    """One contender, built in this process: ``step`` runs one training step (gradients
    zeroed first); ``stages`` lists (stage, its layers here) for the activation meter."""

    step: Callable[[], None]
    stages: list[tuple[int, nn.Module]]


@dataclass(frozen=True)
class Contender:
    name: str
    group: str  # "baseline", "gpipe", "pytorch" or "torchgpipe"
    single: bool  # runs in the first process only
    build: Callable[[Workload, int, Tensor, Tensor], Runner]
    counterpart: str | None = None  # the contender this one is compared with
    schedule: str | None = None
    checkpoint: str | None = None
    runs_like: str | None = None  # the gpipe schedule whose micro-batch counts it takes
    fewest: int = 1  # micro-batches its own library asks for at least, beyond ``runs_like``'s

    def not_run_at(self, chunks: int) -> str | None:
        """Why this contender cannot run ``chunks`` micro-batches on K processes, or None."""
        if chunks < self.fewest:
            return f"{self.name} takes at least {self.fewest} micro-batches on {K} processes"
        name = self.schedule or self.runs_like
        if name is None or traits(name).runs(K, chunks, STAGES_PER_PROCESS):
            return None
        fewest = traits(name).fewest_microbatches(K, STAGES_PER_PROCESS)
        rounds = f", a multiple of {K}" if traits(name).microbatches_per_round else ""
        return f"{name} takes at least {fewest} micro-batches{rounds} on {K} processes"


def _layers(model: nn.Sequential, balance: tuple[int, ...], stage: int) -> nn.Sequential:
    start, stop = stage_bounds(list(balance))[stage]
    return cast(nn.Sequential, model[start:stop])  # a slice is a Sequential; torch types it Module


def _per_stage(model: nn.Sequential, balance: tuple[int, ...]) -> list[tuple[int, nn.Module]]:
    return [(s, _layers(model, balance, s)) for s in range(len(balance))]


# --- baselines --------------------------------------------------------------------------------


def _full_batch(w: Workload, chunks: int, x: Tensor, y: Tensor) -> Runner:
    model = w.build()

    def step() -> None:
        model.zero_grad()
        w.loss_fn(model(x), y).backward()

    return Runner(step, _per_stage(model, w.balance))


def _accumulation(w: Workload, chunks: int, x: Tensor, y: Tensor) -> Runner:
    model = w.build()
    pairs = list(zip(x.chunk(chunks), y.chunk(chunks), strict=True))

    def step() -> None:
        model.zero_grad()
        for xm, ym in pairs:
            (w.loss_fn(model(xm), ym) * (len(xm) / len(x))).backward()

    return Runner(step, _per_stage(model, w.balance))


def _at_once(w: Workload, chunks: int, x: Tensor, y: Tensor, held: bool = False) -> Runner:
    """Each process runs its own stage over the micro-batches as plain accumulation, all at
    once and without communication: what the machine can do when nobody waits. ``held``:
    all the forwards first, every graph kept, then all the backwards, as fill-drain holds
    them, which shows what holding M graphs costs apart from the pipeline itself."""
    rank = dist.get_rank()
    model = w.build()
    part = _layers(model, w.balance, rank)
    last = rank == K - 1
    if rank == 0:
        inputs = list(x.chunk(chunks))
    else:  # the stage's real input: the previous stage's output
        with torch.no_grad():
            inputs = list(_layers(model, w.balance, rank - 1)(x).chunk(chunks))
    targets = list(y.chunk(chunks))
    with torch.no_grad():
        grad = torch.ones_like(part(inputs[0]))

    def backward(out: Tensor, ym: Tensor, rows: int) -> None:
        if last:
            (w.loss_fn(out, ym) * (rows / len(x))).backward()
        else:
            out.backward(grad)

    def step() -> None:
        part.zero_grad()
        outs = []
        for xm, ym in zip(inputs, targets, strict=True):
            h = xm.detach().requires_grad_(rank > 0 and xm.is_floating_point())
            out = part(h)
            if held:
                outs.append((out, ym, len(xm)))
            else:
                backward(out, ym, len(xm))
        for out, ym, rows in reversed(outs):
            backward(out, ym, rows)

    return Runner(step, [(rank, part)])


def _at_once_held(w: Workload, chunks: int, x: Tensor, y: Tensor) -> Runner:
    return _at_once(w, chunks, x, y, held=True)


# --- gpipe ------------------------------------------------------------------------------------


def _pipeline(schedule: str, checkpoint: str) -> Callable[..., Runner]:
    def build(w: Workload, chunks: int, x: Tensor, y: Tensor) -> Runner:
        several = traits(schedule).several_stages_per_rank
        balance = w.interleaved_balance if several else w.balance
        pipe = Pipeline(
            w.build(),
            list(balance),
            chunks=chunks,
            checkpoint=checkpoint,
            schedule=schedule,
            loss_fn=w.loss_fn,
            device="cpu",
        )
        inputs = x if pipe.is_first else None
        targets = y if pipe.is_last else None

        def step() -> None:
            pipe.zero_grad()
            pipe.step(inputs, targets)

        return Runner(step, [(pipe.rank, pipe)])

    return build


def _one_process(library: str) -> Callable[..., Runner]:
    """``gpipe.GPipe`` or ``torchgpipe.GPipe``: both partitions on the CPU in this process."""

    def build(w: Workload, chunks: int, x: Tensor, y: Tensor) -> Runner:
        wrapper: type[GPipe | torchgpipe.GPipe]
        if library == "torchgpipe":
            import torchgpipe

            wrapper = torchgpipe.GPipe
        else:
            wrapper = GPipe
        pipe = wrapper(
            w.build(), list(w.balance), devices=["cpu"] * K, chunks=chunks, checkpoint="except_last"
        )

        def step() -> None:
            pipe.zero_grad()
            w.loss_fn(pipe(x), y).backward()

        return Runner(step, list(enumerate(pipe.partitions)))

    return build


# --- PyTorch's torch.distributed.pipelining ------------------------------------------------


_V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
# each gpipe schedule's PyTorch counterpart (zero-bubble's ZB-H1 has none: 1F1B's it is)
COUNTERPARTS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "zero-bubble": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
    "looped-bfs": "ScheduleLoopedBFS",
    "zero-bubble-v": "ScheduleZBVZeroBubble",
    "dualpipe-v": "ScheduleDualPipeV",
}


# where PyTorch asks for more micro-batches than gpipe's schedule of the same name: its
# Schedule1F1B refuses fewer than its stages, which gpipe's 1f1b runs (M = 1, the seeds' baseline)
_PYTORCH_FEWEST = {"Schedule1F1B": K}


def _pytorch(schedule_name: str) -> Callable[..., Runner]:
    def build(w: Workload, chunks: int, x: Tensor, y: Tensor) -> Runner:
        from torch.distributed import pipelining

        rank = dist.get_rank()
        model = w.build()
        several = schedule_name not in ("ScheduleGPipe", "Schedule1F1B")
        balance = w.interleaved_balance if several else w.balance
        n_stages = len(balance)
        if schedule_name in _V_SHAPED:
            mine = [rank, n_stages - 1 - rank]
        else:
            mine = list(range(rank, n_stages, K))
        parts = {s: _layers(model, balance, s) for s in mine}
        stages = [
            pipelining.PipelineStage(parts[s], s, n_stages, torch.device("cpu")) for s in mine
        ]
        schedule_class = getattr(pipelining, schedule_name)
        schedule = schedule_class(stages if several else stages[0], chunks, loss_fn=w.loss_fn)
        holds_first, holds_last = 0 in mine, n_stages - 1 in mine

        def step() -> None:
            for part in parts.values():
                part.zero_grad()
            args = (x,) if holds_first else ()
            kwargs = {"target": y, "losses": []} if holds_last else {}
            schedule.step(*args, **kwargs, return_outputs=False)

        layers = nn.ModuleList([layer for part in parts.values() for layer in part])
        return Runner(step, [(rank, layers)])

    return build


def contenders(
    schedules: tuple[str, ...] = tuple(SCHEDULES), modes: tuple[str, ...] = CHECKPOINT_MODES
) -> list[Contender]:
    """Every contender, in the order reports list them."""
    out = [
        Contender("full-batch", "baseline", True, _full_batch),
        Contender("accumulation", "baseline", True, _accumulation),
        Contender("at-once", "baseline", False, _at_once),
        Contender("at-once-held", "baseline", False, _at_once_held),
    ]
    for schedule in schedules:
        for mode in modes:
            out.append(
                Contender(
                    f"gpipe/{schedule}/{mode}",
                    "gpipe",
                    False,
                    _pipeline(schedule, mode),
                    counterpart=f"pytorch/{COUNTERPARTS[schedule]}"
                    if schedule in COUNTERPARTS
                    else None,
                    schedule=schedule,
                    checkpoint=mode,
                )
            )
    out.append(
        Contender(
            "gpipe/GPipe-1-process",
            "gpipe",
            True,
            _one_process("gpipe"),
            counterpart="torchgpipe",
            checkpoint="except_last",
        )
    )
    # the baselines of one stage per process, and the counterparts of the others chosen
    pytorch = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b"}
    for schedule in schedules:
        if traits(schedule).several_stages_per_rank and schedule in COUNTERPARTS:
            pytorch[COUNTERPARTS[schedule]] = schedule
    for name, like in pytorch.items():
        fewest = _PYTORCH_FEWEST.get(name, 1)
        out.append(
            Contender(
                f"pytorch/{name}", "pytorch", False, _pytorch(name), runs_like=like, fewest=fewest
            )
        )
    out.append(
        Contender(
            "torchgpipe", "torchgpipe", True, _one_process("torchgpipe"), checkpoint="except_last"
        )
    )
    return out
