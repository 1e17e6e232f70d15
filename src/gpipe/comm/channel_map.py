"""Where a stage's messages travel between processes: its process's rank, and a tag per channel."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from gpipe.schedules import Kind

__all__ = ["ChannelMap"]

_BACKWARD = (Kind.SEND_B, Kind.RECV_B, Kind.SEND_SKIP_B, Kind.RECV_SKIP_B)
_NEIGHBOURS = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)


class ChannelMap:
    """Stages on the ranks of ``group`` (``stage_to_rank``); a channel is a (global rank of
    the peer, tag) pair, the same at both ends of it."""

    def __init__(self, stage_to_rank: Sequence[int], group: dist.ProcessGroup | None) -> None:
        self.stage_to_rank = list(stage_to_rank)
        self._group = group

    def rank(self, stage: int) -> int:
        """The global rank of the process that holds ``stage``."""
        return self.global_rank(self.stage_to_rank[stage])

    def global_rank(self, rank: int) -> int:
        """The global rank of ``group``'s rank ``rank``."""
        return rank if self._group is None else dist.get_global_rank(self._group, rank)

    def tag(self, kind: Kind, src: int, dst: int) -> int:
        """One tag per channel: forward and backward traffic into each stage, and each pair of
        stages that exchange skips, so that their messages never match each other's."""
        backward = kind in _BACKWARD
        if kind in _NEIGHBOURS:
            return 2 * dst + backward
        n = len(self.stage_to_rank)
        return 2 * n + 2 * (src * n + dst) + backward

    def listed(
        self, stages: Sequence[int], skips: Sequence[tuple[int, int]]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The channels that a process holding ``stages``, with skip routes ``skips``,
        receives and sends on."""
        n = len(self.stage_to_rank)
        pairs = [(s - 1, s, Kind.RECV_F) for s in range(1, n)]
        pairs += [(s + 1, s, Kind.RECV_B) for s in range(n - 1)]
        pairs += [(a, b, Kind.RECV_SKIP) for a, b in skips]
        pairs += [(b, a, Kind.RECV_SKIP_B) for a, b in skips]
        receives, sends = [], []
        for src, dst, kind in pairs:
            if self.rank(src) == self.rank(dst):
                continue
            if dst in stages:
                receives.append((self.rank(src), self.tag(kind, src, dst)))
            if src in stages:
                sends.append((self.rank(dst), self.tag(kind, src, dst)))
        return receives, sends
