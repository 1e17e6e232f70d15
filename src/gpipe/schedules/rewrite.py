"""Passes over any schedule: skip connections, and recomputation ahead of the gradient."""

from __future__ import annotations

import dataclasses
import functools

from gpipe.schedules.ir import Action, Kind, Schedule, ScheduleError


@functools.lru_cache(maxsize=256)
def add_skips(schedule: Schedule, routes: tuple[tuple[int, int], ...]) -> Schedule:
    """``schedule`` with skip connections: for every (source, destination) stage pair in
    ``routes``, the source sends its skip tensors right after each forward and receives their
    gradients right before each backward; the destination receives them right before its
    forward and sends the gradients right after its backward.

    A skip travels straight between the two stages, never through the ones in between.
    """
    routes = tuple(sorted(set(routes)))
    if not routes:
        return schedule
    for src, dst in routes:
        if not 0 <= src < dst < schedule.n_stages:
            raise ScheduleError(
                f"a skip route goes from an earlier to a later stage of {schedule.n_stages}, "
                f"got {src} -> {dst}"
            )
    sources: dict[int, list[int]] = {}
    dests: dict[int, list[int]] = {}
    for src, dst in routes:
        dests.setdefault(src, []).append(dst)
        sources.setdefault(dst, []).append(src)
    programs = []
    for program in schedule.programs:
        out: list[Action] = []
        after: list[Action] = []  # skip sends that follow the compute action's own send
        for a in program:
            s, i = a.stage, a.microbatch
            if after and not (a.kind in (Kind.SEND_F, Kind.SEND_B) and a.stage == after[0].stage):
                out += after
                after = []
            if a.kind is Kind.FORWARD:
                out += [Action(s, Kind.RECV_SKIP, i, src) for src in sources.get(s, [])]
                after = [Action(s, Kind.SEND_SKIP, i, dst) for dst in dests.get(s, [])]
            elif a.kind is Kind.BACKWARD:
                out += [Action(s, Kind.RECV_SKIP_B, i, dst) for dst in dests.get(s, [])]
                after = [Action(s, Kind.SEND_SKIP_B, i, src) for src in sources.get(s, [])]
            out.append(a)
        out += after
        programs.append(tuple(out))
    return dataclasses.replace(schedule, programs=tuple(programs), skips=routes)


@functools.lru_cache(maxsize=256)
def add_recompute(schedule: Schedule, recomputed: frozenset[int]) -> Schedule:
    """``schedule`` with re-materialization ahead of the gradient: for every micro-batch in
    ``recomputed``, each stage runs its forward again (``R``) right before it receives the
    micro-batch's gradients, rather than inside the backward, so that the recomputation,
    which needs no gradient, runs while the gradient is on its way."""
    recomputed = frozenset(recomputed)
    if not recomputed or not schedule.backward:
        return schedule
    if not all(0 <= i < schedule.n_microbatches for i in recomputed):
        raise ScheduleError(
            f"recomputed micro-batches must be in [0, {schedule.n_microbatches}), "
            f"got {sorted(recomputed)}"
        )
    programs = []
    for program in schedule.programs:
        out: list[Action] = []
        for a in program:
            if a.kind is Kind.BACKWARD and a.microbatch in recomputed:
                # before the receives of this very backward, which come right before it
                at = len(out)
                while (
                    at
                    and out[at - 1].kind in (Kind.RECV_B, Kind.RECV_SKIP_B)
                    and (
                        out[at - 1].stage,
                        out[at - 1].microbatch,
                    )
                    == (a.stage, a.microbatch)
                ):
                    at -= 1
                out.insert(at, Action(a.stage, Kind.RECOMPUTE, a.microbatch))
            out.append(a)
        programs.append(tuple(out))
    return dataclasses.replace(
        schedule, programs=tuple(programs), recomputed=schedule.recomputed | recomputed
    )
