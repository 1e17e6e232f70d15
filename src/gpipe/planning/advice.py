"""Advice on the number of micro-batches: the GPipe paper's M >= 4K, checked against each
schedule's own bubble.

The paper found the bubble negligible once a mini-batch is cut into at least four
micro-batches per stage. How large the bubble really is depends on the schedule (zero-bubble
and interleaved have far less than fill-drain) and on re-materialization (a recomputation
runs while its stage would otherwise wait), so the advice predicts it for the run as
configured, with stages of equal cost, and names the fewest micro-batches that bring it
under 10 %.
"""

from __future__ import annotations

from gpipe.planning.simulate import Costs, closed_form_bubble, scenario, simulate
from gpipe.runtime.recompute import check_checkpoint
from gpipe.schedules import traits

__all__ = [
    "MOST_CHUNKS",
    "RULE_OF_THUMB",
    "TARGET_BUBBLE",
    "chunks_advice",
    "chunks_for_bubble",
    "bubble",
]

RULE_OF_THUMB = 4  # micro-batches per stage (GPipe, section 2.3)
TARGET_BUBBLE = 0.10
# The most micro-batches advised: a schedule that caps its memory (v-min) keeps processes
# waiting however many there are, so its bubble need never reach the target.
MOST_CHUNKS = 256

# Stages of equal cost; a backward twice a forward, half of it the weight gradient.
_UNIT = Costs(forward=1.0, backward=1.0, weight=1.0)


def bubble(
    schedule: str,
    stages: int,
    chunks: int,
    *,
    virtual_stages: int = 1,
    checkpoint: str = "never",
) -> float:
    """The predicted bubble (idle share of all processes' time) of ``schedule`` on ``stages``
    processes of equal cost with ``chunks`` micro-batches: its closed form where it has one
    and nothing is recomputed, the simulator otherwise. ``virtual_stages`` is the stages per
    process of a schedule that places several (the interleaved one)."""
    check_checkpoint(checkpoint)
    if checkpoint == "never":
        v = traits(schedule).stages_per_rank(virtual_stages)
        exact = closed_form_bubble(schedule, stages, chunks, v, 1.0, 1.0, 1.0)
        if exact is not None:
            return exact
    plan, costs = scenario(schedule, stages, chunks, _UNIT, virtual_stages)
    return simulate(plan, costs, checkpoint).bubble


def chunks_for_bubble(
    schedule: str,
    stages: int,
    *,
    target: float = TARGET_BUBBLE,
    virtual_stages: int = 1,
    checkpoint: str = "never",
) -> int | None:
    """The fewest micro-batches whose predicted ``bubble`` is below ``target`` (a multiple
    of ``stages`` for a schedule whose micro-batches go in rounds of K, as the interleaved
    one's do), or None if ``MOST_CHUNKS`` do not bring it there: bisection, since the bubble
    shrinks as micro-batches are added (towards a floor above zero where a memory cap makes
    processes wait). V-Half's shrinks with small ups and downs, a process waiting on every
    other micro-batch: its answer is under the target with one fewer above, though a
    smaller count may be under too. Under re-materialization the search starts from the answer
    without it, which the simulator then only has to refine."""
    if not 0 < target < 1:
        raise ValueError(f"target must be a fraction between 0 and 1, got {target!r}")
    step = stages if traits(schedule).microbatches_per_round else 1

    def below(n: int) -> bool:
        if not traits(schedule).runs(stages, n * step, virtual_stages):
            return False  # too few for the schedule: more are needed anyway
        return (
            bubble(schedule, stages, n * step, virtual_stages=virtual_stages, checkpoint=checkpoint)
            < target
        )

    low, high = 0, 1  # below(low) is False (or low is 0); below(high) is to be found
    if checkpoint != "never":
        plain = chunks_for_bubble(schedule, stages, target=target, virtual_stages=virtual_stages)
        high = (MOST_CHUNKS if plain is None else plain) // step
    most = MOST_CHUNKS // step
    while not below(high):
        if high >= most:
            return None
        low, high = high, min(high * 2, most)
    while high - low > 1:
        middle = (low + high) // 2
        if below(middle):
            high = middle
        else:
            low = middle
    return high * step


def chunks_advice(
    schedule: str,
    stages: int,
    chunks: int,
    *,
    virtual_stages: int = 1,
    checkpoint: str = "never",
    batch_size: int | None = None,
    data_parallel: int = 1,
) -> str | None:
    """One line for a run of ``chunks`` micro-batches on ``stages`` processes with fewer than
    ``RULE_OF_THUMB`` per stage: its predicted bubble and the fewest micro-batches that bring
    it under ``TARGET_BUBBLE`` (and the batch size that needs, if ``batch_size`` is smaller:
    the global batch, which ``data_parallel`` replicas share, so each needs a row per
    micro-batch). None when the rule holds or one process leaves no bubble."""
    if stages < 2 or chunks >= RULE_OF_THUMB * stages:
        return None
    now = bubble(schedule, stages, chunks, virtual_stages=virtual_stages, checkpoint=checkpoint)
    head = (
        f"note: --chunks {chunks} is below {RULE_OF_THUMB} x --stages {stages}, the GPipe "
        f"paper's rule of thumb: {schedule}'s predicted bubble is {now:.1%}"
    )
    if now < TARGET_BUBBLE:
        return f"{head}, already under {TARGET_BUBBLE:.0%}"
    needed = chunks_for_bubble(
        schedule, stages, virtual_stages=virtual_stages, checkpoint=checkpoint
    )
    if needed is None:
        return f"{head}; no --chunks up to {MOST_CHUNKS} brings it under {TARGET_BUBBLE:.0%}"
    then = bubble(schedule, stages, needed, virtual_stages=virtual_stages, checkpoint=checkpoint)
    rows_needed = needed * data_parallel
    short = batch_size is not None and batch_size < rows_needed
    rows = f" (and --batch-size {rows_needed})" if short else ""
    return f"{head}; --chunks {needed}{rows} would bring it under {TARGET_BUBBLE:.0%} ({then:.1%})"
