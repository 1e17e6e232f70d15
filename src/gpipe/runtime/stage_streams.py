"""A CUDA stream for each stage of a process, so that independent work of its stages overlaps.

A V schedule puts two stages on every process, and DualPipeV pairs the forward of one
micro-batch on one of them with the backward of another micro-batch on the other. Nothing
connects the two, yet on the one stream of a process the GPU would run them one after the
other. Here each stage issues its forwards, backwards, recomputations and sends on its own
stream (autograd runs a backward's kernels on the streams of its forward), and the streams
meet only where data crosses between them:

- a tensor handed from one stage of the process to the other waits for an event recorded on
  the sender's stream when it was handed over;
- a tensor received from another process is received on the process's own stream (the one
  current when the step began), and the receiving stage's stream waits for it there;
- each step begins with every stage's stream waiting for the process's stream (the step's
  inputs, the last optimizer step) and ends with the process's stream waiting for all of
  them (the loss, the gradients), so the code around a step sees one stream as before.

Tensors that one stream allocated and another reads are marked with ``record_stream``, so the
caching allocator does not hand their memory out again while the reader may still use it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

from gpipe.comm.message import Message
from gpipe.comm.payload import tensors_of
from gpipe.schedules import SCHEDULES, Kind, traits

__all__ = ["StageStreams", "check_overlap_stages", "overlaps_stages"]


def check_overlap_stages(overlap_stages: object, device: torch.device) -> None:
    """Refuse an ``overlap_stages`` that is not None or a bool, or True off CUDA."""
    if overlap_stages is not None and not isinstance(overlap_stages, bool):
        raise TypeError(
            f"overlap_stages must be True, False or None, got {type(overlap_stages).__name__}"
        )
    if overlap_stages and device.type != "cuda":
        raise ValueError(
            "overlap_stages=True issues each stage's work on a CUDA stream of its own, "
            f"but this rank's device is {device}"
        )


def overlaps_stages(
    overlap_stages: bool | None, schedule: str, device: torch.device, stages_per_rank: int
) -> bool:
    """Whether a rank's stages get a stream each: as asked, or by default where the schedule
    pairs work of two stages of a rank (dualpipe-v) on CUDA."""
    if overlap_stages is not None:
        return overlap_stages
    paired = schedule in SCHEDULES and traits(schedule).pairs_stages
    return paired and device.type == "cuda" and stages_per_rank > 1


class StageStreams:
    """One CUDA stream per stage in ``stages``, on ``device``; see the module's docstring."""

    def __init__(self, stages: Iterable[int], device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"stage streams need a CUDA device, got {device}")
        self.device = device
        self._origin = torch.cuda.current_stream(device)
        self._streams = {stage: torch.cuda.Stream(device) for stage in stages}
        self._current = self._origin
        # events of hand-overs between this process's stages, oldest first, by channel
        self._handed: dict[tuple[int, int, Kind], deque[torch.cuda.Event]] = {}

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(self._streams)

    def begin(self) -> None:
        """Start a step: every stage's stream waits for what the process's stream has queued."""
        self._origin = self._current = torch.cuda.current_stream(self.device)
        self._handed.clear()
        for stream in self._streams.values():
            stream.wait_stream(self._origin)

    def end(self) -> None:
        """End a step: the process's stream is current again, and waits for every stage's
        work."""
        self.issue_on(None)
        for stream in self._streams.values():
            self._origin.wait_stream(stream)

    def issue_on(self, stage: int | None) -> None:
        """Make ``stage``'s stream the current one (None: the process's), switching only when
        it changes: a step switches at most once per action, for microseconds of host time."""
        stream = self._origin if stage is None else self._streams[stage]
        if stream is not self._current:
            torch.cuda.set_stream(stream)
            self._current = stream

    def handed_over(self, src: int, dst: int, kind: Kind) -> None:
        """Stage ``src`` has just handed a message to stage ``dst`` of this process (on
        ``src``'s stream): note how far ``src``'s stream had got."""
        event = torch.cuda.Event()
        event.record(self._streams[src])
        self._handed.setdefault((src, dst, kind), deque()).append(event)

    def taken_over(self, message: Message, src: int, dst: int, kind: Kind) -> None:
        """Stage ``dst`` takes the oldest message ``src`` handed it: ``dst``'s stream waits
        until ``src``'s had computed it."""
        stream = self._streams[dst]
        stream.wait_event(self._handed[(src, dst, kind)].popleft())
        _used_on(message, stream)

    def arrived(self, message: Message, stage: int) -> None:
        """A message from another process was received on the process's stream for
        ``stage``: ``stage``'s stream waits for the receive."""
        stream = self._streams[stage]
        stream.wait_stream(self._origin)
        _used_on(message, stream)


def _used_on(message: Message, stream: torch.cuda.Stream) -> None:
    for tensor in tensors_of(message):
        if tensor.is_cuda:
            tensor.record_stream(stream)
