"""A training step of a transformer on a cluster, predicted: its time, FLOP rate and memory.

A layout's ``StepModel`` (``gpipe.planning.cluster_step``) gives each pipeline stage's
``Costs``; gpipe's own simulator (``gpipe.planning.replay.simulate``) replays the schedule
under them, with the pipeline's messages on their link and the replicas' gradient reduction
in buckets during each stage's last backward, as ``simulate`` models it. Sharded replicas
gather their updated parameters while the next step's first forward runs (what of the
gather that forward cannot hide is added), and the optimizer's step follows. Memory per GPU
counts the activations in flight as the simulator does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpipe.planning.cluster_layout import Layout, check_layout
from gpipe.planning.cluster_memory import MemoryParts
from gpipe.planning.cluster_step import StepModel
from gpipe.planning.costs import Costs
from gpipe.planning.replay import SimResult, simulate
from gpipe.planning.transformer import TransformerShape
from gpipe.schedules import build

__all__ = ["Prediction", "predict"]


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step: seconds, teraFLOP/s per GPU as Megatron-LM's equation 3
    counts them (recomputation included), model FLOPs utilization (without it), the memory
    of the fullest GPU by part, and where the time goes: the pipeline's idle share
    (``bubble``), the tensor-parallel collectives the busiest process waits for, the
    replicas' collectives left exposed, and the optimizer's step."""

    layout: Layout
    step_time_s: float
    tflops_per_gpu: float
    mfu: float
    memory: MemoryParts
    bubble: float
    tp_comm_s: float
    dp_exposed_s: float
    optimizer_s: float

    @property
    def memory_per_gpu_gib(self) -> float:
        return self.memory.total / 2**30

    def fits(self) -> bool:
        return self.memory.total <= self.layout.cluster.device.memory_bytes


@dataclass(frozen=True)
class _Replayed:
    """What the simulation of a step says: its makespan, each rank's busy time, activation
    peak and first forward's end, and the gradient reduction left past the programs."""

    makespan: float
    busy: list[float]
    peaks: list[float]
    first_forward_end: list[float]
    reduce_exposed: float

    @property
    def bubble(self) -> float:
        return 1 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


@functools.lru_cache(maxsize=64)
def _simulate(schedule: str, k: int, m: int, v: int, d: int, costs: Costs) -> _Replayed:
    """The step of ``schedule`` on K processes, M micro-batches, v stages per process and
    D replicas, replayed under ``costs`` (cached: layouts that differ only in what the
    simulator does not see, such as how sharded the states are, share it).

    Once a pipeline is in its steady state, every K more micro-batches add the same time
    and memory, and the time is the busiest process's work: a long step is simulated at n
    and n + K micro-batches (n = 2K, 4K, 8K, ... until the step grows by the busiest
    process's work) and extended along that line; a step that does not settle while such a
    pair is shorter than M (2n + K < M) is simulated whole, since the next pair would cost
    more than the whole step and extending gives what the whole simulation does. A V can
    take several rounds to settle (its first rounds fill the gaps of its cap faster than it
    can keep up). The tests check both against the whole simulation."""

    def run(n: int) -> SimResult:
        return simulate(build(schedule, k, n, v), costs, data_parallel=d)

    n = 2 * k
    while 2 * n + k < m:
        before, after = run(n), run(n + k)
        if _steady(before, after):
            return _extended(before, after, (m - n) / k)
        n *= 2
    whole = run(m)
    return _Replayed(
        makespan=whole.makespan,
        busy=list(whole.busy),
        peaks=list(whole.peak_rank_activation_bytes),
        first_forward_end=_first_forward_ends(whole),
        reduce_exposed=max(whole.allreduce_exposed, default=0.0),
    )


def _extended(before: SimResult, after: SimResult, rounds: float) -> _Replayed:
    """The step ``rounds`` more rounds of K micro-batches past ``before``, along the line
    from it to ``after`` (one round on)."""

    def line(a: Sequence[float], b: Sequence[float]) -> list[float]:
        return [x + rounds * (y - x) for x, y in zip(a, b, strict=True)]

    return _Replayed(
        makespan=line([before.makespan], [after.makespan])[0],
        busy=line(before.busy, after.busy),
        peaks=line(before.peak_rank_activation_bytes, after.peak_rank_activation_bytes),
        first_forward_end=_first_forward_ends(before),
        reduce_exposed=max(after.allreduce_exposed, default=0.0),
    )


def _steady(before: SimResult, after: SimResult) -> bool:
    """Whether K more micro-batches lengthened the step by exactly the busiest process's
    work on them: then every further K do the same."""
    grown = after.makespan - before.makespan
    work = max(b - a for a, b in zip(before.busy, after.busy, strict=True))
    return math.isclose(grown, work, rel_tol=1e-9, abs_tol=1e-12 * after.makespan)


def _first_forward_ends(run: SimResult) -> list[float]:
    return [times[1] if times else 0.0 for times in run.compute_times]


def predict(shape: TransformerShape, layout: Layout) -> Prediction:
    """The step ``layout`` runs for a model of ``shape``; ValueError (one line) if it cannot
    run."""
    check_layout(shape, layout)
    model = StepModel.of(shape, layout)
    replayed = _simulate(
        layout.schedule,
        layout.stages,
        layout.microbatches,
        layout.virtual_stages,
        layout.data_parallel,
        model.costs(),
    )
    # the next step's first forward hides what it can of the parameters' gather
    ends = replayed.first_forward_end
    gather = max(max(0.0, g - e) for g, e in zip(model.gather_seconds(), ends, strict=True))
    optimizer = model.optimizer_seconds()
    step = replayed.makespan + gather + optimizer
    hardware, useful = model.flops()
    gpus, k = layout.cluster.gpus, layout.stages
    memory = model.peak_memory(replayed.peaks)
    busiest = max(range(k), key=lambda r: replayed.busy[r])
    tp_comm = sum(model.stages[s].tp_comm for s in model.held[busiest])
    return Prediction(
        layout=layout,
        step_time_s=step,
        tflops_per_gpu=hardware / step / gpus / 1e12,
        mfu=useful / step / gpus / layout.cluster.device.peak_flops,
        memory=memory,
        bubble=replayed.bubble,
        tp_comm_s=layout.microbatches * tp_comm,
        dp_exposed_s=replayed.reduce_exposed + gather,
        optimizer_s=optimizer,
    )
