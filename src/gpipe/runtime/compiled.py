"""Layers compiled one by one with ``torch.compile``, under every schedule.

Each layer of a stage (each child of its ``nn.Sequential``: a transformer block, an
embedding, a head) gets its ``forward`` compiled in place, so its parameters keep their names
and its hooks run around the compiled code. Re-materialization works as it does for eager
layers: a graph-free forward, then the same compiled forward again with a graph.

A split backward (the zero-bubble family) asks autograd for the input gradients first (B),
keeping the graph, and for the weight gradients later (W). A compiled layer is one node in the
autograd graph whose backward computes the gradients of its inputs and of its parameters
together, and frees what it saved as it runs (AOTAutograd's donated buffers), so it can be
neither split nor kept for a second pass. A compiled stage therefore runs its whole backward at
B and leaves W nothing: exact, each backward run once, at the cost of the schedule's split
(the zero-bubble schedules then run as 1F1B-like schedules with empty W slots).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["CompileOptions", "check_compile", "compile_layers", "warn_whole_backward"]

CompileOptions = Mapping[str, Any]


def check_compile(compile: object, *, split_parameters: bool = False) -> CompileOptions | None:
    """``compile=`` as ``torch.compile``'s keyword arguments (None: no compilation); refused
    where parameters are split over ranks (``tensor_parallel``, ``shard``), not yet tried."""
    if compile is False or compile is None:
        return None
    if compile is True:
        options: dict[str, Any] = {}
    elif isinstance(compile, Mapping) and all(isinstance(k, str) for k in compile):
        options = dict(compile)
    else:
        raise TypeError(
            "compile must be True, False or a dict of torch.compile's keyword arguments, "
            f"got {type(compile).__name__}"
        )
    if split_parameters:
        raise ValueError(
            "compile=True is not supported with tensor_parallel or shard yet: pass "
            "compile=False, or train without them"
        )
    return options


def warn_whole_backward(schedule: str) -> None:
    """Say that under ``schedule``, whose backward is split, each stage runs it whole at B."""
    warnings.warn(
        f"compile=True under {schedule!r}, whose backward is split: a compiled layer's "
        "backward can be neither split nor run twice, so each stage runs its whole backward "
        "at B and its W slots stay empty",
        stacklevel=3,
    )


def compile_layers(layers: nn.Sequential, options: CompileOptions) -> None:
    """Compile the ``forward`` of each of ``layers``' children in place."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward, **options)
