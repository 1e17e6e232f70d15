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
from collections.abc import Sequence
from dataclasses import dataclass

from gpipe.planning.cluster_layout import Layout, check_layout
from gpipe.planning.cluster_memory import MemoryParts
from gpipe.planning.cluster_step import StepModel
from gpipe.planning.costs import Costs
from gpipe.planning.replay import simulate
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

    Past a few rounds of K micro-batches a pipeline is in its steady state, where every K
    more add the same time and memory: a long step is simulated at 2K and 3K micro-batches
    and extended along that line (the tests check it against the whole simulation)."""
    counts = (m,) if m <= 3 * k or k == 1 else (2 * k, 3 * k)
    runs = [simulate(build(schedule, k, n, v), costs, data_parallel=d) for n in counts]
    share = (m - counts[0]) / k  # rounds of K past the first run

    def line(values: Sequence[Sequence[float]]) -> list[float]:
        a, b = values[0], values[-1]
        return [x + share * (y - x) for x, y in zip(a, b, strict=True)]

    return _Replayed(
        makespan=line([[r.makespan] for r in runs])[0],
        busy=line([r.busy for r in runs]),
        peaks=line([r.peak_rank_activation_bytes for r in runs]),
        first_forward_end=[times[1] if times else 0.0 for times in runs[0].compute_times],
        reduce_exposed=max(runs[-1].allreduce_exposed, default=0.0),
    )


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
