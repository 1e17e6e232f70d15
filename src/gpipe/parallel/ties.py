"""Parameters that layers of different stages share, such as a tied embedding and output
projection: one parameter in effect, a copy on each stage.

A model ties a weight by using one ``nn.Parameter`` object in several layers (``find_ties``).
Once its layers are cut into stages on different devices or processes, one object cannot
serve them all, so each stage that uses it gets a copy (``untie``). A model may instead hold
separate Parameters that start equal and declare them tied by name (``declared_ties``), as
the reference GPT does its embedding and head. Either way, after the backward every copy's
gradient is set to the sum over all copies (``sum_local`` in one process, ``TiedGradients``
across processes, each wait bounded by the pipeline's timeout), the gradient the one shared
parameter would have had, so the optimizer moves every copy alike and they stay equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.comm.process_group import bounded_wait
from gpipe.runtime.dtensors import dtensor_like, is_dtensor, local_part
from gpipe.runtime.partitions import stage_bounds

__all__ = [
    "Tie",
    "TiedGradients",
    "counted",
    "declared_ties",
    "find_ties",
    "sum_local",
    "untie",
]


@dataclass(frozen=True)
class Tie:
    """One parameter shared across stages: for each stage that uses it, the names (in the
    whole ``nn.Sequential``) under which that stage's layers hold it, stages in order; and
    its shape, for the ranks that sum it without holding a copy. The names of one stage are
    one Parameter where the model shares it, several where it declares them tied."""

    copies: tuple[tuple[int, tuple[str, ...]], ...]
    shape: tuple[int, ...] = ()

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(stage for stage, _ in self.copies)

    def name(self, stage: int) -> str:
        """The name of ``stage``'s copy (its first, if its layers use it under several)."""
        return dict(self.copies)[stage][0]


