"""One rank's share of a model that tensor parallelism splits over T ranks, and the
collectives its layers wait for: what ``gpipe plan --tensor-parallel`` profiles and times.

The planner counts memory by profiling a model on the meta device; under a tensor-parallel
plan (``gpipe.parallel.tensor``) each rank holds modules of a smaller shape, so the same
profile of a copy whose split modules have their local shapes gives each rank's parameters,
gradients, optimizer state and activations, split where the plan splits them and whole where
it leaves them whole. A colwise ``nn.Linear`` keeps 1/T of its output features (bias split
too), a rowwise one 1/T of its input features (bias whole); a rowwise ``nn.Embedding`` 1/T
of its vocabulary rows, a colwise one 1/T of its width. A colwise map whose output the style
gathers (``output_layouts=Replicate()``, as the GPT's head does) returns the gathered width,
and a rowwise map whose input the style splits (``input_layouts=Replicate()``) takes the
whole input. A stacked-experts module (``ExpertsParallel``) keeps 1/T of each split
parameter's features, as the style places them. Other styles (``SequenceParallel``, a style
of one's own) are left whole: an upper bound.

Collectives are counted per layer as Megatron-LM runs a block: a rowwise map all-reduces its
output in the forward and the input of its colwise partner in the backward; a gathering
colwise map all-gathers its output forward and all-reduces its input backward; a rowwise
embedding all-reduces its output forward. Their time is a ring's on the link
(``gpipe.planning.roofline.Link``), as the cluster planner counts the same collectives.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from gpipe.parallel.experts import ExpertsParallel
from gpipe.parallel.tensor import resolve_plan
from gpipe.planning.roofline import Link
from gpipe.runtime.partitions import as_sequential

__all__ = ["Collectives", "collectives", "local_share"]


class _GatheredLinear(nn.Linear):
    """A split linear map whose output the style gathers: the local output repeated T
    times, the shape (and bytes) of the gathered tensor. A map still, so that its holder's
    initialization finds its weight."""

    tensor_parallel = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().forward(x)] * self.tensor_parallel, dim=-1)


class _GatheredEmbedding(nn.Embedding):
    """A split embedding whose output the style gathers (see ``_GatheredLinear``)."""

    tensor_parallel = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().forward(x)] * self.tensor_parallel, dim=-1)


class _SplitInputLinear(nn.Linear):
    """A rowwise map whose input the style splits on the way in (``input_layouts=
    Replicate()``: Phi-3's and OLMo 2's output maps, after maps that gather): it takes the
    whole input and multiplies its rank's share of it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x[..., : self.in_features])


def _gathers(style: ParallelStyle) -> bool:
    layouts = getattr(style, "output_layouts", ())
    return isinstance(style, ColwiseParallel) and any(isinstance(p, Replicate) for p in layouts)


def _splits_input(style: ParallelStyle) -> bool:
    layouts = getattr(style, "input_layouts", ())
    return isinstance(style, RowwiseParallel) and any(isinstance(p, Replicate) for p in layouts)


