"""Checkpoints written while training goes on, one at a time, with the disk they use bounded.

``CheckpointWriter.save`` copies this rank's state out of the step (to CPU memory, whatever
device it is on) and returns. Then, out of the training thread's way, the copy is written
and the checkpoint completed as ``save_checkpoint`` does (description, digests, manifest
last, rename into place), checked, and what the retention policy no longer keeps removed:

- by a helper process of the rank (``gpipe.training.checkpoints.save_process``) where the state is
  large (``PROCESS_BYTES`` or more on some rank): it shares no Python lock with training;
- else by a thread at the lowest CPU priority, through
  ``torch.distributed.checkpoint.async_save``, its collectives on a process group of their
  own, since the step's run on the pipeline's at the same time. States with sharded
  (DTensor) tensors are always written this way: a helper process has no device mesh.

A save that is still being written when the process ends on an error is abandoned, and
says so: its ``.partial`` folder is never loaded, and the next start clears it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils._pytree
from torch import nn
from torch.optim import Optimizer

from gpipe.errors import first_line
from gpipe.training.checkpoints.format import (
    begin_save,
    checkpoint_group,
    finish_save,
    save_checkpoint,
    saved_state,
    verify_checkpoint,
    writing_ranks,
)
from gpipe.training.checkpoints.retention import Retention, prune_checkpoints
from gpipe.training.checkpoints.save_process import SaveProcess, shared_memory_room, state_bytes

if TYPE_CHECKING:
    from gpipe.pipeline import Pipeline

__all__ = ["PROCESS_BYTES", "CheckpointWriter"]

# A rank's state from which a helper process writes its checkpoints: the two seconds it takes
# to start pay for themselves once a write holds the Python lock long enough to be felt.
PROCESS_BYTES = 64 * 2**20


class _AlreadyStaged:
    """async_save's stager for a state already copied out: it passes the state on."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any], **_: Any) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _write(staged: dict[str, Any], partial: Path, group: dist.ProcessGroup | None) -> None:
    """Write ``staged`` into ``partial`` with ``async_save`` (its thread, made from this one,
    has this one's priority), and wait for it."""
    import torch.distributed.checkpoint as dcp

    from gpipe.training.checkpoints.pieces import PiecewiseSavePlanner

    pending = dcp.async_save(
        staged,
        checkpoint_id=partial,
        process_group=group,
        async_stager=_AlreadyStaged(),  # type: ignore[arg-type]  # torch's protocol: a private field
        no_dist=not dist.is_initialized(),
        planner=PiecewiseSavePlanner(),
    )
    done = pending if isinstance(pending, Future) else pending.upload_completion  # newer torch
    done.result()


