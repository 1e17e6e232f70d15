"""Copies between GPUs of one process on a copy stream per device, so they overlap compute.

Left to PyTorch, a copy from one GPU to another runs on the source device's current stream,
the one its next micro-batch computes on, and first waits for everything already queued on
the destination's current stream: the copy holds up the sender and waits for the receiver.
Here every CUDA device has a copy stream of its own:

- at the send, an event marks the point of the sender's stream where the tensors are ready;
- at the receive, the copy waits for that event alone and runs on the copy streams of both
  devices; the receiver's stream then waits for that copy alone;
- ``record_stream`` tells the caching allocator that the source is read on the copy stream
  and the copy is used on the receiver's stream, so neither's memory is reused too early.

Anything else (CPU tensors, one device, a tensor not on the sender's device) is copied with
a plain ``Tensor.to``, which PyTorch keeps ordered itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DeviceCopies", "Ready"]


@dataclass(frozen=True)
class Ready:
    """Where on its device's stream a sent message's tensors are ready to be read."""

    device: torch.device
    event: torch.cuda.Event


class DeviceCopies:
    """The copy streams of one process's CUDA devices, made on first use."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    @property
    def devices(self) -> frozenset[torch.device]:
        """The devices that have a copy stream: those a copy between GPUs has used so far."""
        with self._lock:
            return frozenset(self._streams)

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            return stream

    @staticmethod
    def mark(src: torch.device, dst: torch.device) -> Ready | None:
        """Call on the sender's thread when it sends: the point its tensors are ready at, or
        None where no copy stream is needed."""
        if src.type != "cuda" or dst.type != "cuda" or src == dst:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(src))
        return Ready(src, event)

    def move(self, t: Tensor, device: torch.device, ready: Ready | None) -> Tensor:
        """``t`` on ``device``, detached; call on the receiver's thread."""
        t = t.detach()
        if ready is None or t.device != ready.device or device.type != "cuda" or t.device == device:
            return t.to(device, non_blocking=True)
        src_copy, dst_copy = self.stream(t.device), self.stream(device)
        with torch.cuda.stream(src_copy), torch.cuda.stream(dst_copy):
            src_copy.wait_event(ready.event)
            out = t.to(device, non_blocking=True)  # on src_copy; dst_copy waits for it
            done = torch.cuda.Event()
            done.record(dst_copy)
        t.record_stream(src_copy)
        compute = torch.cuda.current_stream(device)
        compute.wait_event(done)
        out.record_stream(compute)
        return out
