"""Several pipelines side by side (data x pipeline parallelism): which ranks form a pipeline
and which replicate a stage, and what replicas of one stage share each step: the row count,
the loss, their gradients (summed in buckets while the last backward still runs) and their
BatchNorm statistics.

Ranks are laid out with the replicas of a stage next to each other: rank = position x D +
replica, where position is the rank within its pipeline. On machines with several GPUs the
replicas of a stage then share a machine, so the gradient all-reduce — large, once a step —
runs over the fast links inside it, while the pipeline's point-to-point traffic — small,
once per micro-batch — crosses machines.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.comm.process_group import bounded_wait
from gpipe.runtime.dtensors import dtensor_like, local_part

if TYPE_CHECKING:
    from gpipe.runtime.batchnorm import DeferredBatchNorm

__all__ = [
    "GradientBuckets",
    "Replicas",
    "bucket_size",
    "layout",
    "packed_statistics",
    "shard",
    "unpacked_statistics",
]

BUCKET_BYTES = 25 * 2**20  # as DDP's default: big enough to amortize a collective's latency
MIN_BUCKET_BYTES = 2**20  # below this, a collective's latency outweighs what it hides
BUCKETS_PER_STAGE = 4  # so that about three quarters can start while the backward runs


def bucket_size(stage_bytes: float, bucket_bytes: float | None = None) -> float:
    """The bucket size for a stage holding ``stage_bytes`` of gradients: ``bucket_bytes``
    if given, else a quarter of the stage, kept between 1 MiB and 25 MiB.

    Only the buckets complete before the last backward ends can hide behind it, and the last
    one never does; one 25 MiB bucket for a 25 MiB stage would hide nothing."""
    if bucket_bytes is not None:
        return bucket_bytes
    return min(BUCKET_BYTES, max(MIN_BUCKET_BYTES, stage_bytes / BUCKETS_PER_STAGE))


def check_bucket_bytes(bucket_bytes: object) -> float | None:
    if bucket_bytes is None or (
        isinstance(bucket_bytes, (int, float))
        and not isinstance(bucket_bytes, bool)
        and bucket_bytes > 0
    ):
        return bucket_bytes
    raise ValueError(
        f"bucket_bytes must be a positive number of bytes or None (a quarter of each "
        f"stage's gradients, between 1 MiB and 25 MiB), got {bucket_bytes!r}"
    )


def layout(world: int, data_parallel: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(pipelines, replicas)``: ``pipelines[r]`` the ranks of replica r's pipeline in order,
    ``replicas[p]`` the ranks at position p of every pipeline (one stage's replicas)."""
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be a positive integer, got {data_parallel!r}")
    if world % data_parallel:
        raise ValueError(
            f"data_parallel={data_parallel} does not divide the world size {world}: the "
            "processes must be data_parallel x (processes per pipeline)"
        )
    k = world // data_parallel
    pipelines = [[p * data_parallel + r for p in range(k)] for r in range(data_parallel)]
    replicas = [[p * data_parallel + r for r in range(data_parallel)] for p in range(k)]
    return pipelines, replicas


def shard(batch: Any, replica: int, data_parallel: int) -> Any:
    """Replica ``replica``'s rows of a global mini-batch: as even a split as possible, larger
    shards first (the same rule as micro-batches). ``batch`` is any payload ``Pipeline.step``
    takes (a tensor, a tuple, a dict such as a tokenizer's): its leaves with the batch's rows
    are cut along dim 0, the others kept whole."""
    from gpipe.runtime.microbatch import check_payload, scatter_payload

    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be a positive integer, got {data_parallel!r}")
    if (
        isinstance(replica, bool)
        or not isinstance(replica, int)
        or not 0 <= replica < data_parallel
    ):
        raise ValueError(
            f"replica must be an integer in [0, {data_parallel}) for data_parallel="
            f"{data_parallel}, got {replica!r}"
        )
    rows = check_payload(batch, "batch")
    if rows < data_parallel:
        raise ValueError(
            f"a mini-batch of {rows} rows cannot give each of {data_parallel} replicas one"
        )
    return scatter_payload(batch, data_parallel)[replica]


