"""What fits: peak memory per stage, predicted before a run and measured during one.

A stage's memory is its parameters, their gradients and the optimizer's state, plus the
activations it holds for backward, which a ``Profile`` gives per micro-batch for any cut
(``gpipe.planning.profile``). The schedule and the re-materialization mode say how many
micro-batches a stage holds at once, and which of them keep only their input: ``plan`` walks
each process's program in order and takes the peak. ``ActivationMeter``
(``gpipe.planning.meter``) measures the same thing in a run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.planning.meter import ActivationMeter
from gpipe.planning.profile import Profile, profile
from gpipe.planning.shards import ReplicaStates, check_shard
from gpipe.runtime.kv_cache import CacheContext, CachedLayer
from gpipe.runtime.microbatch import split_sizes
from gpipe.runtime.partitions import as_sequential, check_balance, stage_bounds
from gpipe.runtime.recompute import Layers, check_checkpoint, recomputed_layers, should_checkpoint
from gpipe.schedules import Kind, Schedule, add_recompute, build, traits
from gpipe.schedules.seq_chunked import seq_chunked

__all__ = [
    "OPTIMIZER_STATES",
    "ActivationMeter",
    "MemoryPlan",
    "Profile",
    "StagePlan",
    "format_bytes",
    "plan",
    "profile",
    "sub_sequence_carry",
]

# Tensors of optimizer state per parameter, each the parameter's size and dtype.
OPTIMIZER_STATES = {
    "sgd": 0,
    "momentum": 1,  # SGD with momentum: the momentum buffer
    "adagrad": 1,  # the sum of squares
    "rmsprop": 1,  # the running mean of squares (no momentum, not centered)
    "adam": 2,  # first and second moments
    "adamw": 2,
}


@dataclass(frozen=True)
class StagePlan:
    """Predicted peak bytes of one process (its stages together).

    With sharded replicas (``plan``'s ``shard``), ``param_bytes`` and ``state_bytes`` are
    what the step holds at its peak (the shards, and what is gathered or accumulated whole
    beside them), ``held_param_bytes`` and ``held_state_bytes`` what stays between steps
    (``gpipe.planning.shards.ReplicaStates``)."""

    rank: int
    stages: tuple[int, ...]
    layers: int
    params: int
    param_bytes: float  # the parameters themselves
    state_bytes: float  # their gradients and the optimizer's state
    activation_bytes: float  # peak of what is held for backward
    peak_live: int  # most micro-batches held at once
    # with replicas: the gradients' copies in the all-reduce buckets (sharded: the
    # reduce-scatter's), live from the last backward (buckets start during it) to the step's
    # end, beside at most the graph of the one micro-batch still being backpropagated
    # (``last_graph_bytes``)
    allreduce_bytes: float = 0.0
    last_graph_bytes: float = 0.0
    shard: str | None = None
    held_param_bytes: float | None = None  # between steps; None: ``param_bytes``
    held_state_bytes: float | None = None  # between steps; None: ``state_bytes``

    @property
    def held_bytes(self) -> float:
        """Parameters, gradients and optimizer state held between steps."""
        params = self.param_bytes if self.held_param_bytes is None else self.held_param_bytes
        states = self.state_bytes if self.held_state_bytes is None else self.held_state_bytes
        return params + states

    @property
    def total_bytes(self) -> float:
        during = max(self.activation_bytes, self.allreduce_bytes + self.last_graph_bytes)
        return self.param_bytes + self.state_bytes + during


@dataclass(frozen=True)
class MemoryPlan:
    balance: tuple[int, ...]
    schedule: str
    checkpoint: str | Layers
    chunks: int
    optimizer: str
    ranks: tuple[StagePlan, ...]
    data_parallel: int = 1
    shard: str | None = None

    @property
    def peak_bytes(self) -> float:
        return max(r.total_bytes for r in self.ranks)

    def fits(self, device_bytes: float) -> bool:
        return self.peak_bytes <= device_bytes


def _schedule(name: str, n_stages: int, n_ranks: int, chunks: int, seq_chunks: int = 1) -> Schedule:
    """Schedule ``name`` for ``n_stages`` stages on ``n_ranks`` processes, which its placement
    must allow: one stage on each, or as many on each; over units of ``seq_chunks``
    sub-sequences per micro-batch (whose schedules say which placements they take)."""
    if seq_chunks != 1:
        if isinstance(seq_chunks, bool) or not isinstance(seq_chunks, int) or seq_chunks < 1:
            raise ValueError(f"seq_chunks must be a positive integer, got {seq_chunks!r}")
        return seq_chunked(name, n_stages, chunks, seq_chunks, n_ranks)
    if not traits(name).several_stages_per_rank:
        if n_ranks != n_stages:
            raise ValueError(
                f"this schedule holds one stage per rank: n_ranks must equal n_stages "
                f"({n_stages}), got {n_ranks}"
            )
    elif not isinstance(n_ranks, int) or n_ranks < 1 or n_stages % n_ranks:
        raise ValueError(
            f"{name} needs a number of stages that is a multiple of the number of ranks, "
            f"got {n_stages} stages for {n_ranks} ranks"
        )
    traits(name).placement.check(n_stages, n_ranks, name)
    return build(name, n_ranks, chunks, n_stages // n_ranks)


@dataclass(frozen=True)
class _Held:
    """What one stage holds for one micro-batch (bytes): its graph, its input, its output;
    skip tensors received and kept while its graph is (``skip_in``: those copied from
    another process) or while only its input is (``skip_in_ckpt``: also those of a stage of
    this process, whose graph no longer holds them)."""

    graph: float
    inp: float
    out: float
    skip_in: float
    skip_in_ckpt: float
    again: float = 0.0  # a layer recomputed inside the backward (``Layers``), at most
    # its input, where it is the output of the previous stage on the same process (a V's
    # turn): one storage, in both stages' graphs
    shared: float = 0.0
    # a sub-sequence's keys and values, which the next one keeps as its leaves until the end
    # of its backward: beside a re-materialized unit's input (in a graph held whole, part of it)
    carry: float = 0.0


def _activation_peak(
    program: Sequence[Any],
    split: bool,
    held: dict[int, list[_Held]],
    checkpointed: Callable[[int], bool],
) -> tuple[float, int]:
    """Walk one process's program: the most activation bytes and micro-batches it holds.

    A micro-batch holds its whole graph from F to B (to W with a split backward), or only
    its input if it is recomputed, and then the whole graph again from its R. What is sent
    to another process is freed as its send completes, which the receiver's buffer, posted
    ahead, makes prompt: it is counted as freed at once.
    """
    now = peak = 0.0
    live = most = 0
    held_by: dict[tuple[int, int], int] = {}  # a turn's shared storage: which stage counts it
    for a in program:
        if not a.is_compute:
            continue
        s, i = a.stage, a.microbatch
        h = held[s][i]
        ckpt = checkpointed(i)
        inp = h.inp + h.skip_in_ckpt + h.carry if ckpt else 0.0  # a recomputed one keeps
        if a.kind is Kind.FORWARD:
            live += 1
            most = max(most, live)
            if ckpt:
                now += inp
                peak = max(peak, now + h.out)  # the output, until it is sent
            else:
                now += h.graph + h.skip_in
                if h.shared:  # the previous stage's graph holds it already
                    now -= h.shared
                    held_by[s, i] = s - 1
                peak = max(peak, now)
        elif a.kind is Kind.RECOMPUTE:  # the graph again, its input shared
            now += h.graph - h.inp
            peak = max(peak, now)
        else:
            peak = max(peak, now + h.again)
            if a.kind is Kind.WEIGHT or not split:  # the end of the backward: all freed
                live -= 1
                now -= h.graph + (h.skip_in_ckpt if ckpt else h.skip_in)
                # the keys and values of the sub-sequence before, which this one held
                now -= held[s][i - 1].carry if i and checkpointed(i - 1) else 0.0
                now += _still_shared(held_by, s, i, held)
    return peak, most


def _still_shared(
    held_by: dict[tuple[int, int], int], s: int, i: int, held: dict[int, list[_Held]]
) -> float:
    """Bytes that stage ``s`` frees with micro-batch ``i``'s graph, though they are still
    held: the storage it shares with the next stage on its process, which that stage now
    counts; or, for a stage whose shared input its previous stage counted, what it frees
    twice."""
    if held_by.get((s + 1, i)) == s:  # the next stage still holds the shared storage
        held_by[s + 1, i] = s + 1
        return held[s + 1][i].shared
    owner = held_by.pop((s, i), None)
    if owner == s - 1:  # the previous stage counts it, and frees it with its graph
        return held[s][i].shared
    return 0.0


class _LayerNames(nn.Sequential):
    """Stand-ins for a model's layers, for a ``Layers(every=k)`` policy to pick from."""

    def __init__(self, n: int) -> None:
        super().__init__(*[nn.Identity() for _ in range(n)])


def format_bytes(n: float) -> str:
    """``n`` bytes as people read them: ``1.50 GiB``, ``12.00 MiB``, ``512 B``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def plan(
    prof: Profile,
    balance: Sequence[int],
    *,
    batch_size: int,
    chunks: int,
    schedule: str = "gpipe",
    checkpoint: str | Layers = "except_last",
    optimizer: str = "adam",
    n_ranks: int | None = None,
    layers: nn.Sequential | None = None,
    data_parallel: int = 1,
    shard: str | None = None,
    reshard_after_forward: bool = False,
    seq_chunks: int = 1,
    carry_bytes: Sequence[float] = (),
) -> MemoryPlan:
    """Predicted peak memory of every process for a mini-batch of ``batch_size`` rows cut
    into ``chunks`` micro-batches (each cut along its sequence into ``seq_chunks``
    sub-sequences, as ``Pipeline(seq_chunks=...)`` does: then ``prof`` is the model's profile
    on one sub-sequence, its longest for a balanced cut, and under re-materialization
    ``carry_bytes`` what each layer hands the next sub-sequence, per row:
    ``sub_sequence_carry``). ``n_ranks`` below ``len(balance)`` puts several stages on
    each process (a schedule that places several per rank). A ``Layers(select=...)`` policy
    needs the model's ``layers`` to apply its predicate to. With ``data_parallel`` replicas,
    ``batch_size`` is the global mini-batch (each replica takes its share, the largest
    counted) and each process also holds its gradients' copies in the all-reduce buckets.
    ``shard`` splits parameters, gradients and optimizer state over the replicas as
    ``Pipeline``'s does (``gpipe.planning.shards``), ``reshard_after_forward`` as
    ``Sharding``'s."""
    balance = check_balance(len(prof), balance)
    checkpoint = check_checkpoint(checkpoint)
    _check_options(checkpoint, layers, optimizer, batch_size, data_parallel)
    check_shard(shard, data_parallel, reshard_after_forward)
    n_stages = len(balance)
    n_ranks = n_stages if n_ranks is None else n_ranks
    batch_size = split_sizes(batch_size, data_parallel)[0]  # the largest replica's share
    sizes = split_sizes(batch_size, chunks)
    sched = _schedule(schedule, n_stages, n_ranks, len(sizes), seq_chunks)
    units = [rows for rows in sizes for _ in range(seq_chunks)]  # a micro-batch's, in order
    recomputed = frozenset(
        i for i in range(len(units)) if should_checkpoint(checkpoint, i, len(units))
    )
    sched = add_recompute(sched, recomputed)
    carried = _carried(carry_bytes, len(prof), balance, seq_chunks, bool(recomputed))
    held = _held(prof, balance, sched, units, checkpoint, layers, carried)
    replicas = ReplicaStates(
        data_parallel, shard, reshard_after_forward, OPTIMIZER_STATES[optimizer]
    )
    ranks = tuple(
        _rank_plan(prof, balance, sched, held, rank, recomputed, (batch_size, seq_chunks), replicas)
        for rank in range(n_ranks)
    )
    return MemoryPlan(
        tuple(balance), schedule, checkpoint, chunks, optimizer, ranks, data_parallel, shard
    )


def _check_options(
    checkpoint: str | Layers,
    layers: nn.Sequential | None,
    optimizer: str,
    batch_size: int,
    data_parallel: int,
) -> None:
    """Refuse, in one line, the options of ``plan`` it cannot work with."""
    if isinstance(checkpoint, Layers) and checkpoint.select is not None and layers is None:
        raise ValueError("plan(checkpoint=Layers(select=...)) needs layers= to pick from")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be a positive integer, got {data_parallel!r}")
    if batch_size < data_parallel:
        raise ValueError(
            f"batch_size {batch_size} cannot give each of {data_parallel} replicas a row"
        )


def _held(
    prof: Profile,
    balance: Sequence[int],
    sched: Schedule,
    sizes: Sequence[int],
    checkpoint: str | Layers,
    layers: nn.Sequential | None,
    carried: Callable[[int, int, int], float] = lambda stage, unit, rows: 0.0,
) -> dict[int, list[_Held]]:
    """What each stage holds for each micro-batch (of ``sizes`` rows; ``carried``: the bytes
    a stage's unit of rows hands the next sub-sequence)."""
    bounds = stage_bounds(balance)
    rank_of = sched.stage_to_rank
    held: dict[int, list[_Held]] = {s: [] for s in range(len(balance))}
    picks = recomputed_layers(
        checkpoint, _LayerNames(len(prof)) if layers is None else as_sequential(layers), balance
    )
    for unit, rows in enumerate(sizes):
        routes = prof.skip_bytes(bounds, rows)
        for s, (start, stop) in enumerate(bounds):
            picked = frozenset(start + position for position in picks[s])
            graph, inp, out, again = prof.held(start, stop, rows, picked)
            remote_in = sum(
                n for (a, b), n in routes.items() if b == s and rank_of[a] != rank_of[s]
            )
            local_in = sum(n for (a, b), n in routes.items() if b == s and rank_of[a] == rank_of[s])
            turn = s > 0 and rank_of[s - 1] == rank_of[s]
            shared = inp if turn else 0.0
            carry = carried(s, unit, rows)
            held[s].append(
                _Held(graph, inp, out, remote_in, remote_in + local_in, again, shared, carry)
            )
    return held


def _carried(
    carry_bytes: Sequence[float],
    n_layers: int,
    balance: Sequence[int],
    seq_chunks: int,
    recomputing: bool,
) -> Callable[[int, int, int], float]:
    """The bytes each stage's unit (of a number of rows) hands the next sub-sequence: none
    from a micro-batch's last sub-sequence, and none without sub-sequences."""
    if seq_chunks == 1:
        return lambda stage, unit, rows: 0.0
    if recomputing and not carry_bytes:
        raise ValueError(
            f"plan(seq_chunks={seq_chunks}) with re-materialization needs carry_bytes=, what "
            "each layer hands the next sub-sequence (gpipe.planning.memory.sub_sequence_carry)"
        )
    if carry_bytes and len(carry_bytes) != n_layers:
        raise ValueError(f"carry_bytes has {len(carry_bytes)} values for {n_layers} layers")
    per_row = [sum(carry_bytes[a:b]) for a, b in stage_bounds(balance)] if carry_bytes else []

    def carried(stage: int, unit: int, rows: int) -> float:
        last = unit % seq_chunks == seq_chunks - 1
        return 0.0 if last or not per_row else per_row[stage] * rows

    return carried


def sub_sequence_carry(layers: nn.Sequential | Sequence[nn.Module], sample: Tensor) -> list[float]:
    """Bytes per row that each layer hands the next sub-sequence (its attention's keys and
    values; 0 for a layer without) on a sub-sequence like ``sample`` (token ids ``[rows,
    tokens]``), run through the layers' cached forward on the meta device, which allocates
    nothing: ``plan``'s ``carry_bytes``."""
    module = as_sequential(layers)
    x: Any = sample.to("meta")
    rows, tokens = x.shape[0], x.shape[1]
    positions = torch.arange(tokens, device="meta").expand(rows, tokens)
    valid = torch.ones(rows, tokens, dtype=torch.bool, device="meta")
    context = CacheContext(positions, valid, every_token=True)
    per_row = []
    with torch.no_grad():
        for layer in module.to("meta"):
            if not isinstance(layer, CachedLayer):
                raise ValueError(
                    f"sub_sequence_carry needs layers with a cached forward, got a "
                    f"{type(layer).__name__}"
                )
            cache = layer.new_cache()
            x = layer.forward_cached(x, cache, context)
            kv = [] if cache is None else cache.kv_layers()
            handed = sum(t.numel() * t.element_size() for layer_kv in kv for t in layer_kv.carry())
            per_row.append(handed / rows)
    return per_row


def _rank_plan(
    prof: Profile,
    balance: Sequence[int],
    sched: Schedule,
    held: dict[int, list[_Held]],
    rank: int,
    recomputed: frozenset[int],
    batch: tuple[int, int],
    replicas: ReplicaStates,
) -> StagePlan:
    """The peak of one process: its stages' weights, gradients and optimizer state as
    ``replicas`` keeps them, the peak of its activations and of the mini-batch it reads
    (``batch``: its rows, and the sub-sequences of the profile's length in its sequence), and
    with replicas its message buffers."""
    batch_size, sequence = batch
    bounds = stage_bounds(balance)
    stages = tuple(s for s in range(len(balance)) if sched.stage_to_rank[s] == rank)
    layers = [i for s in stages for i in range(*bounds[s])]
    weights = sum(prof.param_bytes[i] for i in layers)
    peak, live = _activation_peak(
        sched.programs[rank], sched.split_backward, held, recomputed.__contains__
    )
    peak += sequence * sum(prof.batch_bytes(*bounds[s], batch_size) for s in stages)
    replicated = replicas.data_parallel > 1
    kept = replicas.states(weights, max((prof.param_bytes[i] for i in layers), default=0.0))
    return StagePlan(
        rank=rank,
        stages=stages,
        layers=len(layers),
        params=sum(prof.params[i] for i in layers),
        param_bytes=kept.params,
        state_bytes=kept.states,
        activation_bytes=peak,
        peak_live=live,
        allreduce_bytes=kept.messages,
        last_graph_bytes=max((h.graph for s in stages for h in held[s]), default=0.0)
        if replicated
        else 0.0,
        shard=replicas.shard,
        held_param_bytes=kept.held_params,
        held_state_bytes=kept.held_states,
    )