def find_ties(module: nn.Sequential, balance: Sequence[int]) -> list[Tie]:
    """The parameters that layers of more than one stage share (one object in several
    layers), in the order of their first use."""
    bounds = stage_bounds(balance)
    owners: dict[int, dict[int, list[str]]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for index, (name, layer) in enumerate(module.named_children()):
        stage = next(s for s, (start, stop) in enumerate(bounds) if start <= index < stop)
        for qualified, param in layer.named_parameters(prefix=name, remove_duplicate=False):
            owners.setdefault(id(param), {}).setdefault(stage, []).append(qualified)
            shapes[id(param)] = tuple(param.shape)
    return [
        Tie(tuple((stage, tuple(names)) for stage, names in by_stage.items()), shapes[key])
        for key, by_stage in owners.items()
        if len(by_stage) > 1
    ]


def declared_ties(
    module: nn.Sequential, balance: Sequence[int], names: Iterable[Sequence[str]]
) -> list[Tie]:
    """The ties a model declares by name rather than by sharing one Parameter: each entry of
    ``names`` names (in the whole ``nn.Sequential``, as ``"5.proj.weight"``) separate
    Parameters that start equal and are to stay equal, such as the reference GPT's embedding
    and head (``gpipe.models.gpt.tied_weights``). Their copies may lie on one stage."""
    bounds = stage_bounds(balance)
    index = {name: i for i, (name, _) in enumerate(module.named_children())}
    ties = []
    for tied in names:
        by_stage: dict[int, list[str]] = {}
        for name in tied:
            layer = index[name.partition(".")[0]]
            stage = next(s for s, (start, stop) in enumerate(bounds) if start <= layer < stop)
            by_stage.setdefault(stage, []).append(name)
        copies = tuple((stage, tuple(by_stage[stage])) for stage in sorted(by_stage))
        ties.append(Tie(copies, tuple(module.get_parameter(tied[0]).shape)))
    return ties


def _set(module: nn.Module, name: str, value: nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    setattr(owner, attr, value)


def untie(module: nn.Sequential, ties: Sequence[Tie]) -> None:
    """Give every stage after the first its own copy of each tied parameter (a clone, equal
    to the original; shared still by the layers of that stage)."""
    for tie in ties:
        original = module.get_parameter(tie.copies[0][1][0])
        for _, names in tie.copies[1:]:
            copy = nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad)
            for name in names:
                _set(module, name, copy)


def _local_shape(shape: tuple[int, ...], like: Tensor) -> tuple[int, ...]:
    """The shape of this rank's shard of a tensor of ``shape`` sharded as ``like`` is
    (``fully_shard`` splits dim 0 as ``torch.chunk`` does, empty shards last)."""
    if not is_dtensor(like) or not shape:
        return shape
    d, r = like.device_mesh.size(), like.device_mesh.get_local_rank()
    sizes = [len(c) for c in torch.arange(shape[0]).chunk(d)] + [0] * d
    return (sizes[r], *shape[1:])


def _sum(grads: Sequence[Tensor | None], like: Tensor) -> Tensor:
    """The sum of the copies' gradients, shard by shard where they are sharded over the
    replicas: the copies of a tied weight are sharded alike on every stage (one shape, one
    replica count, split on dim 0)."""
    found = [local_part(g) for g in grads if g is not None]
    like = local_part(like)
    if not found:
        return torch.zeros_like(like)
    total = found[0].to(like.device, copy=True)
    for g in found[1:]:
        total += g.to(like.device)
    return total


def _assign(param: Tensor, total: Tensor) -> None:
    if param.grad is not None:
        local_part(param.grad).copy_(total)
    elif is_dtensor(param):
        param.grad = dtensor_like(param, total.clone())
    else:
        param.grad = total.to(param.device, copy=True)


def sum_local(copies: Sequence[Sequence[Tensor]]) -> None:
    """Set each copy's gradient to the sum over every copy of its parameter, all of them
    in this process (``copies``: for each tie, its copies)."""
    for params in copies:
        if all(p.grad is None for p in params):
            continue
        total = _sum([p.grad for p in params], params[0])
        for p in params:
            _assign(p, total)


def counted(ties: Sequence[Tie], params: dict[str, nn.Parameter]) -> list[nn.Parameter]:
    """``params`` with each tie counted once: its first copy (for gradient norms)."""
    extra: set[str] = set()
    for tie in ties:
        (_, first), *later = tie.copies
        extra.update(name for _, names in later for name in names)
        kept = params.get(first[0])  # the first stage's other names: the same Parameter,
        extra.update(n for n in first[1:] if params.get(n) is not kept)  # unless declared
    return [p for name, p in params.items() if name not in extra]


def _held(tie: Tie, params: dict[str, nn.Parameter], stages: Sequence[int]) -> list[nn.Parameter]:
    """The distinct copies of ``tie`` that ``stages`` hold, in the order of the tie's names."""
    held = [params[n] for s, names in tie.copies if s in stages for n in names if n in params]
    return list({id(p): p for p in held}.values())


class TiedGradients:
    """The ties of a pipeline spread over processes, as one rank holds them.

    ``rank_of(stage)`` gives a stage's rank in the pipeline's group and ``global_rank``
    turns that into a rank of the world. Every tie that spans processes is summed over one
    group: the ranks that hold a copy of any tie. A rank of that group without a copy of a
    given tie adds zeros. One group for all, rather than one per tie, because torch names a
    group made by only its members after the groups each member made before: ties over
    different sets of ranks would give one group two names, and its members would wait for
    each other forever. Creating it is collective among those ranks."""

    def __init__(
        self,
        ties: Sequence[Tie],
        params: dict[str, nn.Parameter],
        stages: Sequence[int],
        rank_of: Callable[[int], int],
        global_rank: Callable[[int], int],
        timeout: float,
        pipeline_group: dist.ProcessGroup | None = None,
    ) -> None:
        self._timeout = timeout
        self._stage = min(stages)
        # per tie: this rank's copies, the group (None within one process), the source of
        # the first copy, and the tie's shape
        self._entries: list[
            tuple[list[nn.Parameter], dist.ProcessGroup | None, int, tuple[int, ...]]
        ] = []
        spread = {i for i, t in enumerate(ties) if len({rank_of(s) for s in t.stages}) > 1}
        holders = sorted({global_rank(rank_of(s)) for i in spread for s in ties[i].stages})
        group = None
        if pipeline_group is not None and holders == sorted(
            dist.get_process_group_ranks(pipeline_group)
        ):
            # the pipeline's own group: another group of these ranks made by them alone
            # could take the name the device mesh gave this one, and their messages would mix
            group = pipeline_group
        elif dist.get_rank() in holders:
            group = dist.new_group(holders, use_local_synchronization=True)
        for i, tie in enumerate(ties):
            mine = _held(tie, params, stages)
            source = global_rank(rank_of(tie.stages[0]))
            if i in spread and group is not None:
                self._entries.append((mine, group, source, tie.shape))
            elif i not in spread and mine:
                self._entries.append((mine, None, source, tie.shape))
        held = [p for params_, _, _, _ in self._entries for p in params_]
        self._like = held[0] if held else None  # device and dtype of the zeros added

    def _zeros(self, shape: tuple[int, ...]) -> Tensor:
        assert self._like is not None
        shape = _local_shape(shape, self._like)
        return torch.zeros(shape, dtype=self._like.dtype, device=self._like.device)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def _wait(self, work: dist.Work, what: str) -> None:
        bounded_wait(work, self._timeout, self._stage, f"({what})", "a stage sharing a tied weight")

    @torch.no_grad()
    def broadcast(self) -> None:
        """Make every copy equal to the first stage's (after each rank built its own)."""
        for params, group, source, shape in self._entries:
            value = local_part(params[0].detach()) if params else self._zeros(shape)
            if group is not None:
                self._wait(
                    dist.broadcast(value, src=source, group=group, async_op=True),
                    "setting its copies equal",
                )
            for p in params[1:]:
                local_part(p.detach()).copy_(value)

    def sum(self) -> None:
        """Set every copy's gradient to the sum over all copies, on every rank."""
        for params, group, _, shape in self._entries:
            total = _sum([p.grad for p in params], params[0]) if params else self._zeros(shape)
            if group is not None:
                self._wait(
                    dist.all_reduce(total, group=group, async_op=True), "summing its gradients"
                )
            for p in params:
                _assign(p, total)
