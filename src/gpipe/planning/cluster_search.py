"""The fastest layouts of a model on a cluster: D x T x K x schedule x micro-batch x
recomputation x sharding enumerated, each estimated in closed form, the most promising
simulated.

Every layout gets a quick estimate from the closed forms (``gpipe.planning.closed_forms``:
the schedule's bubble and the micro-batches each process keeps in flight) over its
``StepModel``: the busiest process's work per micro-batch, stretched by the bubble, plus the
replicas' collectives that its last backward or first forward cannot hide, and the memory
of its fullest GPU. Those that fit are ranked by it; the best ``SIMULATED`` (and the best of
each schedule) are then predicted by the simulator (``gpipe.planning.cluster.predict``),
which gives the order printed. Layouts that cannot run or do not fit are counted by reason.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from gpipe.parallel.sharding import TRAINED_SHARD_MODES
from gpipe.planning.bubbles import scenario
from gpipe.planning.closed_forms import closed_form_bubble, closed_form_peak
from gpipe.planning.cluster import Prediction, predict
from gpipe.planning.cluster_layout import Layout, check_layout, splits_over
from gpipe.planning.cluster_memory import MemoryParts
from gpipe.planning.cluster_step import StepModel
from gpipe.planning.costs import Costs
from gpipe.planning.hardware import Cluster
from gpipe.planning.layer_costs import RECOMPUTE, STACKS
from gpipe.planning.replay import simulate
from gpipe.planning.transformer import TransformerShape
from gpipe.schedules import Placement, traits

__all__ = ["SIMULATED", "Estimate", "Search", "SearchSpace", "estimate", "search"]

SIMULATED = 8  # layouts the simulator ranks, besides the best of each schedule
# Every schedule but those another of the list dominates in this model: gpipe (1f1b's bubble,
# all M micro-batches held), looped-bfs (interleaved's bubble, all M held) and dualpipe-v
# (zero-bubble-v's V with half a micro-batch more held and, without expert parallelism's
# messages to hide, no smaller a bubble). V-Half and V-Min hold a half and a third of 1F1B's
# activations: where nothing else fits without recomputation, they can be the fastest.
_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "zero-bubble", "interleaved-zero-bubble")
_SCHEDULES += ("zero-bubble-v", "v-half", "v-min")
_CAPPED_V = ("v-half", "v-min")  # no closed-form bubble: estimated by simulation
_MOST_VIRTUAL = 8  # the most stages per process a looped schedule is searched with


@dataclass(frozen=True)
class SearchSpace:
    """What the search tries; None for the sizes means every size that runs: tensor
    parallel powers of two within a node, as many stages as divide the rest (and the
    replicas, whatever T x K leave of the GPUs), and stages per process that divide a
    process's layers (up to ``_MOST_VIRTUAL``)."""

    data_parallel: Sequence[int] | None = None
    tensor_parallel: Sequence[int] | None = None
    stages: Sequence[int] | None = None
    micro_batches: Sequence[int] = (1, 2, 4, 8)
    schedules: Sequence[str] = _SCHEDULES
    virtual_stages: Sequence[int] | None = None
    recompute: Sequence[str] = RECOMPUTE
    shards: Sequence[str | None] = (None, "optimizer", "full")


@dataclass(frozen=True)
class Estimate:
    """A layout's quick estimate: its step in seconds and its fullest GPU's memory."""

    layout: Layout
    step_s: float
    memory: MemoryParts
    rough: bool = False  # a V-Half or V-Min bubble not simulated yet (``estimate``'s rough)


@dataclass
class Search:
    """What ``search`` found: the ``best`` layouts that fit, simulated, fastest first; how
    many were ``searched``, how many fit, and why the others were left (``rejected``: a
    reason and how many it ruled out); of those that do not fit, the one needing the
    ``least`` memory; and the fastest layout that ``gpipe train`` runs (``trained``: the
    planner also prices Megatron's distributed optimizer, ``shard="optimizer"``, which
    ``Pipeline`` does not offer)."""

    best: list[Prediction]
    searched: int = 0
    fitting: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    least: Estimate | None = None
    trained: Prediction | None = None
    seconds: float = 0.0


