"""What transports carry between stages, and how a wait for one message is named in errors."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from gpipe.schedules import Kind

__all__ = ["Message", "what"]

Message = Tensor | tuple[Tensor | None, ...] | Any

_CARRIED = {
    Kind.RECV_F: "activations",
    Kind.RECV_B: "gradients",
    Kind.RECV_SKIP: "skip tensors",
    Kind.RECV_SKIP_B: "skip gradients",
}


def what(kind: Kind, microbatch: int, src: int) -> str:
    """The message a receive of ``kind`` waits for, in words, for errors that name it."""
    return f"{_CARRIED[kind]} of micro-batch {microbatch} from stage {src}"
