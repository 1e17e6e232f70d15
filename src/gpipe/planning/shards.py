"""What replicas hold and send: a process's parameters, gradients and optimizer state over
its stage's D replicas, whole or sharded, and the ring collectives that keep them in step.

``shard`` is ``Pipeline``'s: None keeps whole copies on every replica and all-reduces the
gradients once a step; ``"full"`` (FSDP, ``fully_shard``) keeps 1/D of everything between
steps, gathers the parameters at each stage's first forward and reduce-scatters the
gradients during its last backward; ``"optimizer"`` (ZeRO-1) and ``"gradients"`` (ZeRO-2)
shard the optimizer state, or it and the gradients, and replace the all-reduce by a
reduce-scatter and an all-gather of the updated parameters after the step. A shard is
counted as 1/D of the bytes; ``fully_shard`` pads each parameter's first dimension to a
multiple of D, so a process may hold up to D - 1 rows more of each.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SHARD_MODES", "ReplicaStates", "States", "check_shard", "ring_seconds"]

SHARD_MODES = (None, "optimizer", "gradients", "full")


def check_shard(shard: object, data_parallel: int, reshard_after_forward: bool = False) -> None:
    """Refuse, in one line, a ``shard`` that does not exist or that has no replicas to
    split over."""
    if not isinstance(shard, str | type(None)) or shard not in SHARD_MODES:
        raise ValueError(
            f"shard must be one of None, 'optimizer', 'gradients', 'full', got {shard!r}"
        )
    if shard is not None and data_parallel < 2:
        raise ValueError(
            f"shard={shard!r} splits each stage over its replicas and needs data_parallel > 1, "
            f"got data_parallel={data_parallel}"
        )
    if reshard_after_forward and shard != "full":
        raise ValueError(
            f"reshard_after_forward frees gathered parameters, which only shard='full' "
            f"gathers, got shard={shard!r}"
        )


def ring_seconds(
    nbytes: float, ranks: int, bandwidth: float, latency: float, passes: int = 1
) -> float:
    """A ring all-gather or reduce-scatter (``passes=1``) or all-reduce (``passes=2``) of
    ``nbytes`` over ``ranks`` ranks: each pass moves (D - 1) / D of the bytes through every
    rank's link and takes D - 1 latencies."""
    if ranks < 2:
        return 0.0
    d = ranks
    return passes * ((d - 1) / d * nbytes / bandwidth + (d - 1) * latency)


@dataclass(frozen=True)
class States:
    """One process's parameters (``params``) and gradients with optimizer state (``states``)
    at the step's peak and between steps (``held_*``), and the message buffers the
    gradients' reduction adds for a while (``messages``), in bytes."""

    params: float
    states: float
    held_params: float
    held_states: float
    messages: float


@dataclass(frozen=True)
class ReplicaStates:
    """How a process's states are kept over ``data_parallel`` replicas: ``shard`` as
    ``Pipeline``'s, ``optimizer_states`` tensors of optimizer state per parameter."""

    data_parallel: int = 1
    shard: str | None = None
    reshard_after_forward: bool = False
    optimizer_states: int = 2

    def __post_init__(self) -> None:
        check_shard(self.shard, self.data_parallel, self.reshard_after_forward)

    def states(self, weights: float, unit: float) -> States:
        """The states of a process whose stages have ``weights`` bytes of parameters, the
        largest unit (layer) ``unit`` of them.

        W whole parameters, as many bytes of gradients, o W of optimizer state; D replicas:

        - None: W + W + o W always; with replicas, the all-reduce buckets copy the gradients
          (W) from the last backward on.
        - ``"optimizer"``: o W / D; ``"gradients"``: W / D of gradients too, between steps.
          During the step the gradients accumulate whole over the micro-batches until the
          reduce-scatter, whose buckets copy them (W) and return their shards (W / D).
        - ``"full"``: W / D + W / D + o W / D between steps. During the step the shards stay
          beside the gathered parameters (W, or with ``reshard_after_forward`` the largest
          unit gathered at a time) and whole gradients (W); the reduce-scatter copies one
          unit's gradients and returns its shard (unit + unit / D) as it passes it.
        """
        w, d, o = weights, self.data_parallel, self.optimizer_states
        if self.shard is None:
            return States(w, w * (1 + o), w, w * (1 + o), w if d > 1 else 0.0)
        if self.shard in ("optimizer", "gradients"):
            grads = w if self.shard == "optimizer" else w / d
            return States(w, w + o * w / d, w, grads + o * w / d, w + w / d)
        gathered = unit if self.reshard_after_forward else w
        return States(w / d + gathered, w + o * w / d, w / d, (1 + o) * w / d, unit + unit / d)