@dataclass
class Replicas:
    """This rank's place among the replicas, and the collectives they share."""

    data_parallel: int
    replica: int
    group: dist.ProcessGroup  # this position's replicas, one per pipeline
    pipeline_group: dist.ProcessGroup  # this replica's pipeline
    timeout: float
    sharded: bool = False  # each holds a shard of its stage's state (``shard="full"``)

    @classmethod
    def create(cls, data_parallel: int, timeout: float, sharded: bool = False) -> Replicas:
        """Collective over the default group: every rank makes every group, in one order."""
        world, me = dist.get_world_size(), dist.get_rank()
        pipelines, replicas = layout(world, data_parallel)
        mine_p = mine_r = None
        for ranks in pipelines:
            g = dist.new_group(ranks)
            if me in ranks:
                mine_p = g
        for ranks in replicas:
            g = dist.new_group(ranks)
            if me in ranks:
                mine_r = g
        assert mine_p is not None and mine_r is not None
        return cls(data_parallel, me % data_parallel, mine_r, mine_p, timeout, sharded)

    @classmethod
    def on_mesh(
        cls,
        group: dist.ProcessGroup,
        pipeline_group: dist.ProcessGroup,
        timeout: float,
        sharded: bool = False,
    ) -> Replicas:
        """The replicas along the data dimension of a device mesh (``group``), whose pipeline
        is ``pipeline_group``; no collective."""
        size, replica = dist.get_world_size(group), dist.get_rank(group)
        return cls(size, replica, group, pipeline_group, timeout, sharded)

    def _wait(self, work: dist.Work, what: str, stage: int) -> None:
        bounded_wait(work, self.timeout, stage, f"summing {what} over the replicas", "a replica")

    def rows(self, rows: int, stage: int) -> list[int]:
        """Every replica's row count this step, in replica order; a replica whose inputs
        were refused says -1, and every replica raises."""
        counts = torch.zeros(self.data_parallel, dtype=torch.int64)
        counts[self.replica] = rows
        self._wait(dist.all_reduce(counts, group=self.group, async_op=True), "row counts", stage)
        found = counts.tolist()
        refused = [r for r, n in enumerate(found) if n < 0]
        if refused:
            raise ValueError(
                f"replica {refused[0]} refused its inputs this step (its error says why)"
            )
        empty = [r for r, n in enumerate(found) if n == 0]
        if empty:
            raise ValueError(
                f"inputs of replica {empty[0]} have no rows: every replica needs at least one "
                f"row per step (rows per replica: {found})"
            )
        return found

    def sum(self, value: Tensor, what: str, stage: int) -> Tensor:
        self._wait(dist.all_reduce(value, group=self.group, async_op=True), what, stage)
        return value

    def merge_batch_norm(self, modules: Iterable[nn.Module], stage: int) -> None:
        """Give every DeferredBatchNorm the statistics counted on all replicas, merged in
        replica order, so running statistics are the global mini-batch's, equal everywhere."""
        from gpipe.runtime.batchnorm import DeferredBatchNorm

        layers = [m for module in modules for m in module.modules()]
        norms = [m for m in layers if isinstance(m, DeferredBatchNorm)]
        if not norms:
            return
        local = packed_statistics(norms)
        gathered = [torch.empty_like(local) for _ in range(self.data_parallel)]
        work = dist.all_gather(gathered, local, group=self.group, async_op=True)
        what = "waiting for the other replicas' BatchNorm statistics"
        bounded_wait(work, self.timeout, stage, what, "a replica")
        per_replica = [unpacked_statistics(flat, norms) for flat in gathered]
        for i, norm in enumerate(norms):
            norm.replace_statistics([statistics[i] for statistics in per_replica])


_Statistics = tuple[int, int, Tensor | None, Tensor | None]  # as pending_statistics gives them


def packed_statistics(norms: Sequence[DeferredBatchNorm]) -> Tensor:
    """Every norm's pending statistics in one float64 CPU tensor, the same length on every
    replica: per norm its micro-batches, values per channel, mean and sum of squared
    deviations (zeros where it counted nothing). float64 holds the counts (below 2**53) and
    the float32 or float64 statistics exactly."""
    parts = []
    for norm in norms:
        calls, count, mean, m2 = norm.pending_statistics()
        if mean is None or m2 is None:
            calls = count = 0
            mean = m2 = torch.zeros(norm.num_features)
        header = torch.tensor([calls, count], dtype=torch.float64)
        parts += [header, mean.reshape(-1).double(), m2.reshape(-1).double()]
    return torch.cat(parts)


