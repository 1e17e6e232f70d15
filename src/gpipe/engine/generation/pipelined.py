"""Generation through a pipeline: every rank runs its stage against its caches; the first
plans, the last picks the tokens and sends them back to the first.

A task goes down the pipeline as one message from stage to stage; the last stage sends the
tokens it picked straight back to the first, on a channel of its own, and the first stage
then plans that lane's next trip. With as many lanes in flight as stages, every stage has a
lane to work on while the others' are elsewhere in the pipe. A stage that fails sends an
abort the same way round, so that the others raise at once, naming it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe.comm.agreement import on_first_rank
from gpipe.comm.distributed import DistributedTransport
from gpipe.engine.generation.checks import Settings, checked_prompts, checked_settings
from gpipe.engine.generation.lanes import CachedStage, GenerationRefused, StageCaches, cache_refusal
from gpipe.engine.generation.messages import (
    STOP,
    Abort,
    Relay,
    abort_of,
    abort_tensors,
    plan_of,
    relay_of,
    relay_tensors,
    task_tensor,
)
from gpipe.engine.generation.sampling import Sampler, picked
from gpipe.engine.generation.scheduler import Scheduler, Task
from gpipe.engine.placement import RankPlacement
from gpipe.engine.runner import connect
from gpipe.errors import StageError, first_line
from gpipe.runtime.stage import Stage
from gpipe.schedules import Kind

__all__ = ["Generation", "Timing"]

_PASSED_ON = (ValueError, TypeError)  # refusals told to every rank as they are


@dataclass(frozen=True)
class Timing:
    """When the last ``generate`` started and ended, and when each sequence's first token
    came back (``time.perf_counter`` on the first stage's rank); ``tokens`` generated."""

    started: float
    ended: float
    first_token: tuple[float | None, ...]
    tokens: int


class Generation:
    """Generation through this rank's stage (``placement``, ``stages``) on ``device``.

    Building it is collective over the pipeline: every stage is checked to keep a KV cache
    (a refusal is raised on every rank alike), and the channel that brings the last stage's
    tokens back to the first is opened. ``timing`` describes the last ``generate`` (on the
    first stage's rank; None elsewhere)."""

    def __init__(
        self,
        placement: RankPlacement,
        stages: Mapping[int, Stage],
        device: torch.device,
        *,
        autocast: torch.dtype | None,
        timeout: float,
        local_pipes: bool,
    ) -> None:
        if len(placement.stages) != 1:  # every rank holds as many: every rank refuses
            raise GenerationRefused(
                f"generate() runs one stage per process, but rank {placement.rank} holds "
                f"stages {list(placement.stages)}: build the pipeline with a schedule of one "
                "stage per process (such as 'gpipe' or '1f1b')"
            )
        self.placement = placement
        self.index = placement.stages[0]
        self.n_stages = placement.n_stages
        module = stages[self.index].module
        refusals: list[str | None] = [None] * placement.n_ranks
        reason = cache_refusal(module, self.index)
        if placement.n_ranks > 1:
            dist.all_gather_object(refusals, reason, group=placement.group)
        else:
            refusals = [reason]
        refused = next((r for r in refusals if r is not None), None)
        if refused is not None:
            raise GenerationRefused(refused)
        self.module = module
        self.stage = CachedStage(module, self.index, device, autocast)
        self.device = device
        self.transport: DistributedTransport = connect(
            placement, ((self.n_stages - 1, 0),), device, timeout, local_pipes
        )
        self.timing: Timing | None = None
        self.runs = 0  # generate() calls begun, the same count on every rank
        self._heard_abort = 0  # the last call another stage's failure ended here

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    def _limits(self) -> tuple[int | None, int | None]:
        """The vocabulary and context of the model, as its first layer tells them."""
        limits = getattr(self.stage.layers[0], "generation_limits", None)
        if limits is None:
            return None, None
        vocab, context = limits()
        return vocab, context

    @torch.no_grad()
    def generate(
        self,
        prompts: Any,
        max_new_tokens: Any,
        *,
        temperature: Any = 0.0,
        top_k: Any = None,
        top_p: Any = None,
        eos_token_id: Any = None,
        seed: Any = None,
        in_flight: Any = None,
        prefill_chunk: Any = None,
        rows_per_lane: int | None = None,
        on_tokens: Callable[[int], None] | None = None,
    ) -> list[list[int]]:
        """The new tokens of each prompt (read on the first stage), on every rank; the
        arguments are ``Pipeline.generate``'s, with ``rows_per_lane`` (at most that many
        sequences in a lane at once; default all the prompts, spread over the lanes) and
        ``on_tokens(n)``, told on the first stage of every ``n`` tokens that come back."""

        checked: list[list[int]] = []
        self.runs += 1
        self.transport.new_call()  # what a failed generate() left on the way is dropped

        def decide() -> Settings:
            vocab, context = self._limits()
            settings = checked_settings(
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos_token_id=eos_token_id,
                seed=seed,
                in_flight=in_flight,
                prefill_chunk=prefill_chunk,
                n_stages=self.n_stages,
                vocab=vocab,
                context=context,
                rows_per_lane=rows_per_lane,
            )
            checked.extend(checked_prompts(prompts, settings.max_new_tokens, vocab, context))
            return settings

        group = self.placement.group
        what = "checking generate()'s arguments"
        settings = on_first_rank(decide, group, what, passed_on=_PASSED_ON)
        caches = StageCaches(self.stage, settings.context)
        tokens: list[list[int]] = []
        modes = [(m, m.training) for m in self.module.modules()]
        self.module.eval()  # no dropout while generating
        try:
            if self.is_first:
                tokens = self._lead(caches, checked, settings, on_tokens)
            else:
                self._follow(caches, settings)
            self.transport.flush()
        except Exception as exc:
            if self._heard_abort != self.runs:  # this stage failed: the others hear of it now
                error = f"{type(exc).__name__}: {first_line(exc)}"
                self._pass_on(Abort(self.runs, self.index, error))
            raise
        finally:
            # each module as it was (a layer may have been put in eval mode of its own):
            # parents first, each child then setting its own part again
            for module, training in modes:
                module.train(training)
        return on_first_rank(lambda: tokens, group, "generating")

    # -- the first stage ---------------------------------------------------------------------
    def _lead(
        self,
        caches: StageCaches,
        prompts: list[list[int]],
        settings: Settings,
        on_tokens: Callable[[int], None] | None,
    ) -> list[list[int]]:
        """Plan every lane's trips until every sequence has ended; returns their tokens."""
        started = time.perf_counter()
        plan = Scheduler(
            prompts,
            settings.max_new_tokens,
            lanes=settings.in_flight,
            rows_per_lane=settings.rows_per_lane,
            prefill_chunk=settings.prefill_chunk,
            eos_token_id=settings.eos_token_id,
            on_tokens=on_tokens,
        )
        sampler = Sampler(settings.sampling) if self.is_last else None
        last = self.n_stages - 1

        def send(lane: int) -> int:
            task = plan.task(lane)
            if task is None:
                return 0
            inputs = torch.tensor(task.inputs, dtype=torch.long, device=self.device)[:, None]
            pieces = [
                torch.tensor(p.ids, dtype=torch.long, device=self.device)[None] for p in task.pieces
            ]
            self._step(caches, task, task_tensor(task, self.runs), inputs, pieces, sampler)
            return 1

        out = sum(send(lane) for lane in range(plan.lanes))
        while out:
            message = self._recv(last, Kind.RECV_SKIP, f"the tokens of stage {last}")
            if self._aborted(message):
                continue
            relay = relay_of(message)
            if relay.run != self.runs:
                continue  # left by a call that failed
            plan.take(relay.lane, relay.sequences, relay.tokens)
            out += send(relay.lane) - 1
        if self.n_stages > 1:
            stop = task_tensor(Task(STOP), self.runs)
            self.transport.send((stop, None), 0, 1, STOP, Kind.SEND_F)
        first = tuple(plan.first_token)
        total = sum(len(t) for t in plan.tokens)
        self.timing = Timing(started, time.perf_counter(), first, total)
        return plan.tokens

    # -- every other stage -------------------------------------------------------------------
    def _follow(self, caches: StageCaches, settings: Settings) -> None:
        """Run each task that comes until the one that ends the generation."""
        sampler = Sampler(settings.sampling) if self.is_last else None
        before = self.index - 1
        while True:
            task_of_stage = f"a task of stage {before}"
            message = self._recv(before, Kind.RECV_F, task_of_stage)
            if self._aborted(message):
                continue
            words, inputs, *pieces = message
            assert isinstance(words, Tensor)  # a task's plan comes first
            run, task = plan_of(words)
            if run != self.runs:
                continue  # left by a call that failed
            if task.lane == STOP:
                if not self.is_last:
                    self.transport.send(
                        (words, None), self.index, self.index + 1, STOP, Kind.SEND_F
                    )
                return
            self._step(caches, task, words, inputs, pieces, sampler)

    # -- a stage that failed ------------------------------------------------------------------
    def _aborted(self, message: Any) -> bool:
        """Whether ``message`` is an abort of an earlier call (to be dropped: that call
        failed already); if it says that a stage failed in this call, pass it on and raise."""
        abort = abort_of(message)
        if abort is None or abort.run != self.runs:
            return abort is not None
        self._pass_on(abort)
        self._heard_abort = self.runs
        raise StageError(self.index, f"generating: stage {abort.stage} failed: {abort.error}")

    def _pass_on(self, abort: Abort) -> None:
        """Send ``abort`` to the next stage round the ring (the last stage's next is the
        first), unless that is the stage that failed: every stage hears of it once. Best
        effort: where the next stage cannot be reached, it finds out by its timeout."""
        after = (self.index + 1) % self.n_stages
        if after == abort.stage:
            return
        kind = Kind.SEND_SKIP if self.is_last else Kind.SEND_F
        with contextlib.suppress(StageError, RuntimeError):
            self.transport.send(abort_tensors(abort, self.device), self.index, after, STOP, kind)

    def _recv(self, src: int, kind: Kind, waiting_for: str) -> Any:
        """The next message from stage ``src``; a StageError that says, in generation's
        words, what did not come."""
        try:
            return self.transport.recv(src, self.index, -1, kind)
        except StageError as exc:
            said = str(exc).removeprefix(f"stage {self.index}: ")
            reason = said.split(" waiting for ")[0]
            raise StageError(self.index, f"generating: {reason} waiting for {waiting_for}") from exc

    # -- one task on this stage --------------------------------------------------------------
    def _step(
        self,
        caches: StageCaches,
        task: Task,
        words: Tensor,
        inputs: Any,
        pieces: Sequence[Any],
        sampler: Sampler | None,
    ) -> None:
        """Run ``task`` on this stage, then send it on (or, on the last stage, the tokens
        picked back to the first)."""
        decoded, filled = caches.run(task, inputs, pieces)
        if sampler is None:
            message = (words, decoded, *filled)
            self.transport.send(message, self.index, self.index + 1, task.lane, Kind.SEND_F)
            return
        sequences, tokens = picked(sampler, task, decoded, filled)
        relay = relay_tensors(Relay(self.runs, task.lane, sequences, tokens), self.device)
        self.transport.send(relay, self.index, 0, task.lane, Kind.SEND_SKIP)
