"""Where to cut a model: balances from per-layer costs, measured or counted.

``balance_by_time``, ``balance_by_size`` and ``balance_by_params`` take the arguments of
torchgpipe's functions of the same names, so scripts written for it keep working. All of
them end in ``partition``, which cuts a list of costs into contiguous parts so that the most
expensive part costs as little as possible.
"""

from __future__ import annotations

import bisect
import copy
import statistics
import time
from collections.abc import Iterator, Sequence
from itertools import accumulate

import torch
from torch import Tensor, nn

from gpipe.runtime.microbatch import Batch, as_tuple, like
from gpipe.runtime.partitions import as_sequential, materialize
from gpipe.skip.namespace import SkipKey
from gpipe.skip.tracker import use_tracker

__all__ = [
    "balance_by_params",
    "balance_by_size",
    "balance_by_time",
    "layer_times",
    "partition",
]


def _parts_needed(prefix: list[float], limit: float) -> list[int]:
    """need[i]: fewest parts that cover layers i.. with no part above ``limit``."""
    n = len(prefix) - 1
    need = [0] * (n + 1)
    end = n
    for i in range(n - 1, -1, -1):
        while end > i and prefix[end] - prefix[i] > limit:  # the longest first part from i
            end -= 1
        need[i] = 1 + need[end] if end > i else n + 1  # a layer above limit: impossible
    return need


