"""Schedules on a V: of 2K stages on K ranks, rank r holds stages r and 2K - 1 - r.

The micro-batches go down the ranks through the first half of the model and come back up
through the second, so the first and the last stage share rank 0 and the turn (stages K - 1
and K) is on rank K - 1, with no message between them. Each rank's two stages are its two
*chunks*: chunk 0 on the way down, chunk 1 on the way back.
"""

from __future__ import annotations

import functools

from gpipe.errors import counted
from gpipe.schedules.ir import Kind, Schedule, check_sizes, programs_of

Order = list[tuple[Kind, int, int]]  # (kind, stage, micro-batch) compute actions of one rank


def v_stage_to_rank(n_stages: int) -> tuple[int, ...]:
    """The rank of every stage of a V of ``n_stages`` (= 2K) stages."""
    k = n_stages // 2
    return tuple(s if s < k else n_stages - 1 - s for s in range(n_stages))


def check_v(name: str, n_stages: int, n_ranks: int | None) -> int:
    """The number of ranks K of a V of ``n_stages`` stages: it must be 2K."""
    if n_stages % 2 or (n_ranks is not None and n_stages != 2 * n_ranks):
        ranks = "" if n_ranks is None else f" for {counted(n_ranks, 'rank')}"
        expected = "an even number of" if n_ranks is None else str(2 * n_ranks)
        raise ValueError(
            f"{name} places two stages per rank in a V: it needs {expected} stages, "
            f"got {n_stages}{ranks}"
        )
    return n_stages // 2


class _Chunks:
    """A rank's counters of forwards, backwards (B) and weight gradients (W) per chunk, which
    write its order: the n-th forward of a chunk is of micro-batch n, and so on."""

    def __init__(self, rank: int, n_stages: int) -> None:
        self.stage = (rank, n_stages - 1 - rank)
        self.forwards = [0, 0]
        self.backwards = [0, 0]
        self.weights = [0, 0]
        self.put_off: list[int] = []  # chunks of the B whose W wait (``split``), oldest first
        self.order: Order = []

    def forward(self, chunk: int) -> None:
        self.order.append((Kind.FORWARD, self.stage[chunk], self.forwards[chunk]))
        self.forwards[chunk] += 1

    def backward(self, chunk: int, weight_now: bool = False) -> None:
        """B of the chunk's next micro-batch; with ``weight_now`` its W right after it."""
        self.order.append((Kind.BACKWARD, self.stage[chunk], self.backwards[chunk]))
        self.backwards[chunk] += 1
        if weight_now:
            self.weight(chunk)

    def weight(self, chunk: int) -> None:
        """W of the chunk's oldest micro-batch whose B ran and W did not."""
        assert self.weights[chunk] < self.backwards[chunk]
        self.order.append((Kind.WEIGHT, self.stage[chunk], self.weights[chunk]))
        self.weights[chunk] += 1

    def split(self, chunk: int, split: bool) -> None:
        """B of the chunk's next micro-batch; its W right after it, or with ``split`` put off
        until ``weight_put_off``."""
        self.backward(chunk, weight_now=not split)
        if split:
            self.put_off.append(chunk)

    def weight_put_off(self) -> None:
        """The W put off longest."""
        self.weight(self.put_off.pop(0))

    def weights_left(self, chunk: int) -> None:
        """The W of every B of the chunk whose W has not run."""
        while self.weights[chunk] < self.backwards[chunk]:
            self.weight(chunk)


def v_schedule(name: str, n_stages: int, n_microbatches: int, orders: list[Order]) -> Schedule:
    """A V schedule of split backwards from each rank's order of compute actions."""
    return Schedule(
        name,
        n_stages,
        n_microbatches,
        programs_of(orders, n_stages),
        v_stage_to_rank(n_stages),
        split_backward=True,
    )


