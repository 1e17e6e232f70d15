"""The schedule of a step, built in this one place for both facades.

What ``schedule=`` names, and the schedule that a training step, an evaluation or a forward
alone runs for its number of micro-batches, with skips routed and re-materialization placed.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpipe.engine.placement import check_stages_per_rank
from gpipe.errors import counted
from gpipe.runtime.recompute import Layers, should_checkpoint
from gpipe.schedules import (
    Kind,
    Placement,
    Schedule,
    add_recompute,
    add_skips,
    build,
    forward_only,
    get_schedule,
    traits,
    validate,
)
from gpipe.schedules.seq_chunked import seq_chunked

__all__ = ["ScheduleSource", "StepSchedules"]


@dataclass(frozen=True)
class ScheduleSource:
    """What a Pipeline's ``schedule=`` names: a registered schedule, built for each step's
    number of micro-batches, or one fixed schedule (read from a PyTorch schedule file with
    ``gpipe.schedules.from_csv``), which fixes the stages' ranks and the micro-batch count."""

    name: str
    fixed: Schedule | None = None

    @classmethod
    def of(cls, schedule: str | Schedule) -> ScheduleSource:
        """Check ``schedule``: a known name (an unknown one is refused with the known ones) or
        a ``Schedule``, validated here, once (a ScheduleError names the rank, the step and the
        action where it cannot run)."""
        if isinstance(schedule, Schedule):
            _check_trainable(schedule)
            return cls(schedule.name, validate(schedule))
        get_schedule(schedule)
        return cls(schedule)

    @property
    def default_chunks(self) -> int:
        """The micro-batches of a step where ``chunks`` is not given: a fixed schedule's."""
        return 1 if self.fixed is None else self.fixed.n_microbatches

    @property
    def splits_backward(self) -> bool:
        """Whether the backward comes as B and W apart."""
        if self.fixed is not None:
            return any(a.kind is Kind.WEIGHT for program in self.fixed.programs for a in program)
        return traits(self.name).split_backward

    def parts(self, n_ranks: int) -> int:
        """The number of stages to cut the model into when no balance is given."""
        if self.fixed is not None:
            return self.fixed.n_stages
        return n_ranks * (2 if traits(self.name).placement is Placement.V else 1)

    def layout(self) -> Placement | tuple[int, ...]:
        """Where the stages sit: a registered schedule's placement, or a fixed one's ranks."""
        return traits(self.name).placement if self.fixed is None else self.fixed.stage_to_rank

    def check(self, n_stages: int, n_ranks: int, chunks: int) -> None:
        """Refuse stages, processes or micro-batches that the schedule cannot run."""
        if self.fixed is None:
            check_stages_per_rank(n_stages, n_ranks, self.name)
            declared = traits(self.name).fewest  # a floor the schedule itself declares (v-min)
            fewest = declared(n_ranks) if declared is not None else 1
            if chunks < fewest:
                raise ValueError(
                    f"schedule {self.name!r} needs chunks of at least {fewest} for "
                    f"{counted(n_ranks, 'process', 'es')}, got chunks={chunks}"
                )
            return
        fixed = self.fixed
        for what, given, needed in (
            ("processes", n_ranks, fixed.n_ranks),
            ("stages (balance entries)", n_stages, fixed.n_stages),
            ("micro-batches (chunks)", chunks, fixed.n_microbatches),
        ):
            if given != needed:
                raise ValueError(
                    f"schedule {fixed.name!r} is for {needed} {what}, the pipeline has {given}"
                )

    def build(
        self, n_ranks: int, n_microbatches: int, per_rank: int, given: bool = False
    ) -> Schedule:
        """The schedule of a step of ``n_microbatches`` micro-batches (``chunks``, or as
        many as the mini-batch has rows where it has fewer; or the user's own, ``given``,
        of which a refusal then asks micro-batches rather than rows)."""
        if self.fixed is None:
            fewest = traits(self.name).fewest_microbatches(n_ranks, per_rank)
            if n_microbatches < fewest:
                raise ValueError(
                    f"schedule {self.name!r} runs at least {fewest} micro-batches on "
                    f"{counted(n_ranks, 'process', 'es')}, but this step has {n_microbatches} "
                    + _what_to_pass(fewest, given, "fewer rows than that")
                )
            return build(self.name, n_ranks, n_microbatches, per_rank)
        if n_microbatches != self.fixed.n_microbatches:
            needed = self.fixed.n_microbatches
            raise ValueError(
                f"schedule {self.name!r} runs {needed} micro-batches, but this step has "
                f"{n_microbatches} "
                + _what_to_pass(needed, given, "fewer rows than chunks", exactly=True)
            )
        return self.fixed


