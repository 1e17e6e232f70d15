"""Which configuration to run: the fastest that fits, found by the memory planner and the
simulator over stages, micro-batches, schedules and re-materialization modes.

Memory comes from ``gpipe.planning.memory.plan`` on a profile (taken on the meta device, so the
model is never allocated). Time comes from ``gpipe.planning.simulate.simulate`` fed with per-
layer costs: counted (the FLOPs of each layer's forward, on the meta device) or timed (each
layer's forward and backward on a real device, at two micro-batch sizes). Either way a layer's
backward costs twice its forward, half of it the weight gradient, and messages between
processes are free: the simulator ranks configurations by their compute, their balance and
their bubble, not by the interconnect."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from gpipe.planning.balancing import layer_times, partition
from gpipe.planning.memory import MemoryPlan, Profile, plan
from gpipe.planning.simulate import Costs, simulate
from gpipe.runtime.microbatch import as_tuple
from gpipe.runtime.partitions import as_sequential, check_balance, even_balance, stage_bounds
from gpipe.runtime.recompute import CHECKPOINT_MODES, check_checkpoint
from gpipe.schedules import SCHEDULES, build, traits

__all__ = [
    "MAX_STAGES",
    "Candidate",
    "LayerCosts",
    "Search",
    "candidates",
    "chunk_choices",
    "combine",
    "evaluate",
    "flop_costs",
    "search",
    "timed_costs",
]

MAX_STAGES = 8  # the default bound on processes searched


@dataclass(frozen=True)
class LayerCosts:
    """What each layer's forward costs for a micro-batch of ``rows`` rows: ``fixed[i] +
    per_row[i] * rows``, in ``unit`` (seconds, or FLOPs for counted costs). A backward costs
    twice its forward, half of it the weight gradient (zero-bubble's W). ``source`` says how
    the costs were obtained. With tensor parallelism, ``comm_forward`` and ``comm_backward``
    give each layer's collectives as ``(fixed, per row)`` in the same unit: the forward
    (and a recomputed forward) waits for the first, the input-gradient backward for the
    second, the weight gradient for neither."""

    fixed: tuple[float, ...]
    per_row: tuple[float, ...]
    unit: str
    source: str
    comm_forward: tuple[tuple[float, float], ...] = ()
    comm_backward: tuple[tuple[float, float], ...] = ()

    def __len__(self) -> int:
        return len(self.per_row)

    def forward(self, layer: int, rows: float) -> float:
        return self.fixed[layer] + self.per_row[layer] * rows

    def collectives(self, layer: int, rows: float) -> tuple[float, float]:
        """The forward's and the backward's collectives of ``layer`` (0 without)."""
        if not self.comm_forward:
            return 0.0, 0.0
        (a, b), (c, d) = self.comm_forward[layer], self.comm_backward[layer]
        return a + b * rows, c + d * rows

    def repeat(self, layer: int, times: int) -> LayerCosts:
        """The costs of the model with ``layer`` repeated ``times`` times (``Profile.repeat``)."""

        def spread(values: tuple[Any, ...]) -> tuple[Any, ...]:
            if not values:
                return values
            return values[:layer] + (values[layer],) * times + values[layer + 1 :]

        return LayerCosts(
            spread(self.fixed),
            spread(self.per_row),
            self.unit,
            self.source,
            spread(self.comm_forward),
            spread(self.comm_backward),
        )


def rows_of(sample: Any) -> int:
    """The rows of a sample: its first tensor's first dimension."""
    return next(t for t in as_tuple(sample) if isinstance(t, Tensor)).size(0)


def flop_costs(
    layers: nn.Sequential | Iterable[nn.Module],
    sample: Any,
    *,
    target: Any = None,
    loss_fn: Callable[..., Tensor] | None = None,
) -> LayerCosts:
    """Each layer's forward FLOPs per row of ``sample`` (one micro-batch), counted by
    PyTorch's FLOP counter; on the meta device nothing is allocated or computed. The loss's
    FLOPs go to the last layer. Layers whose work is not matrix products (an embedding's
    lookup, a normalization) count as free."""
    module = as_sequential(layers)
    rows = rows_of(sample)
    per_row = []
    x = sample
    with torch.no_grad():
        for index, layer in enumerate(module):
            with FlopCounterMode(display=False) as counter:
                x = layer(x)
                if index == len(module) - 1 and loss_fn is not None and target is not None:
                    loss_fn(x, target)
            per_row.append(counter.get_total_flops() / rows)
    zeros = (0.0,) * len(per_row)
    return LayerCosts(zeros, tuple(per_row), "FLOP", "FLOPs counted on the meta device")


def timed_costs(
    layers: nn.Sequential | Iterable[nn.Module],
    sample: Any,
    *,
    timeout: float = 1.0,
    device: torch.device | str | None = None,
) -> LayerCosts:
    """Each layer's forward and backward timed on ``device``
    (``gpipe.planning.balancing.layer_times``) for micro-batches of the rows of ``sample`` and
    half of them, after a pass that warms the kernels up, and fitted as a fixed cost plus a
    cost per row; the forward is taken as a third of the two. Layers built on the meta device
    are allocated one at a time, so the model never is whole. About ``timeout`` seconds in all,
    more if a layer is slow."""
    module = as_sequential(layers)
    rows = rows_of(sample)
    half = max(1, rows // 2)
    _, small, large = [  # the first pass only warms up
        layer_times(module, first_rows(sample, r), timeout=timeout / 3, device=device)
        for r in (half, half, rows)
    ]
    fixed, per_row = [], []
    for a, b in zip(small, large, strict=True):
        slope = max(0.0, (b - a) / (rows - half)) if rows > half else b / rows
        fixed.append(max(0.0, a - slope * half) / 3)
        per_row.append(slope / 3)
    where = torch.device(device) if device is not None else _default_device()
    return LayerCosts(tuple(fixed), tuple(per_row), "s", f"timed on {where.type}")


def first_rows(sample: Any, rows: int) -> Any:
    """The first ``rows`` rows of each tensor of a sample (a tensor or a tuple)."""
    if isinstance(sample, Tensor):
        return sample[:rows]
    return type(sample)(t[:rows] if isinstance(t, Tensor) else t for t in sample)


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Candidate:
    """One configuration, its predicted step time (in the costs' unit) and bubble under the
    simulator, and its memory under the planner."""

    stages: int
    chunks: int
    schedule: str
    checkpoint: str
    virtual_stages: int
    balance: tuple[int, ...]
    step_time: float
    bubble: float
    memory: MemoryPlan
    tensor_parallel: int = 1

    @property
    def peak_bytes(self) -> float:
        """The most any one process holds."""
        return self.memory.peak_bytes

    @property
    def processes(self) -> int:
        """Processes of one replica: each stage's T ranks."""
        return self.stages * self.tensor_parallel

    @property
    def shard(self) -> str | None:
        """How the replicas' states are split (``plan``'s ``shard``)."""
        return self.memory.shard

    def options(self) -> str:
        """The configuration as ``gpipe train`` and ``gpipe plan`` options."""
        tensor = f" --tensor-parallel {self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        text = f"--stages {self.stages}{tensor} --chunks {self.chunks} --schedule {self.schedule}"
        if self.virtual_stages > 1:
            text += f" --virtual-stages {self.virtual_stages}"
        text += f" --checkpoint {self.checkpoint}"
        if self.memory.data_parallel > 1:
            text += f" --data-parallel {self.memory.data_parallel}"
        return text if self.shard is None else f"{text} --shard {self.shard}"


@dataclass(frozen=True)
class Search:
    """What ``search`` found: the configurations worth listing, fastest first; the grid it
    tried, as ``candidates`` gives it; how many of those fit; the one that needs the least
    memory, whether it fits or not (None if it tried none); and every configuration that
    fits, fastest first (``ranked``, of which ``fitting`` keeps those no other beats)."""

    fitting: tuple[Candidate, ...]
    grid: tuple[tuple[int, int, str, str, int], ...]
    fits: int
    least: Candidate | None
    ranked: tuple[Candidate, ...] = ()

    @property
    def searched(self) -> int:
        return len(self.grid)


def chunk_choices(batch_size: int) -> list[int]:
    """Micro-batch counts searched by default: the powers of two up to ``batch_size``, and
    ``batch_size`` itself (one row per micro-batch)."""
    choices = [1 << i for i in range(batch_size.bit_length()) if 1 << i <= batch_size]
    return sorted({*choices, batch_size})


def candidates(
    n_layers: int,
    batch_size: int,
    *,
    stages: Sequence[int] | None = None,
    chunks: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    checkpoints: Sequence[str] | None = None,
    virtual_stages: int | Sequence[int] = 2,
    max_stages: int = MAX_STAGES,
) -> list[tuple[int, int, str, str, int]]:
    """The grid ``search`` walks, as ``(stages, chunks, schedule, checkpoint, v)``.

    By default: 1 to ``max_stages`` processes (no more than there are layers), the
    ``chunk_choices`` of ``batch_size``, every schedule and every checkpoint mode. A
    schedule that places several stages per process (the interleaved ones) runs
    ``virtual_stages`` of them (each of them, if several are given), on two processes or
    more, a V two; one whose micro-batches go in
    rounds of K only takes a number of micro-batches that is a multiple of the processes,
    one that needs a micro-batch per stage (dualpipe-v) at least that many; the others run
    one stage each. Each argument given replaces its default list.
    """
    ks = list(stages) if stages is not None else range(1, min(max_stages, n_layers) + 1)
    ms = list(chunks) if chunks is not None else chunk_choices(batch_size)
    names = list(schedules) if schedules is not None else list(SCHEDULES)
    modes = list(checkpoints) if checkpoints is not None else list(CHECKPOINT_MODES)
    vs = [virtual_stages] if isinstance(virtual_stages, int) else list(virtual_stages)
    grid = []
    for k in ks:
        for name in names:
            placement = traits(name)
            several = placement.several_stages_per_rank
            for v in sorted({placement.stages_per_rank(x) for x in vs}):
                if k * v > n_layers or (several and (k < 2 or v < 2)):
                    continue
                for m in ms:
                    if m > batch_size or not placement.runs(k, m, v):
                        continue
                    grid += [(k, m, name, mode, v) for mode in modes]
    return grid


def _cut(
    prof: Profile, costs: LayerCosts, parts: int, rows: float, balance: str | Sequence[int]
) -> tuple[int, ...]:
    if not isinstance(balance, str):
        return tuple(check_balance(len(prof), balance))
    if balance == "time":
        return tuple(partition([costs.forward(i, rows) for i in range(len(costs))], parts))
    if balance == "params":
        return tuple(partition(prof.params, parts))
    if balance == "even":
        return tuple(even_balance(len(prof), parts))
    raise ValueError(f"balance must be 'time', 'params' or 'even', got {balance!r}")


@dataclass(frozen=True)
class _Config:
    stages: int
    chunks: int
    schedule: str
    checkpoint: str
    virtual_stages: int
    batch_size: int
    optimizer: str
    data_parallel: int = 1
    shard: str | None = None
    tensor_parallel: int = 1

    @property
    def rows(self) -> float:
        """A micro-batch's mean rows, on one replica."""
        return self.batch_size / self.data_parallel / self.chunks

    def memory(self, prof: Profile, cut: tuple[int, ...]) -> MemoryPlan:
        return plan(
            prof,
            cut,
            batch_size=self.batch_size,
            chunks=self.chunks,
            schedule=self.schedule,
            checkpoint=self.checkpoint,
            optimizer=self.optimizer,
            n_ranks=self.stages,
            data_parallel=self.data_parallel,
            shard=self.shard,
        )

    def timed(self, costs: LayerCosts, cut: tuple[int, ...], memory: MemoryPlan) -> Candidate:
        """The simulated step of this configuration, cut as ``cut``."""
        compute, forward, backward = [], [], []
        for bounds in stage_bounds(cut):
            work = sum(costs.forward(i, self.rows) for i in range(*bounds))
            comm = [costs.collectives(i, self.rows) for i in range(*bounds)]
            compute.append(work)
            forward.append(work + sum(f for f, _ in comm))
            backward.append(work + sum(b for _, b in comm))
        program = build(self.schedule, self.stages, self.chunks, len(cut) // self.stages)
        result = simulate(program, Costs(forward, backward, compute), self.checkpoint)
        return Candidate(
            self.stages,
            self.chunks,
            self.schedule,
            self.checkpoint,
            self.virtual_stages,
            cut,
            result.makespan,
            result.bubble,
            memory,
            self.tensor_parallel,
        )


def evaluate(
    prof: Profile,
    costs: LayerCosts,
    *,
    stages: int,
    chunks: int,
    schedule: str,
    checkpoint: str,
    virtual_stages: int = 1,
    batch_size: int,
    optimizer: str = "adam",
    balance: str | Sequence[int] = "time",
    data_parallel: int = 1,
    shard: str | None = None,
) -> Candidate:
    """One configuration's memory (``plan``) and time (``simulate``). ``balance`` is a cut
    (layers per stage) or how to find one: ``"time"`` cuts where the slowest stage is
    fastest under ``costs``, ``"params"`` evens out the parameters, ``"even"`` the layers.
    ``batch_size`` is shared by ``data_parallel`` replicas, whose states ``shard`` splits."""
    check_checkpoint(checkpoint)
    if len(costs) != len(prof):
        raise ValueError(f"costs have {len(costs)} layers, the profile {len(prof)}")
    config = _Config(
        stages,
        chunks,
        schedule,
        checkpoint,
        virtual_stages,
        batch_size,
        optimizer,
        data_parallel,
        shard,
    )
    cut = _cut(prof, costs, stages * virtual_stages, config.rows, balance)
    return config.timed(costs, cut, config.memory(prof, cut))


def search(
    prof: Profile,
    costs: LayerCosts,
    *,
    batch_size: int,
    device_bytes: float,
    optimizer: str = "adam",
    balance: str = "time",
    data_parallel: int = 1,
    shards: Sequence[str | None] | None = None,
    tensor_parallel: int = 1,
    **grid: Any,
) -> Search:
    """The configurations of ``candidates(len(prof), batch_size // data_parallel, **grid)``
    that fit in ``device_bytes`` per process, fastest first, each cut as ``evaluate``'s
    ``balance`` says, ``batch_size`` shared by ``data_parallel`` replicas.

    Each configuration is planned with the replicas' states kept as the first of ``shards``
    (``plan``'s ``shard``) under which it fits, or, fitting under none, as the one that
    needs the least memory; by default whole (None), then ``"full"`` with replicas.

    A configuration is left out when another that fits is at least as fast on no more
    processes with no more memory: what remains are real trade-offs of time, processes and
    memory. Time is simulated only for the configurations whose memory fits, and for the one
    that needs the least memory (``Search.least``), fitting or not.

    ``tensor_parallel`` only labels the candidates (``Candidate.processes``): ``prof`` and
    ``costs`` must already be one rank's (``gpipe.planning.tensor_share``).
    """
    if len(costs) != len(prof):
        raise ValueError(f"costs have {len(costs)} layers, the profile {len(prof)}")
    if shards is None:
        shards = (None, "full") if data_parallel > 1 else (None,)
    tried = candidates(len(prof), max(1, batch_size // data_parallel), **grid)
    fitting = []
    least: tuple[float, _Config, tuple[int, ...], MemoryPlan] | None = None
    for stages, chunks, schedule, checkpoint, v in tried:
        config = _Config(
            stages,
            chunks,
            schedule,
            checkpoint,
            v,
            batch_size,
            optimizer,
            data_parallel,
            tensor_parallel=tensor_parallel,
        )
        cut = _cut(prof, costs, stages * v, config.rows, balance)
        config, memory = _kept(config, prof, cut, shards, device_bytes)
        if memory.fits(device_bytes):
            fitting.append(config.timed(costs, cut, memory))
        if least is None or memory.peak_bytes < least[0]:
            least = (memory.peak_bytes, config, cut, memory)
    smallest = None if least is None else least[1].timed(costs, least[2], least[3])
    ranked = tuple(sorted(fitting, key=_speed))
    return Search(_frontier(ranked), tuple(tried), len(fitting), smallest, ranked)


def _kept(
    config: _Config,
    prof: Profile,
    cut: tuple[int, ...],
    shards: Sequence[str | None],
    device_bytes: float,
) -> tuple[_Config, MemoryPlan]:
    """``config`` with the first of ``shards`` under which it fits, or the smallest."""
    planned: list[tuple[float, int, _Config, MemoryPlan]] = []
    for shard in shards:
        sharded = replace(config, shard=shard)
        memory = sharded.memory(prof, cut)
        if memory.fits(device_bytes):
            return sharded, memory
        planned.append((memory.peak_bytes, len(planned), sharded, memory))
    _, _, config, memory = min(planned)
    return config, memory


def combine(searches: Sequence[Search]) -> Search:
    """One search of several (each at a tensor-parallel size of its own), as if it had been
    one: the grids joined, the fitting ranked together, the least memory the least of all."""
    ranked = tuple(sorted((c for s in searches for c in s.ranked), key=_speed))
    least = [s.least for s in searches if s.least is not None]
    return Search(
        _frontier(ranked),
        tuple(g for s in searches for g in s.grid),
        sum(s.fits for s in searches),
        min(least, key=lambda c: c.peak_bytes) if least else None,
        ranked,
    )


def _speed(c: Candidate) -> tuple[float, int, float, int, int, int]:
    """Fastest first; of equals, fewer processes, less memory, fewer micro-batches, fewer
    stages per process, fewer tensor-parallel ranks."""
    return (c.step_time, c.processes, c.peak_bytes, c.chunks, c.virtual_stages, c.tensor_parallel)


def _frontier(ranked: tuple[Candidate, ...]) -> tuple[Candidate, ...]:
    """Fastest first, without those another beats or equals in time, processes and memory."""
    kept: list[Candidate] = []
    for c in ranked:
        if not any(k.processes <= c.processes and k.peak_bytes <= c.peak_bytes for k in kept):
            kept.append(c)
    return tuple(kept)