def _divisors(n: int) -> list[int]:
    """``n``'s divisors, ascending (found up to its square root: a cluster may be large)."""
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return small + [n // i for i in reversed(small) if i * i != n]


def _virtual(shape: TransformerShape, k: int, schedule: str, space: SearchSpace) -> list[int]:
    """Stages per process to try with ``schedule`` on K processes: those of
    ``space.virtual_stages`` that the schedule holds (a V holds two, which 1 and 2 both
    name, as ``check_virtual_stages`` reads them), or if none are given, those that divide a
    process's layers; none where the schedule holds none of those given."""
    placement = traits(schedule).placement
    pinned = space.virtual_stages
    if placement is Placement.ONE_PER_RANK:
        return [1] if pinned is None or 1 in pinned else []
    if placement is Placement.V:
        held = pinned is None or 1 in pinned or 2 in pinned
        return [2] if held and 2 * k <= shape.layers else []
    per = shape.layers // k
    if pinned is not None:
        return [v for v in pinned if v >= 1 and k * v <= shape.layers]
    found = [v for v in _divisors(per) if 2 <= v <= _MOST_VIRTUAL] if shape.layers % k == 0 else []
    return found or ([2] if 2 * k <= shape.layers else [])


def _why_no_virtual(schedule: str, space: SearchSpace) -> str:
    """Why ``_virtual`` gave ``schedule`` no stages per process to try."""
    placement = traits(schedule).placement
    if space.virtual_stages is not None and placement is Placement.ONE_PER_RANK:
        return "--virtual-stages given, and the schedule runs one stage per process"
    if space.virtual_stages is not None and placement is Placement.V:
        return "--virtual-stages given, and the schedule holds two stages per process"
    return "more stages than layers"


def _schedules(shape: TransformerShape, k: int, space: SearchSpace) -> list[str]:
    """The schedules to try on K processes: all of the space's, or on one process (where
    they run alike) the first that holds the stages per process given."""
    if k > 1:
        return list(space.schedules)
    held = (s for s in space.schedules if _virtual(shape, k, s, space))
    return [next(held, space.schedules[0])]


def _layouts(
    shape: TransformerShape,
    cluster: Cluster,
    batch: tuple[int, int],
    space: SearchSpace,
    software: tuple[str, str | None],
    rejected: Counter[str],
) -> Iterator[Layout]:
    """Every layout of the space that can run; those that cannot are counted by reason."""
    n, per_node = cluster.gpus, cluster.device.gpus_per_node
    global_batch, seq_len = batch
    precision, stack = software
    tps = space.tensor_parallel or [t for t in _divisors(per_node) if t & (t - 1) == 0]
    recomputes = list(space.recompute)
    flash = STACKS[stack or cluster.device.stack].attention == "flash"
    if flash and "selective" in recomputes and "none" in recomputes:
        # under FlashAttention selective recomputation keeps and redoes what none does
        recomputes.remove("selective")
    for t in tps:
        if n % t or not splits_over(shape, t):
            rejected["T does not divide the GPUs, the heads or the MLP"] += 1
            continue
        for k in space.stages or _divisors(n // t):
            if n % (t * k):
                rejected["T x K does not divide the GPUs"] += 1
                continue
            if k > shape.layers:
                rejected["more stages than layers"] += 1
                continue
            d = n // (t * k)
            if space.data_parallel is not None and d not in space.data_parallel:
                rejected["T x K leave another number of replicas than D"] += 1
                continue
            for b in space.micro_batches:
                if global_batch % (d * b):
                    rejected["the global batch does not divide into D x micro-batch"] += 1
                    continue
                m = global_batch // (d * b)
                for schedule in _schedules(shape, k, space):
                    virtual = _virtual(shape, k, schedule, space)
                    if not virtual:
                        rejected[_why_no_virtual(schedule, space)] += 1
                    for v in virtual:
                        if not traits(schedule).runs(k, m, v):
                            rejected["the schedule does not run M micro-batches on K"] += 1
                            continue
                        shards = list(space.shards) if d > 1 else [None] * (None in space.shards)
                        if not shards:
                            rejected["--shard splits states over replicas: D is 1"] += 1
                        for recompute in recomputes:
                            for shard in shards:
                                yield Layout(
                                    cluster,
                                    d,
                                    t,
                                    k,
                                    global_batch,
                                    b,
                                    seq_len,
                                    schedule,
                                    v,
                                    recompute,
                                    shard,
                                    precision,
                                    stack,
                                )


def _unsharded(layout: Layout) -> tuple[object, ...]:
    return (
        layout.data_parallel,
        layout.tensor_parallel,
        layout.stages,
        layout.schedule,
        layout.virtual_stages,
        layout.micro_batch,
        layout.recompute,
    )


@functools.lru_cache(maxsize=1024)
def _peaks(schedule: str, k: int, m: int, v: int) -> tuple[float, ...]:
    return closed_form_peak(schedule, k, m, v) or (float(m),) * k


def _fallback_bubble(
    schedule: str, k: int, m: int, v: int, mean: Sequence[float], rough: bool
) -> float:
    """A bubble to rank a layout by where its schedule has no closed form at its costs
    (``mean``: a stage's forward, backward with its recomputation, and weight gradient): a
    looped schedule's, or the memory-capped Vs' simulated, or where ``rough`` (simulating
    them takes seconds on many processes) 1F1B's, about the least they reach on more than a
    few."""
    if schedule in _CAPPED_V:
        if rough:
            return (k - 1) / (m + k - 1)
        f, b, w = mean
        return _capped_v_bubble(schedule, k, m, _tenths(b / f), _tenths(w / f))
    return (k - 1) / (v * m + k - 1)


def _tenths(ratio: float) -> float:
    """``ratio`` to a tenth (at least a tenth), so that layouts of near costs share a simulation
    (the bubble moves by a few points per tenth of B / W)."""
    return max(0.1, round(ratio, 1))


@functools.lru_cache(maxsize=1024)
def _capped_v_bubble(schedule: str, k: int, m: int, backward: float, weight: float) -> float:
    """V-Half's or V-Min's bubble on K processes, a forward taking 1: their order is played
    for F = B = W, so their bubble grows with B / W (about 1F1B's at F = B = W, twice that
    where recomputation doubles B) and no formula holds. Simulated at 2K and 3K micro-batches
    and extended along that line past 3K, as ``cluster.predict`` extends a long step."""
    costs = Costs(forward=1.0, backward=backward, weight=weight)

    def makespan(n: int) -> float:
        return simulate(*scenario(schedule, k, n, costs, 2)).makespan

    if m <= 3 * k:
        span = makespan(m)
    else:
        two, three = makespan(2 * k), makespan(3 * k)
        span = three + (m - 3 * k) * (three - two) / k
    work = m * (1.0 + backward + weight)
    return max(0.0, 1.0 - work / span)


def estimate(
    shape: TransformerShape, layout: Layout, model: StepModel | None = None, rough: bool = False
) -> Estimate:
    """A layout's step and memory from the closed forms, without simulating the step; a
    layout that does not fit its device gets no step time (infinity). ``model``: the
    layout's ``StepModel``, if the caller has it. ``rough``: V-Half and V-Min's bubble taken
    as 1F1B's rather than simulated (``_refine`` simulates those that then rank high)."""
    model = model or StepModel.of(shape, layout)
    k, m, v = layout.stages, layout.microbatches, layout.virtual_stages
    held = model.held
    peaks = _peaks(layout.schedule, k, m, v)
    stored = [sum(model.stages[s].stored for s in stages) for stages in held]
    memory = model.peak_memory([p * b for p, b in zip(peaks, stored, strict=True)])
    if memory.total > layout.cluster.device.memory_bytes:
        return Estimate(layout, math.inf, memory)
    costs = model.costs()
    n = len(model.stages)
    f, bwd, w, r = (costs.per_stage(x, n) for x in ("forward", "backward", "weight", "recompute"))
    work = [sum(f[s] + bwd[s] + w[s] + r[s] for s in stages) for stages in held]
    mean = [sum(x) / k for x in (f, bwd, w)]
    bubble = closed_form_bubble(layout.schedule, k, m, v, *mean) if k > 1 else 0.0
    if bubble is None:
        recomputed = [mean[0], mean[1] + sum(r) / k, mean[2]]
        bubble = _fallback_bubble(layout.schedule, k, m, v, recomputed, rough)
    makespan = m * max(work) / (1 - bubble)
    # the gradients' reduction past the last backward; the gather past the first forward
    dp = layout.data_parallel
    passes = 2 if layout.shard is None else 1
    grads = costs.per_stage("grad_bytes", n)
    bandwidth = costs.allreduce_bandwidth or costs.bandwidth
    ring = [passes * sum(grads[s] for s in stages) * (dp - 1) / dp / bandwidth for stages in held]
    last = [sum(bwd[s] + w[s] + r[s] for s in stages) / max(1, len(stages)) for stages in held]
    first = [f[stages[0]] * (1 + i) for i, stages in enumerate(held)]
    exposed = max(max(0.0, x - y) for x, y in zip(ring, last, strict=True)) if dp > 1 else 0.0
    gather = max(max(0.0, g - y) for g, y in zip(model.gather_seconds(), first, strict=True))
    step = makespan + exposed + gather + model.optimizer_seconds()
    return Estimate(layout, step, memory, rough and layout.schedule in _CAPPED_V)


def _chosen(fitting: list[Estimate], schedules: Sequence[str]) -> list[Estimate]:
    """The estimates to simulate, of ``fitting`` sorted: the best ``SIMULATED``, the best of
    each schedule (so the table compares them) and the best that gpipe trains."""
    chosen = fitting[:SIMULATED]
    extra = [next((e for e in fitting if e.layout.schedule == s), None) for s in schedules]
    extra.append(next((e for e in fitting if e.layout.shard in TRAINED_SHARD_MODES), None))
    for best_of in extra:
        if best_of is not None and best_of not in chosen:
            chosen.append(best_of)
    return chosen


def _refine(
    shape: TransformerShape,
    fitting: list[Estimate],
    models: dict[tuple[object, ...], StepModel],
    schedules: Sequence[str],
) -> list[Estimate]:
    """``_chosen`` of ``fitting`` (sorted here) once no rough estimate is among them: each
    V-Half or V-Min layout that ranks there on its rough bubble is estimated again with its
    simulated one, which only the few that rank high need, and the ranking redone."""
    while True:
        fitting.sort(key=lambda e: e.step_s)
        chosen = _chosen(fitting, schedules)
        rough = [i for i, e in enumerate(fitting) if e.rough and e in chosen]
        if not rough:
            return chosen
        for i in rough:
            layout = fitting[i].layout
            model = dataclasses.replace(models[_unsharded(layout)], layout=layout)
            fitting[i] = estimate(shape, layout, model)


def search(
    shape: TransformerShape,
    cluster: Cluster,
    global_batch: int,
    seq_len: int,
    space: SearchSpace = SearchSpace(),
    *,
    precision: str = "bf16",
    stack: str | None = None,
    top: int = 5,
) -> Search:
    """The ``top`` fastest layouts of ``shape`` on ``cluster`` that fit, simulated, and why
    the others were left."""
    start = time.perf_counter()
    found = Search(best=[])
    memory = cluster.device.memory_bytes
    fitting: list[Estimate] = []
    batch = (global_batch, seq_len)
    models: dict[tuple[object, ...], StepModel] = {}
    for layout in _layouts(shape, cluster, batch, space, (precision, stack), found.rejected):
        found.searched += 1
        try:
            check_layout(shape, layout)
        except ValueError:
            found.rejected["the layout cannot run (check_layout)"] += 1
            continue
        # the sharding changes memory and collectives, not the stages: one model for all
        key = _unsharded(layout)
        if key not in models:
            models[key] = StepModel.of(shape, layout)
        guess = estimate(shape, layout, dataclasses.replace(models[key], layout=layout), True)
        if guess.memory.total <= memory:
            fitting.append(guess)
        else:
            found.rejected[f"does not fit in {memory / 2**30:.0f} GiB"] += 1
            if found.least is None or guess.memory.total < found.least.memory.total:
                found.least = guess
    found.fitting = len(fitting)
    chosen = _refine(shape, fitting, models, space.schedules)
    predicted = sorted(
        (p for p in (predict(shape, e.layout) for e in chosen) if p.fits()),
        key=lambda p: (p.step_time_s, p.memory.total),
    )
    found.trained = next((p for p in predicted if p.layout.shard in TRAINED_SHARD_MODES), None)
    seen: set[tuple[object, ...]] = set()
    for p in predicted:  # a layout once: its fastest, least-memory sharding
        key = _unsharded(p.layout)
        if key not in seen:
            seen.add(key)
            found.best.append(p)
    found.best = found.best[:top]
    found.seconds = time.perf_counter() - start
    return found