@functools.lru_cache(maxsize=256)
def zero_bubble_v(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024) on a V of
    2K stages: with F, B and W of equal cost it leaves almost no bubble and holds at most
    2K micro-batches' chunks per rank, the activations of 1F1B's first stage.

    Rank r fills with 2K - r - 1 forwards of chunk 0 and K of chunk 1, running the first
    K - r backwards of chunk 1 as they become possible; then alternates F, B, W on chunk 0
    and on chunk 1; then drains the backwards, filling the tail with the W it put off.
    It is laid out for at least 2K - 1 micro-batches; with fewer, the actions of the
    missing ones are left out, which keeps the rest in a valid order.
    """
    check_sizes(n_stages, n_microbatches)
    k = check_v("zero-bubble-v", n_stages, n_ranks)
    laid_out = max(n_microbatches, 2 * k - 1)
    orders = []
    for rank in range(k):
        c = _Chunks(rank, n_stages)
        for _ in range(2 * (k - rank) - 1):
            c.forward(0)
        for _ in range(rank):
            c.forward(1)
            c.forward(0)
        for _ in range(k - rank):
            c.forward(1)
            c.backward(1, weight_now=True)
        while c.forwards[1] < c.forwards[0] or c.forwards[0] < laid_out:
            if c.forwards[0] < laid_out:
                c.forward(0)
            c.backward(0, weight_now=True)
            c.forward(1)
            c.backward(1, weight_now=True)
        for _ in range(rank):
            c.backward(0)
            c.backward(1)
        for _ in range(k - rank):
            c.backward(0)
            c.weight(0)
        c.weights_left(1)
        c.weights_left(0)
        orders.append([a for a in c.order if a[2] < n_microbatches])
    return v_schedule("zero-bubble-v", n_stages, n_microbatches, orders)


@functools.lru_cache(maxsize=256)
def dualpipe_v(n_stages: int, n_microbatches: int, n_ranks: int | None = None) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe, cut in half) on a V of 2K stages, M >= 2K.

    In its steady phase every rank pairs a forward of one chunk with a backward of the
    other (``F0 B1``, ``F1 B0``): two independent micro-batches, so that the communication
    of one (in mixture-of-experts models, the all-to-alls) hides behind the computation of
    the other. The backwards of the fill and the drain are split (B now, W later) to fill
    the bubbles; those of the steady phase run whole (B and W together).
    """
    check_sizes(n_stages, n_microbatches)
    k = check_v("dualpipe-v", n_stages, n_ranks)
    if n_microbatches < n_stages:
        raise ValueError(
            f"dualpipe-v needs at least 2K = {n_stages} micro-batches for {counted(k, 'rank')}, "
            f"got {n_microbatches}"
        )
    orders = []
    for rank in range(k):
        c = _Chunks(rank, n_stages)
        _dualpipe_v_rank(rank, k, n_microbatches, c)
        orders.append(c.order)
    return v_schedule("dualpipe-v", n_stages, n_microbatches, orders)


def _dualpipe_v_rank(rank: int, k: int, m: int, c: _Chunks) -> None:
    """The eight phases of DualPipeV on ``rank`` of ``k``, for ``m`` micro-batches."""
    rest = k - rank - 1  # ranks below this one
    for _ in range(2 * rest):  # chunk 0 fills the ranks below
        c.forward(0)
    for _ in range(rank + 1):  # both chunks
        c.forward(0)
        c.forward(1)
    for _ in range(rest):  # the first backwards of chunk 1, split to fill the wait
        c.split(1, True)
        c.weight_put_off()
        c.forward(1)
    for _ in range(m - 2 * k + rank + 1):  # steady: F0 with B1, F1 with B0
        c.forward(0)
        c.split(1, False)
        c.forward(1)
        c.split(0, False)
    for _ in range(rest):
        c.split(1, False)
        c.forward(1)
        c.split(0, False)
    split = False  # the drain: its second half puts W off to fill the tail
    half = (rank + 1) // 2
    for i in range(rank + 1):
        if i == half and rank % 2 == 1:
            split = True
        c.split(1, split)
        if i == half and rank % 2 == 0:
            split = True
        c.split(0, split)
    for _ in range(rest):
        c.weight_put_off()
        c.split(0, True)
    for _ in range(rank + 1):
        c.weight_put_off()
