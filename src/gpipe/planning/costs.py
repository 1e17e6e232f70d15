"""What a schedule's actions cost: compute per stage, messages, memory and gradient sums."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from numbers import Real
from pathlib import Path
from typing import Any

__all__ = ["PER_STAGE_FIELDS", "Costs", "PerStage", "Route"]

PerStage = float | Sequence[float]  # one number for every stage, or one per stage
Route = tuple[int, int]  # a skip's (source, destination) stages

# The fields given per stage: ``scenario`` cuts them when it splits a rank's share.
PER_STAGE_FIELDS = ("forward", "backward", "weight", "activation_bytes", "grad_bytes", "recompute")
_SCALAR = ("latency", "message_bytes")  # one number for all


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_amount(name: str, value: Any) -> float:
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"Costs.{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_per_stage(name: str, value: Any) -> float | tuple[float, ...]:
    if _is_number(value):
        return _check_amount(name, value)
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise ValueError(
            f"Costs.{name} must be a number or a non-empty list of one number per stage, "
            f"got {value!r}"
        )
    return tuple(_check_amount(f"{name}[{s}]", v) for s, v in enumerate(value))


def _check_skip_bytes(value: Any) -> tuple[tuple[Route, float], ...]:
    """``{(src, dst): bytes}`` (or its pairs) as sorted pairs; ``"src->dst"`` keys (as JSON
    writes them) are read too."""
    if isinstance(value, tuple):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise ValueError(
            f"Costs.skip_bytes must map (source, destination) stages to bytes, got {value!r}"
        )
    routes: dict[Route, float] = {}
    for key, nbytes in value.items():
        route = key
        if isinstance(key, str):
            parts = key.split("->")
            route = tuple(int(p) for p in parts) if all(p.strip().isdigit() for p in parts) else key
        if not (
            isinstance(route, tuple)
            and len(route) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) for s in route)
            and 0 <= route[0] < route[1]
        ):
            raise ValueError(
                f"Costs.skip_bytes keys are (source, destination) stages with source < "
                f"destination, or 'source->destination', got {key!r}"
            )
        routes[route] = _check_amount(f"skip_bytes[{key!r}]", nbytes)
    return tuple(sorted(routes.items()))


def _check_scales(value: Any) -> tuple[float, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ValueError(
            f"Costs.microbatch_scale must be a list of one factor per micro-batch, got {value!r}"
        )
    return tuple(_check_amount(f"microbatch_scale[{i}]", v) for i, v in enumerate(value))


@dataclass(frozen=True)
class Costs:
    """What a schedule's actions cost, so that schedules can be compared before anything runs.

    ``forward``, ``backward``, ``weight`` (seconds) and ``activation_bytes`` are one number
    for every stage or a list of one per stage. ``backward`` is the input-gradient part of a
    backward and ``weight`` its weight-gradient part: a split-backward schedule runs them as
    its B and W actions; any other schedule's B does both and takes ``backward + weight``.

    A message between stages on different ranks arrives ``latency + message_bytes /
    bandwidth`` seconds after it is sent, whatever else is in flight (links never congest);
    between stages on one rank it arrives at once. A stage keeps ``activation_bytes`` per
    micro-batch from the start of its forward to the end of its last backward action; a
    re-materialized micro-batch (``simulate``'s ``checkpoint``) keeps only its input,
    taken to be a message's size, ``message_bytes``, until its backward recomputes the rest.

    ``skip_bytes`` maps a skip route ``(source, destination)`` to the bytes of one
    micro-batch's skip tensors on it (``gpipe.skip``; kept as sorted pairs, so that costs
    stay hashable): between ranks, that message and its gradient take ``latency +
    skip_bytes / bandwidth`` and the destination holds its copy, besides its activations,
    from its forward to its backward (re-materialized or not); within a rank the skip is
    shared, free and instant.

    ``recompute`` is the forward time each backward runs again when only some layers are
    recomputed (``gpipe.runtime.recompute.Layers``); it is added to every B.

    ``microbatch_scale`` makes micro-batches cost differently, as those of packed sequences
    of different lengths do: one factor per micro-batch that multiplies every compute action
    of it (F, B, W and R) on every stage, so the per-stage costs are those of a micro-batch
    of scale 1 (``with_tokens`` sets it from token counts). Empty, the default, is 1 for all;
    given, it must have one factor per micro-batch of the simulated schedule. Messages and
    memory are not scaled.

    With replicas (``simulate``'s ``data_parallel``), each stage's ``grad_bytes`` of
    gradients are summed over them by a ring all-reduce: ``2 (D - 1) / D x grad_bytes /
    allreduce_bandwidth`` (the link's bandwidth if None) plus ``2 (D - 1)`` latencies.
    Sharded (``simulate``'s ``shard``), the parameters, taken to be ``grad_bytes`` too, are
    all-gathered and the gradients reduce-scattered, each half that: ``(D - 1) / D x bytes /
    allreduce_bandwidth`` plus ``D - 1`` latencies.
    """

    forward: PerStage
    backward: PerStage
    weight: PerStage = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    message_bytes: float = 0.0
    activation_bytes: PerStage = 0.0
    skip_bytes: Mapping[Route, float] | tuple[tuple[Route, float], ...] = ()
    grad_bytes: PerStage = 0.0
    allreduce_bandwidth: float | None = None
    recompute: PerStage = 0.0
    microbatch_scale: Sequence[float] = ()

    def __post_init__(self) -> None:
        for name in PER_STAGE_FIELDS:
            object.__setattr__(self, name, _check_per_stage(name, getattr(self, name)))
        for name in _SCALAR:
            object.__setattr__(self, name, _check_amount(name, getattr(self, name)))
        object.__setattr__(self, "skip_bytes", _check_skip_bytes(self.skip_bytes))
        object.__setattr__(self, "microbatch_scale", _check_scales(self.microbatch_scale))
        ring = self.allreduce_bandwidth
        if ring is not None and (not _is_number(ring) or math.isnan(ring) or ring <= 0):
            raise ValueError(
                f"Costs.allreduce_bandwidth must be a positive number of bytes per second or "
                f"None (the link's bandwidth), got {ring!r}"
            )
        bandwidth = self.bandwidth
        if not _is_number(bandwidth) or math.isnan(bandwidth) or bandwidth <= 0:
            raise ValueError(
                f"Costs.bandwidth must be a positive number of bytes per second, got {bandwidth!r}"
            )
        object.__setattr__(self, "bandwidth", float(bandwidth))

    @classmethod
    def from_file(cls, path: str | Path) -> Costs:
        """Read costs from a JSON object such as ``{"forward": [1, 2], "backward": 2}``."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of costs, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{path}: unknown cost fields {unknown}; expected some of {known}")
        missing = [name for name in ("forward", "backward") if name not in data]
        if missing:
            raise ValueError(f"{path}: missing cost fields {missing}")
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values (per-stage values as lists, skip routes as
        ``"src->dst"`` keys); ``from_file`` reads it."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "skip_bytes":
                value = {f"{src}->{dst}": v for (src, dst), v in value}
            if f.name == "microbatch_scale" and not value:
                continue  # equal micro-batches: the files of before read the same
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def with_tokens(self, tokens: Sequence[float]) -> Costs:
        """These costs with micro-batches that cost in proportion to their ``tokens``, the
        per-stage costs being those of a micro-batch of the mean token count."""
        if not tokens or any(not _is_number(t) or t <= 0 for t in tokens):
            raise ValueError(
                f"tokens must be a non-empty list of positive token counts, got {tokens!r}"
            )
        mean = sum(tokens) / len(tokens)
        return dataclasses.replace(self, microbatch_scale=[t / mean for t in tokens])

    def microbatch_scales(self, n_microbatches: int) -> tuple[float, ...] | None:
        """Each micro-batch's factor, or None when all are 1 (``microbatch_scale`` empty);
        a list that does not have ``n_microbatches`` factors is refused."""
        scale = self.microbatch_scale
        if not scale:
            return None
        if len(scale) != n_microbatches:
            raise ValueError(
                f"Costs.microbatch_scale has {len(scale)} factors, but the schedule has "
                f"{n_microbatches} micro-batches"
            )
        return tuple(scale)

    def per_stage(self, name: str, n_stages: int) -> tuple[float, ...]:
        """The field ``name`` as one value per stage, checking a list has ``n_stages`` values."""
        value = getattr(self, name)
        if isinstance(value, tuple):
            if len(value) != n_stages:
                raise ValueError(
                    f"Costs.{name} has {len(value)} values, but the schedule has {n_stages} stages"
                )
            return value
        return (value,) * n_stages