def _check_trainable(schedule: Schedule) -> None:
    """Refuse a given schedule that a pipeline cannot train with as it is: one without a
    backward (its steps would leave every gradient None), one holding what the pipeline adds
    itself (skips, re-materialization, sub-sequences), or one with a rank that holds no stage."""
    given = f"schedule {schedule.name!r}"
    if not schedule.backward:
        raise ValueError(
            f"{given} has no backward (backward=False): a Pipeline trains with it, so it needs "
            "each stage's backward of each micro-batch; evaluation and forward build their own"
        )
    added = (
        ("skip actions", bool(schedule.skips), "routes skips from the model's skippable layers"),
        ("recomputations (R)", bool(schedule.recomputed), "places them as checkpoint= says"),
        ("sub-sequences", schedule.seq_chunks > 1, "cuts micro-batches as seq_chunks= says"),
    )
    for what, held, how in added:
        if held:
            raise ValueError(
                f"{given} holds {what}, which a Pipeline adds itself (it {how}): give the "
                "schedule without them"
            )
    idle = next((r for r in range(schedule.n_ranks) if r not in schedule.stage_to_rank), None)
    if idle is not None:
        raise ValueError(
            f"{given} gives rank {idle} no stage (stage_to_rank={schedule.stage_to_rank}): "
            "every process of a Pipeline holds one at least"
        )


def _what_to_pass(needed: int, given: bool, why: str, exactly: bool = False) -> str:
    """The end of a refused step's message: the micro-batches (``exactly`` that many, or
    more) or the rows it needs."""
    if given:
        count = f"exactly {needed}" if exactly else f"at least {needed}"
        return f"(microbatches= lists that many): pass {count} micro-batches"
    return f"({why}): pass mini-batches of at least {needed} rows"


@dataclass(frozen=True)
class StepSchedules:
    """The schedules a pipeline's steps run: ``source``'s for a training step, forwards alone
    for an evaluation or inference; both with the skips between stages (``routes``) sent
    straight from stage to stage.

    ``stage_to_rank`` says which rank (a process, or a device of ``GPipe``) holds each stage;
    ``checkpoint`` which micro-batches a training step re-materializes; ``seq_chunks`` into
    how many sub-sequences a training step cuts each micro-batch (``seq_chunked``).

    A fixed schedule (``ScheduleSource.fixed``, validated by ``ScheduleSource.of``) runs one
    number of micro-batches, so the training and evaluation steps it runs are known here: those
    that the skips or re-materialization change are validated here, once, since skips added to
    a hand-built order may not fit it. The registered generators' schedules are not validated
    as they run (that takes seconds for large ones): the tests validate them, skips added, over
    many sizes. No step validates."""

    source: ScheduleSource
    n_ranks: int
    stage_to_rank: tuple[int, ...]
    routes: tuple[tuple[int, int], ...]
    checkpoint: str | Layers
    seq_chunks: int = 1

    def __post_init__(self) -> None:
        fixed = self.source.fixed
        if fixed is None:
            return
        for training in (True, False):
            schedule = self.step(fixed.n_microbatches, training)
            if schedule is not fixed:
                validate(schedule)

    @property
    def n_stages(self) -> int:
        return len(self.stage_to_rank)

    def step(self, n_microbatches: int, training: bool = True, given: bool = False) -> Schedule:
        """The schedule of a training step of ``n_microbatches`` micro-batches (the user's
        own where ``given``); in eval mode (``training=False``) nothing is re-materialized."""
        per_rank = self.n_stages // self.n_ranks
        if self.seq_chunks > 1:
            schedule = seq_chunked(self.source.name, self.n_stages, n_microbatches, self.seq_chunks)
        else:
            schedule = self.source.build(self.n_ranks, n_microbatches, per_rank, given)
        schedule = add_skips(schedule, self.routes)
        mode = self.checkpoint if training else "never"
        units = schedule.n_microbatches
        recomputed = frozenset(i for i in range(units) if should_checkpoint(mode, i, units))
        return add_recompute(schedule, recomputed)

    def forward(self, n_microbatches: int) -> Schedule:
        """The schedule of a forward alone (an evaluation, inference, log-probabilities) of
        ``n_microbatches`` micro-batches: nothing kept for a backward."""
        schedule = forward_only(self.n_stages, n_microbatches, self.n_ranks, self.stage_to_rank)
        return add_skips(schedule, self.routes)