def partition(costs: Sequence[float], parts: int) -> list[int]:
    """Layers per part: contiguous, none empty, the largest part sum as small as possible;
    among equally good cuts, parts as even as it can make them."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a positive integer, got {parts!r}")
    if len(costs) < parts:
        raise ValueError(f"cannot cut {len(costs)} layers into {parts} non-empty partitions")
    if any(not c >= 0 for c in costs):
        raise ValueError(f"costs must be non-negative numbers, got {list(costs)}")
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    lo, hi = max(costs, default=0.0) - 1e-12, prefix[-1]
    for _ in range(200):  # bisection on the bottleneck until it cannot move
        mid = (lo + hi) / 2
        if not lo < mid < hi:
            break
        if _parts_needed(prefix, mid)[0] <= parts:
            hi = mid
        else:
            lo = mid
    need = _parts_needed(prefix, hi)
    n, start, sizes = len(costs), 0, []
    for left in range(parts, 0, -1):
        if left == 1:
            sizes.append(n - start)
            break
        # ends that keep this part under the bottleneck and the rest coverable
        last = bisect.bisect_right(prefix, prefix[start] + hi) - 1
        last = min(last, n - (left - 1))
        first = start + 1
        while first < last and need[first] > left - 1:
            first += 1
        target = prefix[start] + (prefix[n] - prefix[start]) / left
        even = (n - start) / left  # layers per part, for ties in cost

        def unevenness(
            e: int, start: int = start, target: float = target, even: float = even
        ) -> tuple[float, float]:
            return abs(prefix[e] - target), abs(e - start - even)

        end = min(range(first, last + 1), key=unevenness)
        sizes.append(end - start)
        start = end
    return sizes


def balance_by_params(
    partitions: int, module: nn.Sequential, *, requires_grad: bool = True
) -> list[int]:
    """Balance by parameter count (no profiling): even memory for weights and optimizer."""
    layers = as_sequential(module)
    costs = [
        sum(p.numel() for p in layer.parameters() if p.requires_grad or not requires_grad)
        for layer in layers
    ]
    return partition(costs, partitions)


class _ProfilingTracker:
    """Skips while layers are profiled one at a time, each run several times: a stash keeps
    a detached copy of the tensor (the stashing layer's graph is freed by its own backward)
    and every pop reads it, so a popping layer can run as often as it is timed."""

    def __init__(self) -> None:
        self._tensors: dict[SkipKey, Tensor | None] = {}

    def save(self, key: SkipKey, tensor: Tensor | None) -> None:
        self._tensors[key] = None if tensor is None else _leaf_like(tensor)

    def load(self, key: SkipKey) -> Tensor | None:
        if key not in self._tensors:
            raise RuntimeError(f"skip {key[1]!r} was popped before it was stashed")
        return self._tensors[key]


def _leaf_like(t: Tensor) -> Tensor:
    return t.detach().requires_grad_(t.is_floating_point())


def _sandbox(module: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """Copies of the layers, one at a time, in training mode, to profile: the model's
    weights, gradients, buffers and mode stay untouched, and at most one layer more than the
    model is ever allocated. Layers built on the meta device are allocated and initialized on
    ``device``. A model whose parameters already hold gradients is refused: profiling would
    time and measure with them around."""
    layers = as_sequential(module)
    if any(p.grad is not None for p in layers.parameters()):
        raise ValueError("some parameter already has gradient")
    for index, layer in enumerate(layers):
        yield materialize(copy.deepcopy(layer), index, device, seed=0).train()


def _inputs(sample: Tensor | Sequence[Tensor], device: torch.device) -> Batch:
    batch = sample if isinstance(sample, Tensor) else tuple(sample)
    return like(batch, [_leaf_like(t.to(device)) for t in as_tuple(batch)])


def _writable(inputs: Batch) -> Batch:
    """The inputs as inner tensors of a graph, not leaves, as a layer meets them in the model:
    a layer may then change them in place (``nn.ReLU(inplace=True)``)."""
    return like(inputs, [t.clone() if t.requires_grad else t for t in as_tuple(inputs)])


def _run_layer(layer: nn.Module, inputs: Batch) -> Batch:
    """Forward and backward of one layer; returns its (detached) outputs for the next."""
    return _backward(layer(inputs))


def _backward(outputs: Batch) -> Batch:
    """Backward from a layer's outputs; returns them detached, as the next layer's inputs."""
    roots = [t for t in as_tuple(outputs) if t.requires_grad]
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    return like(outputs, [_leaf_like(t) for t in as_tuple(outputs)])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_layer(
    layer: nn.Module, x: Batch, budget: float, device: torch.device
) -> tuple[float, Batch]:
    """Median seconds of forward + backward over repeats for about ``budget`` seconds (at
    least three, at most a hundred), after one warm-up run."""
    outputs = _run_layer(layer, _writable(x))
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 100):
        fresh = _writable(x)
        _synchronize(device)
        start = time.perf_counter()
        _run_layer(layer, fresh)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), outputs


def layer_times(
    module: nn.Sequential,
    sample: Tensor | Sequence[Tensor],
    *,
    timeout: float = 1.0,
    device: torch.device | str | None = None,
) -> list[float]:
    """Seconds of forward + backward of each layer on ``sample`` (one micro-batch), spending
    about ``timeout`` seconds in all; the global random state is left as it was."""
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    device = torch.device(device) if device is not None else _default_device()
    n_layers = len(as_sequential(module))
    budget = timeout / max(1, n_layers)
    costs = []
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        use_tracker(_ProfilingTracker()),
    ):
        x = _inputs(sample, device)
        for layer in _sandbox(module, device):
            cost, x = _time_layer(layer, x, budget, device)
            costs.append(cost)
    return costs


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: Tensor | Sequence[Tensor],
    *,
    timeout: float = 1.0,
    device: torch.device | str | None = None,
) -> list[int]:
    """Balance by each layer's measured forward + backward time on ``sample`` (one
    micro-batch): the median over repeats, about ``timeout`` seconds in all, after a warm-up."""
    return partition(layer_times(module, sample, timeout=timeout, device=device), partitions)


def _graph_leaves(outputs: Batch) -> list[Tensor]:
    """Leaf tensors the autograd graph of ``outputs`` holds (e.g. tensors a layer made that
    require a gradient): memory the layer keeps besides its saved tensors."""
    stack = [t.grad_fn for t in as_tuple(outputs)]
    visited, leaves = set(), []
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _saved_bytes(layer: nn.Module, inputs: Batch) -> tuple[int, Batch]:
    """Bytes the autograd graph of ``layer`` keeps for its backward: saved tensors and leaves
    it made (parameters and the layer's input left out)."""
    leaves, inputs = inputs, _writable(inputs)  # the leaves are in the graph, behind copies
    skipped = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    skipped |= {t.untyped_storage().data_ptr() for t in (*as_tuple(leaves), *as_tuple(inputs))}
    seen: dict[int, int] = {}

    def count(t: Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        if key not in skipped:
            seen[key] = t.untyped_storage().nbytes()

    def pack(t: Tensor) -> Tensor:
        count(t)
        return t.detach()  # the tensor itself would tie an output to its own graph

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = layer(inputs)
    for leaf in _graph_leaves(outputs):
        count(leaf)
    return sum(seen.values()), _backward(outputs)


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    input: Tensor | Sequence[Tensor],
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: torch.device | str | None = None,
) -> list[int]:
    """Balance by memory: activations kept for backward, measured on ``input`` (one
    mini-batch, split into ``chunks``), plus parameters times ``param_scale`` (2 for SGD:
    weights and gradients; 4 for Adam: with two moments)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if param_scale < 0:
        raise ValueError(f"param_scale must not be negative, got {param_scale!r}")
    device = torch.device(device) if device is not None else _default_device()
    batch = input if isinstance(input, Tensor) else tuple(input)
    sample = like(batch, [t[: max(1, t.size(0) // chunks)] for t in as_tuple(batch)])
    costs = []
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        use_tracker(_ProfilingTracker()),
    ):
        x = _inputs(sample, device)
        for layer in _sandbox(module, device):
            activations, x = _saved_bytes(layer, x)
            weights = sum(p.numel() * p.element_size() for p in layer.parameters())
            costs.append(activations + param_scale * weights)
    return partition(costs, partitions)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