def unpacked_statistics(flat: Tensor, norms: Sequence[DeferredBatchNorm]) -> list[_Statistics]:
    """``packed_statistics``'s statistics back, per norm (float64: ``replace_statistics``
    gives them the dtype the norm counts in)."""
    out: list[_Statistics] = []
    offset = 0
    for norm in norms:
        c = norm.num_features
        calls, count = (int(v) for v in flat[offset : offset + 2].tolist())
        mean, m2 = flat[offset + 2 : offset + 2 + 2 * c].view(2, c)
        out.append((calls, count, mean, m2) if calls else (0, 0, None, None))
        offset += 2 + 2 * c
    return out


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)
    work: dist.Work | None = None
    flat: Tensor | None = None


class GradientBuckets:
    """Sums one stage's gradients over its replicas, in buckets of about ``bucket_size``
    taken in the reverse order of the parameters (the order a backward reaches them).

    ``arm`` before the stage's last backward: from then on a parameter whose gradient is
    accumulated is complete, and a bucket whose parameters all are starts its all-reduce
    while the backward goes on, once every bucket before it has started: collectives over
    the replicas pair up in the order they are issued, and a replica whose last backward
    reaches the parameters in another order (one it did not use, data-dependent branches)
    must not sum one bucket with another's. ``launch`` starts whatever is left (after a
    split backward's last W, or at the end); ``finish`` waits and writes the sums back.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        replicas: Replicas,
        stage: int,
        bucket_bytes: float | None = None,
    ) -> None:
        self._replicas = replicas
        self._stage = stage
        self.buckets: list[_Bucket] = []
        trained = [p for p in params if p.requires_grad]
        local_bytes = {id(p): local_part(p).numel() * p.element_size() for p in trained}
        bucket_bytes = bucket_size(sum(local_bytes.values()), bucket_bytes)
        size = bucket_bytes
        for p in reversed(trained):
            nbytes = local_bytes[id(p)]
            if not self.buckets or size + nbytes > bucket_bytes:
                self.buckets.append(_Bucket([]))
                size = 0
            self.buckets[-1].params.append(p)
            size += nbytes
        self._armed = False
        self._next = 0  # the first bucket not started: they start in order, on every replica
        self.launched_early = 0  # buckets started during the backward, last step
        self._where = {
            id(p): (b, i)
            for b, bucket in enumerate(self.buckets)
            for i, p in enumerate(bucket.params)
        }
        self._handles = [
            p.register_post_accumulate_grad_hook(self._accumulated)
            for p in params
            if p.requires_grad
        ]

    def _accumulated(self, param: nn.Parameter) -> None:
        if not self._armed:
            return
        b, i = self._where[id(param)]
        self.buckets[b].ready.add(i)
        while self._next < len(self.buckets) and self._complete(self.buckets[self._next]):
            self._start(self.buckets[self._next])
            self.launched_early += 1

    @staticmethod
    def _complete(bucket: _Bucket) -> bool:
        return len(bucket.ready) == len(bucket.params)

    def _start(self, bucket: _Bucket) -> None:
        grads = [
            local_part(p.grad) if p.grad is not None else torch.zeros_like(local_part(p))
            for p in bucket.params
        ]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads])
        bucket.work = dist.all_reduce(bucket.flat, group=self._replicas.group, async_op=True)
        self._next += 1

    def arm(self) -> None:
        self._armed = True

    def launch(self) -> None:
        """Start the all-reduce of every bucket not started yet."""
        self._armed = False
        for bucket in self.buckets[self._next :]:
            self._start(bucket)

    def finish(self) -> tuple[float, int]:
        """Wait for every bucket and write the sums into ``.grad``; returns the seconds
        waited and how many buckets had started during the backward."""
        self.launch()
        early, self.launched_early = self.launched_early, 0
        start = perf_counter()
        for bucket in self.buckets:
            assert bucket.work is not None and bucket.flat is not None
            self._replicas._wait(bucket.work, "gradients", self._stage)
            offset = 0
            for p in bucket.params:
                local = local_part(p)
                n = local.numel()
                summed = bucket.flat[offset : offset + n].view_as(local)
                if p.grad is None:
                    p.grad = dtensor_like(p, summed.clone())
                else:
                    local_part(p.grad).copy_(summed)
                offset += n
            bucket.work, bucket.flat = None, None
            bucket.ready.clear()
        self._next = 0
        return perf_counter() - start, early

    def reset(self) -> None:
        """Forget a step that failed."""
        self._armed = False
        self._next = 0
        self.launched_early = 0
        for bucket in self.buckets:
            bucket.work, bucket.flat = None, None
            bucket.ready.clear()
