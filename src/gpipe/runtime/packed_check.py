"""Checking a packed micro-batch's metadata against its tokens, before anything is sent.

A packed micro-batch (``gpipe.data.pack``) holds several documents per row; ``cu_seqlens``
bounds them in the micro-batch's tokens laid row after row, ``position_ids`` restart at 0
with each, ``max_seqlen`` is the longest. Varlen kernels read the first, Llama-style models
the second: where they disagree with the tokens, or with each other, attention crosses
documents or reads past the end, silently. ``check_packed`` says which micro-batch and how.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["check_packed"]


def _tokens(inputs: Mapping[str, Any], where: str) -> Tensor | None:
    """The (rows, T) tensor whose tokens ``cu_seqlens`` counts: ``input_ids``, else
    ``position_ids``; None when there is neither."""
    for key in ("input_ids", "position_ids"):
        value = inputs.get(key)
        if isinstance(value, Tensor):
            if value.dim() != 2:
                raise ValueError(
                    f"{where}: {key} must be (rows, tokens), got shape {tuple(value.shape)}"
                )
            return value
    return None


def _bounds(cu_seqlens: Any, where: str) -> list[int]:
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, Tensor) else type(cu_seqlens)
        raise ValueError(f"{where}: cu_seqlens must be a 1-D tensor of offsets, got {got}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.numel() < 2:
        raise ValueError(
            f"{where}: cu_seqlens must hold at least 2 integer offsets, got "
            f"{cu_seqlens.numel()} of {cu_seqlens.dtype}"
        )
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0:
        raise ValueError(f"{where}: cu_seqlens must start at 0, got {bounds[0]}")
    for i in range(1, len(bounds)):
        if bounds[i] <= bounds[i - 1]:
            raise ValueError(
                f"{where}: cu_seqlens must increase, got {bounds[i - 1]} then {bounds[i]} "
                f"at entries {i - 1} and {i}"
            )
    return bounds


def check_packed(inputs: Any, where: str = "inputs") -> None:
    """Refuse, in one ``ValueError`` naming ``where`` (say ``"microbatches[2] inputs"``), a
    packed micro-batch whose metadata does not match its tokens: ``cu_seqlens`` not 1-D
    integer offsets from 0, not increasing, or not ending at the micro-batch's tokens (rows x
    T of ``input_ids``, or of ``position_ids``); ``max_seqlen`` other than the longest
    segment; ``position_ids`` of another shape than ``input_ids``, or not 0 where a segment
    begins. Inputs without ``cu_seqlens`` (not a mapping, or not packed) pass unread.

    It reads ``cu_seqlens`` and ``position_ids`` on the host: call it on the micro-batches as
    the user gives them, before they move to a device."""
    if not isinstance(inputs, Mapping) or "cu_seqlens" not in inputs:
        return
    bounds = _bounds(inputs["cu_seqlens"], where)
    tokens = _tokens(inputs, where)
    if tokens is not None and bounds[-1] != tokens.numel():
        rows, width = tokens.shape
        raise ValueError(
            f"{where}: cu_seqlens ends at {bounds[-1]} but the micro-batch holds "
            f"{tokens.numel()} tokens ({rows} rows x {width}): its last entry must count "
            "every token, each row's padding a segment of its own"
        )
    longest = max(b - a for a, b in itertools.pairwise(bounds))
    given = inputs.get("max_seqlen")
    if given is not None and int(given) != longest:
        raise ValueError(
            f"{where}: max_seqlen is {int(given)} but the longest segment of cu_seqlens is "
            f"{longest}"
        )
    positions = inputs.get("position_ids")
    if not isinstance(positions, Tensor):
        return
    ids = inputs.get("input_ids")
    if isinstance(ids, Tensor) and positions.shape != ids.shape:
        raise ValueError(
            f"{where}: position_ids have shape {tuple(positions.shape)} but input_ids "
            f"{tuple(ids.shape)}"
        )
    restart = positions.detach().reshape(-1).cpu()[torch.tensor(bounds[:-1])]
    wrong = (restart != 0).nonzero()
    if wrong.numel():
        i = int(wrong[0])
        raise ValueError(
            f"{where}: segment {i} of cu_seqlens begins at token {bounds[i]}, where "
            f"position_ids are {int(restart[i])}, not 0: the two disagree on where documents "
            "begin"
        )
