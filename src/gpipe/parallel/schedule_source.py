"""What a Pipeline's ``schedule=`` names: a registered schedule, built for each step's number
of micro-batches, or one fixed schedule (read from a PyTorch schedule file with
``gpipe.schedules.from_csv``), which fixes the stages' ranks and the micro-batch count."""

from __future__ import annotations

from dataclasses import dataclass

from gpipe.parallel.placement import check_stages_per_rank
from gpipe.schedules import Placement, Schedule, build, get_schedule, traits

__all__ = ["ScheduleSource"]


@dataclass(frozen=True)
class ScheduleSource:
    name: str
    fixed: Schedule | None = None

    @classmethod
    def of(cls, schedule: str | Schedule) -> ScheduleSource:
        """Check ``schedule``: a known name (an unknown one is refused with the known ones) or
        a ``Schedule``."""
        if isinstance(schedule, Schedule):
            return cls(schedule.name, schedule)
        get_schedule(schedule)
        return cls(schedule)

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

    def build(self, n_ranks: int, n_microbatches: int, per_rank: int) -> Schedule:
        """The schedule of a step of ``n_microbatches`` micro-batches."""
        if self.fixed is None:
            return build(self.name, n_ranks, n_microbatches, per_rank)
        if n_microbatches != self.fixed.n_microbatches:
            raise ValueError(
                f"schedule {self.name!r} runs {self.fixed.n_microbatches} micro-batches, but "
                f"this step has {n_microbatches} (fewer rows than chunks): pass mini-batches "
                f"of at least {self.fixed.n_microbatches} rows"
            )
        return self.fixed