def _share(size: int, tensor_parallel: int) -> int:
    return -(-size // tensor_parallel)  # DTensor's first shards are the larger ones


def _local(module: nn.Module, style: ParallelStyle, t: int) -> nn.Module | None:
    """The module one rank holds under ``style``, or None to keep it whole."""
    weight = module.weight if isinstance(module, nn.Linear | nn.Embedding) else None
    kind = {"device": "meta", "dtype": None if weight is None else weight.dtype}
    colwise, rowwise = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
    gathered = _gathers(style)
    local: nn.Linear | nn.Embedding
    if isinstance(module, nn.Linear) and (colwise or rowwise):
        bias = module.bias is not None
        d_in, d_out = module.in_features, module.out_features
        if colwise:
            linear = _GatheredLinear if gathered else nn.Linear
            local = nn.utils.skip_init(linear, d_in, _share(d_out, t), bias=bias, **kind)
        else:
            linear = _SplitInputLinear if _splits_input(style) else nn.Linear
            local = nn.utils.skip_init(linear, _share(d_in, t), d_out, bias=bias, **kind)
    elif isinstance(module, nn.Embedding) and (colwise or rowwise):
        rows, width = module.num_embeddings, module.embedding_dim
        if colwise:
            width = _share(width, t)
        else:
            rows = _share(rows, t)
        embedding = _GatheredEmbedding if gathered and colwise else nn.Embedding
        local = nn.utils.skip_init(embedding, rows, width, **kind)
    else:
        return None
    if isinstance(local, _GatheredLinear | _GatheredEmbedding):
        local.tensor_parallel = t
    return local


def _split_experts(module: nn.Module, style: ExpertsParallel, t: int) -> None:
    """Give ``module``'s stacked maps the shapes one rank holds under ``style``: a stacked map
    is (experts, out, in), its bias (experts, out); ``packed`` and ``columns`` maps keep 1/T
    of their output features (each of a packed map's two halves split alike), ``rows`` maps
    1/T of their last dimension."""
    for name in (*style.packed, *style.columns, *style.rows):
        param = getattr(module, name)
        dim = (
            param.dim() - 1 if name in style.rows else param.dim() - (2 if param.dim() == 3 else 1)
        )
        shape = list(param.shape)
        halves = 2 if name in style.packed else 1
        shape[dim] = halves * _share(shape[dim] // halves, t)
        local = torch.empty(shape, dtype=param.dtype, device="meta")
        setattr(module, name, nn.Parameter(local, requires_grad=param.requires_grad))


def local_share(
    layers: nn.Sequential | Sequence[nn.Module],
    tensor_parallel: int,
    tp_plan: dict[str, str | ParallelStyle] | None = None,
) -> nn.Sequential:
    """A copy of ``layers`` (on the meta device) with each module ``tp_plan`` splits in the
    shape one of ``tensor_parallel`` ranks holds. ``tp_plan`` as ``Pipeline`` takes it (None:
    the plan the layers declare); refused, in one line, where ``Pipeline`` would refuse it
    (a size the ranks do not divide, the heads among them)."""
    module = as_sequential(layers)
    styles = resolve_plan(tp_plan, module, tensor_parallel).styles
    share = copy.deepcopy(module).to("meta")
    if tensor_parallel == 1:
        return share
    for name, style in styles.items():
        if isinstance(style, ExpertsParallel):
            _split_experts(share.get_submodule(name), style, tensor_parallel)
            continue
        local = _local(share.get_submodule(name), style, tensor_parallel)
        if local is not None:
            parent, _, child = name.rpartition(".")
            setattr(share.get_submodule(parent), child, local)
    return share


@dataclass(frozen=True)
class Collectives:
    """Per layer, the elements per token each tensor-parallel collective moves: all-reduces
    and all-gathers of the forward, all-reduces of the backward (element size ``itemsize``
    bytes). The whole width is counted, as a ring's traffic is."""

    forward_reduce: tuple[tuple[int, ...], ...]
    forward_gather: tuple[tuple[int, ...], ...]
    backward_reduce: tuple[tuple[int, ...], ...]
    itemsize: int

    def seconds(
        self, layer: int, tokens: float, link: Link, tensor_parallel: int
    ) -> tuple[float, float]:
        """The forward's and the backward's collectives of ``layer`` for ``tokens`` tokens,
        on ``link`` among ``tensor_parallel`` ranks."""

        def ring(widths: tuple[int, ...], passes: int) -> float:
            return sum(
                link.ring(w * tokens * self.itemsize, tensor_parallel, passes) for w in widths
            )

        forward = ring(self.forward_reduce[layer], 2) + ring(self.forward_gather[layer], 1)
        return forward, ring(self.backward_reduce[layer], 2)

    def per_row(
        self, seq_len: int, link: Link, tensor_parallel: int, scale: float = 1.0
    ) -> tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]:
        """Every layer's forward and backward collectives as ``(fixed, per row)`` for rows of
        ``seq_len`` tokens, times ``scale`` (seconds to the unit of the compute's costs):
        ``LayerCosts``'s ``comm_forward`` and ``comm_backward``. A ring's time is its
        latencies plus its bytes over the link, so two sizes give the line exactly."""
        forward, backward = [], []
        for layer in range(len(self.forward_reduce)):
            f0, b0 = self.seconds(layer, 0, link, tensor_parallel)
            f1, b1 = self.seconds(layer, seq_len, link, tensor_parallel)
            forward.append((f0 * scale, (f1 - f0) * scale))
            backward.append((b0 * scale, (b1 - b0) * scale))
        return tuple(forward), tuple(backward)


def collectives(
    layers: nn.Sequential | Sequence[nn.Module],
    tensor_parallel: int,
    tp_plan: dict[str, str | ParallelStyle] | None = None,
) -> Collectives:
    """The collectives of each layer of ``layers`` (the whole model) split as ``tp_plan``
    says (None: as the layers declare)."""
    module = as_sequential(layers)
    styles = resolve_plan(tp_plan, module, tensor_parallel).styles
    n = len(module)
    forward: list[list[int]] = [[] for _ in range(n)]
    gather: list[list[int]] = [[] for _ in range(n)]
    backward: list[list[int]] = [[] for _ in range(n)]
    index = {name: i for i, (name, _) in enumerate(module.named_children())}
    itemsize = next((p.element_size() for p in module.parameters()), 4)
    for name, style in styles.items():
        sub, layer = module.get_submodule(name), index[name.split(".", 1)[0]]
        if isinstance(sub, nn.Linear) and isinstance(style, RowwiseParallel):
            forward[layer].append(sub.out_features)
            backward[layer].append(sub.out_features)  # the partner's input, as wide
        elif isinstance(sub, nn.Linear) and _gathers(style):
            gather[layer].append(sub.out_features)
            backward[layer].append(sub.in_features)
        elif isinstance(sub, nn.Embedding) and isinstance(style, RowwiseParallel):
            forward[layer].append(sub.embedding_dim)
        elif isinstance(sub, nn.Embedding) and _gathers(style):
            gather[layer].append(sub.embedding_dim)

    def frozen(values: list[list[int]]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(v) for v in values)

    return Collectives(frozen(forward), frozen(gather), frozen(backward), itemsize)
