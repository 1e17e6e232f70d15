"""The two copies of a weight tied across stages (embedding and LM head), kept equal."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from gpipe.models.gpt import tied_weights
from gpipe.pipeline import Pipeline

__all__ = ["TiedCopies"]


class TiedCopies:
    """The tied embedding/head pair as this rank sees it: which copy it holds, if any.

    The two copies start equal and their gradients are summed before every optimizer step,
    so they stay equal, as one shared weight would."""

    def __init__(self, pipe: Pipeline, layers: nn.Sequential) -> None:
        pairs = tied_weights(layers)
        self.enabled = bool(pairs)
        self.embedding = self.head = None
        self.group = None
        if not self.enabled:
            return
        ((embedding, embedding_name, head, head_name),) = pairs
        named = dict(pipe.named_parameters())
        self.embedding = named.get(f"{embedding}.{embedding_name}")
        self.head = named.get(f"{head}.{head_name}")
        if pipe.n_ranks > 1:  # the two ranks of this replica's pipeline that hold them
            ranks = pipe.rank_of(pipe.stage_of(embedding)), pipe.rank_of(pipe.stage_of(head))
            if ranks[0] != ranks[1] and (self.embedding is not None or self.head is not None):
                members = sorted(pipe.global_rank(r) for r in ranks)
                self.group = dist.new_group(members, use_local_synchronization=True)

    def sync_grads(self) -> None:
        """Sum the gradients of the two copies, so both take the same optimizer step."""
        if not self.enabled:
            return
        if self.embedding is not None and self.head is not None:  # both on this stage
            total = self.embedding.grad + self.head.grad
            self.embedding.grad.copy_(total)
            self.head.grad.copy_(total)
        elif self.group is not None:
            copy = self.embedding if self.embedding is not None else self.head
            if copy is not None:  # sharded (a DTensor): the copies' shards are the same rows
                grad = copy.grad
                dist.all_reduce(getattr(grad, "_local_tensor", grad), group=self.group)

    def counted(self, pipe: Pipeline) -> list[nn.Parameter]:
        """Parameters counted in the gradient norm: the head's copy of a tied weight is not."""
        return [p for p in pipe.parameters() if p is not self.head]