def _lowest_priority() -> None:
    """Give this thread (and the threads it starts) the lowest CPU priority, on Linux, where
    priority is per thread: a save then runs while the stage waits for its neighbours, and
    takes little from a step that has every core busy."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class CheckpointWriter:
    """Saves a run's checkpoints under ``root``: the state of ``pipe``'s stages, written by
    its first replica (the others hold the same and skip ``save``), or with sharded replicas
    by every rank, each its shard.

    ``background``: training goes on while a checkpoint is written (the default); at most one
    is in flight, so a save first waits for the one before it. ``retention`` says which
    checkpoints stay once a newer one has verified. ``timeout`` bounds every wait of the
    writing threads in the background (default: the pipeline's); a save in the foreground
    waits as the pipeline's process group does. Collective over every process of the job, as
    ``torch.distributed.new_group`` is: each makes the writer and calls ``save`` for the same
    steps. Call ``close`` at the end of the run (it waits for the last save). Without
    ``pipe``, the state is one process's (or the whole group's, if one is started).
    ``process``: write in the background by a helper process (True), by a thread (False),
    or (None) by a process where some rank's state is ``PROCESS_BYTES`` or more."""

    def __init__(
        self,
        root: Path,
        pipe: Pipeline | None = None,
        *,
        retention: Retention | None = None,
        background: bool = True,
        timeout: float | None = None,
        process: bool | None = None,
    ) -> None:
        self.root = Path(root)
        self._wanted = process
        self._helper: SaveProcess | None = None
        self._by_process: bool | None = None  # decided at the first save in the background
        self._timeout = timeout if timeout is not None else getattr(pipe, "timeout", 300.0)
        self.retention = retention or Retention()
        self.background = background
        self.group = checkpoint_group(pipe)
        replicas = pipe.replicas if pipe is not None else None
        self.writes = replicas is None or replicas.replica == 0 or replicas.sharded
        self._writers = self.group
        if background and dist.is_initialized():
            # the threads' own group: the step's collectives run on the pipeline's meanwhile
            self._writers = dist.new_group(
                writing_ranks(pipe),
                timeout=datetime.timedelta(seconds=self._timeout),
                backend="gloo",
            )
        self._thread: threading.Thread | None = None
        self._in_flight: int | None = None
        self._error: BaseException | None = None
        self.removed: list[Path] = []  # what retention removed, oldest first
        self.last: Path | None = None  # the newest checkpoint this writer completed

    def _is_writer(self) -> bool:
        return not dist.is_initialized() or dist.get_rank(self.group) == 0

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: Optimizer,
        extra: dict[str, Any],
        description: dict[str, Any],
        *,
        on_written: Callable[[], None] | None = None,
    ) -> None:
        """Save step ``step``: ``extra`` and ``description`` as ``save_checkpoint`` takes
        them. In the background this returns once the state is copied out. ``on_written``
        is not called by a helper process, which follows ``GPIPE_TEST_KILL`` itself."""
        if not self.writes:
            return
        self.wait()
        if not self.background:
            path = save_checkpoint(
                self.root,
                step,
                model,
                optimizer,
                extra,
                description,
                self.group,
                on_written=on_written,
            )
            self._retire(path)
            return
        state = saved_state(model, optimizer, extra)
        if self._by_process is None:
            self._by_process = self._choose(state)
        if self._by_process:
            if self._helper is None:
                self._helper = SaveProcess(self._writers, self._timeout)
                self._helper.start()
            self._helper.submit(step, state, self.root, description, self.retention)
            return
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        partial = begin_save(self.root, step, self._writers)
        # the copy out of the step, as async_save makes it by default, done here: training
        # may change the state as soon as this returns
        stager = DefaultStager(StagingOptions(False, False, False, False))
        staged = stager.stage(state)
        assert not isinstance(staged, Future)  # staging is synchronous: the state itself
        stager.close()

        # Python hands its lock between threads every 5 ms by default: the training thread,
        # which holds it only between tensor operations, would wait up to that long each time
        # the writing thread has it. 0.2 ms here and the lowest priority below: a save's cost
        # to the steps went from 0.80 to 0.65-0.69 of a foreground save's (BENCHMARKS.md).
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, 2e-4))

        def complete() -> None:
            try:
                _lowest_priority()
                _write(staged, partial, self._writers)
                path = finish_save(
                    self.root, step, description, self._writers, on_written=on_written
                )
                self._retire(path)
            except BaseException as exc:  # handed to the training thread by wait()
                self._error = exc
            finally:
                sys.setswitchinterval(interval)

        self._in_flight, self._error = step, None
        self._thread = threading.Thread(target=complete, name=f"gpipe-save-{step}", daemon=True)
        self._thread.start()

    def _choose(self, state: dict[str, Any]) -> bool:
        """Whether a helper process writes: where asked or, unasked, where some writing rank's
        state is large; never where some rank holds sharded tensors, and unasked, not where
        shared memory has no room for the copies of this machine's ranks. Every writing rank
        decides alike (collective)."""
        from torch.distributed.tensor import DTensor

        leaves = torch.utils._pytree.tree_leaves(state)
        size = state_bytes(state)
        cramped = size * int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > shared_memory_room()
        found = torch.tensor(
            [float(any(isinstance(t, DTensor) for t in leaves)), float(size), float(cramped)],
            dtype=torch.float64,
        )
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self._writers)
        sharded, largest, short = bool(found[0]), float(found[1]), bool(found[2])
        if self._wanted and (sharded or short):
            why = (
                "cannot write sharded (DTensor) state"
                if sharded
                else f"needs {size / 2**20:.0f} MiB of /dev/shm per rank for its copy of the "
                f"state, and it has {shared_memory_room() / 2**20:.0f} MiB free"
            )
            raise ValueError(
                f"checkpoints by a helper process (--save-writer process): it {why}; write "
                "them by a thread (--save-writer thread) or give /dev/shm more room"
            )
        if self._wanted is not None:
            return self._wanted
        return dist.is_initialized() and not (sharded or short) and largest >= PROCESS_BYTES

    def _retire(self, path: Path) -> None:
        """After a checkpoint is in place: check it, then prune (on one rank). Its files'
        sizes are checked against the manifest; their checksums need no second read, since
        the manifest's were computed from the files as written."""
        self.last = path
        if not self._is_writer():
            return
        problems = verify_checkpoint(path, checksums=False)
        if problems:  # never prune on the strength of a checkpoint that does not verify
            warnings.warn(
                f"checkpoint {path} does not verify ({'; '.join(problems)}); "
                "older checkpoints kept",
                stacklevel=2,
            )
            return
        self.removed += prune_checkpoints(self.root, self.retention, written=path)

    @property
    def in_flight(self) -> int | None:
        """The step of the save still being written, if any."""
        if self._helper is not None:
            return self._helper.in_flight
        return self._in_flight if self._thread is not None and self._thread.is_alive() else None

    def wait(self) -> Path | None:
        """Finish the save in flight, if any; raises what went wrong in it. Returns the
        newest completed checkpoint."""
        done = self._helper.wait() if self._helper is not None else None
        if done is not None:
            self.last, removed, problems = done
            self.removed += removed
            if problems:
                warnings.warn(
                    f"checkpoint {self.last} does not verify ({problems}); older checkpoints kept",
                    stacklevel=2,
                )
        if self._thread is not None:
            self._thread.join()
            self._thread, step = None, self._in_flight
            self._in_flight = None
            if self._error is not None:
                error, self._error = self._error, None
                why = f"{type(error).__name__}: {first_line(error)}"  # a full disk, say
                raise RuntimeError(f"saving the checkpoint of step {step} failed: {why}") from error
        return self.last

    def close(self) -> Path | None:
        """The end of the run: wait for the last save."""
        last = self.wait()
        if self._helper is not None:
            self._helper.close()
        return last

    def abandon(self) -> None:
        """The run is ending on an error: leave a save in flight unfinished, and say so."""
        step = self.in_flight
        if step is not None:
            print(
                f"checkpoint of step {step} abandoned while being written: its .partial folder "
                "is never loaded, and the next start removes it",
                file=sys.stderr,
                flush=True,
            )
        self._thread = None
        if self._helper is not None:
            self._helper.abandon()
