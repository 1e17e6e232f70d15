"""Profiling a model's memory: one forward of a small micro-batch records every storage
autograd saves, and each layer's input and output, so the bytes a stage holds for one
micro-batch are known exactly for any cut. The profile runs at two sizes to find what grows
with the rows and what does not, and ``Profile.held`` scales it to any micro-batch size."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from gpipe.comm.payload import flatten
from gpipe.planning.storages import storage_key, tensors_in
from gpipe.runtime.microbatch import check_payload
from gpipe.runtime.partitions import as_sequential
from gpipe.skip.tracker import use_tracker

__all__ = ["Profile", "profile"]


class _FusedAttention(TorchFunctionMode):
    """On the meta device, attention as the CPU runs it: the fused kernel where the CPU would
    choose it (it keeps inputs, output and log-sum-exp), the unfused formula with its T x T
    weights otherwise (with dropout, for one). Meta tensors alone always take the latter."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].is_meta:
            q, k, v, *rest = args
            options = dict(
                zip(("attn_mask", "dropout_p", "is_causal", "scale"), rest, strict=False)
            )
            options |= kwargs
            dropout, causal = options.get("dropout_p", 0.0), options.get("is_causal", False)
            if options.get("attn_mask") is None and not options.get("enable_gqa", False):
                probe = torch.empty(1, 1, 2, q.size(-1), dtype=q.dtype)
                fused = torch._fused_sdp_choice(
                    probe, probe, probe, dropout_p=dropout, is_causal=causal
                )
                if fused == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value:
                    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                        q, k, v, dropout, causal, scale=options.get("scale")
                    )[0]
        return func(*args, **kwargs)


@dataclass(frozen=True)
class _Run:
    """One profiled forward: storage sizes, and which layers saved, took or made each."""

    sizes: dict[int, int]
    saved: list[frozenset[int]]  # per layer; the loss's saved storages go to the last layer
    inputs: list[frozenset[int]]
    outputs: list[frozenset[int]]
    batch: frozenset[int]  # the sample and target: parts of the user's mini-batch
    # skips (gpipe.skip): (layer that stashed, layer that popped, storages), in stash order
    skips: tuple[tuple[int, int, frozenset[int]], ...] = ()

    def _bytes(self, keys: Iterable[int]) -> int:
        return sum(self.sizes[k] for k in keys)

    def held(
        self, start: int, stop: int, recomputed: frozenset[int] = frozenset()
    ) -> tuple[int, int, int, int]:
        """Bytes of one micro-batch's graph over layers [start, stop) (saved storages, its
        input and output, and skip tensors it sends on), of its input, of its output, and of
        the most a ``recomputed`` layer (model index; only its input is kept) holds again
        while its backward recomputes it. Skip tensors it receives are left out
        (``skip_bytes``: whether they cost anything depends on where they come from). The
        model's input and target are views of the mini-batch, whose memory ``batch_bytes``
        counts once."""
        sent = set().union(*(k for a, b, k in self.skips if start <= a < stop <= b))
        received = set().union(*(k for a, b, k in self.skips if a < start <= b < stop))
        graph = set(self.inputs[start]) | self.outputs[stop - 1] | sent
        for layer in range(start, stop):
            graph |= self.inputs[layer] if layer in recomputed else self.saved[layer]
        graph -= self.batch | received
        again = max(
            (self._bytes(self.saved[layer] - graph) for layer in recomputed),
            default=0,
        )
        return (
            self._bytes(graph),
            self._bytes(self.inputs[start] - self.batch),
            self._bytes(self.outputs[stop - 1]),
            again,
        )

    def skip_bytes(self, bounds: Sequence[tuple[int, int]]) -> dict[tuple[int, int], int]:
        """Per skip route between the stages ``bounds`` cut, the bytes of one micro-batch's
        skip tensors as the destination receives them (in storage of its own)."""

        def stage(layer: int) -> int:
            return next(j for j, (lo, hi) in enumerate(bounds) if lo <= layer < hi)

        routes: dict[tuple[int, int], int] = {}
        for stashed, popped, keys in self.skips:
            route = (stage(stashed), stage(popped))
            if route[0] != route[1]:
                routes[route] = routes.get(route, 0) + self._bytes(keys)
        return routes

    def repeat(self, layer: int, times: int) -> _Run:
        """This run with ``layer`` run ``times`` times in a row, each copy's storages its own
        and each copy's input the previous copy's output."""
        (read,), (made,) = self.inputs[layer], self.outputs[layer]
        own = (self.saved[layer] | self.outputs[layer]) - self.inputs[layer]
        if any(layer in (a, b) for a, b, _ in self.skips):
            raise ValueError(f"layer {layer} stashes or pops a skip and cannot be repeated")
        sizes: dict[Any, int] = dict(self.sizes)
        per_layer = (self.saved, self.inputs, self.outputs)
        copies: tuple[list[frozenset[Any]], ...] = tuple(list(x[:layer]) for x in per_layer)
        for copy in range(times):
            names = {k: (k, copy) for k in own}
            if copy:
                names[read] = (made, copy - 1)  # what the copy before returned
            sizes.update({name: self.sizes[k] for k, name in names.items()})
            for into, keys in zip(copies, per_layer, strict=True):
                into.append(frozenset(names.get(k, k) for k in keys[layer]))
        last = {k: (k, times - 1) for k in own}
        for into, keys in zip(copies, per_layer, strict=True):
            into += [frozenset(last.get(k, k) for k in x) for x in keys[layer + 1 :]]
        saved, inputs, outputs = copies

        def moved(index: int) -> int:
            return index if index < layer else index + times - 1

        skips = tuple((moved(a), moved(b), keys) for a, b, keys in self.skips)
        return _Run(sizes, saved, inputs, outputs, self.batch, skips)

    def batch_bytes(self, start: int, stop: int) -> int:
        """Bytes of the sample (first stage) and of the saved target (last stage) in the
        range's graph."""
        keys = set(self.inputs[start]) | set().union(*self.saved[start:stop])
        return self._bytes(keys & self.batch)


class _SkipRecorder:
    """A standalone skip tracker that notes which layer stashed and which popped what."""

    def __init__(self, layer: list[int], note: Callable[[Iterable[Tensor]], frozenset[int]]):
        self._layer, self._note = layer, note
        self._tensors: dict[Any, tuple[int, Tensor | None]] = {}
        self.skips: list[tuple[int, int, frozenset[int]]] = []
        # popped tensors stay alive with the run, as every noted tensor does: a freed storage's
        # key may be taken by a later one, which would then be counted as the same storage
        self._popped: list[Tensor] = []

    def save(self, key: Any, tensor: Tensor | None) -> None:
        self._tensors[key] = (self._layer[0], tensor)

    def load(self, key: Any) -> Tensor | None:
        if key not in self._tensors:
            raise RuntimeError(f"skip {key[1]!r} was popped before it was stashed")
        stashed, tensor = self._tensors.pop(key)
        keys = frozenset() if tensor is None else self._note([tensor])
        if tensor is not None:
            self._popped.append(tensor)
        self.skips.append((stashed, self._layer[0], keys))
        return tensor


def _profile_run(
    layers: nn.Sequential,
    sample: Any,
    target: Any,
    loss_fn: Callable[..., Tensor] | None,
) -> _Run:
    skip = {storage_key(t) for t in [*layers.parameters(), *layers.buffers()]}
    sizes: dict[int, int] = {}
    saved: list[set[int]] = [set() for _ in layers]
    inputs: list[frozenset[int]] = []
    outputs: list[frozenset[int]] = []
    keep: list[Any] = []  # every tensor stays alive, so no storage key is reused
    current = [0]

    def note(tensors: Iterable[Tensor]) -> frozenset[int]:
        keys = set()
        for t in tensors:
            key = storage_key(t)
            if key not in skip:
                sizes[key] = t.untyped_storage().nbytes()
                keys.add(key)
        return frozenset(keys)

    def pack(t: Tensor) -> Tensor:
        saved[current[0]] |= note([t])
        keep.append(t)
        return t.detach()  # the tensor itself would tie an output to its own graph

    batch = note([*tensors_in(sample), *tensors_in(target)])
    x: Any = sample
    meta = any(t.is_meta for t in tensors_in(sample))
    mode = _FusedAttention() if meta else contextlib.nullcontext()
    skips = _SkipRecorder(current, note)
    with (
        torch.enable_grad(),
        mode,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        use_tracker(skips),
    ):
        for index, layer in enumerate(layers):
            current[0] = index
            inputs.append(note(tensors_in(x)))
            x = layer(x)
            outputs.append(note(tensors_in(x)))
            keep.append(x)
        if loss_fn is not None and target is not None:
            keep.append(loss_fn(x, target))
    keep.append(skips)
    return _Run(
        sizes, [frozenset(s) for s in saved], inputs, outputs, batch, tuple(sorted(skips.skips))
    )


def _rows(batch: Any) -> int:
    return check_payload(batch, "sample")


def _first_rows(batch: Any, rows: int) -> Any:
    """A copy of the first ``rows`` rows, in storage of its own (of any payload: its
    batched leaves cut, the others whole)."""
    total = _rows(batch)

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.size(0) == total:
            return leaf[:rows].clone()
        return leaf

    leaves, spec = flatten(batch)
    return pytree.tree_unflatten([cut(leaf) for leaf in leaves], spec)


@dataclass(frozen=True)
class Profile:
    """Per-layer parameter counts and bytes, and activations measured at two micro-batch
    sizes; ``held`` extrapolates a stage's activations to any micro-batch size."""

    params: tuple[int, ...]
    param_bytes: tuple[int, ...]
    rows: tuple[int, int]
    runs: tuple[_Run, _Run]

    def __len__(self) -> int:
        return len(self.params)

    def _scaled(self, small: Sequence[float], large: Sequence[float], rows: int) -> list[float]:
        r0, r1 = self.rows
        if r0 == r1:
            return [x * rows / r0 for x in small]
        return [x + (y - x) / (r1 - r0) * (rows - r0) for x, y in zip(small, large, strict=True)]

    def held(
        self, start: int, stop: int, rows: int, recomputed: frozenset[int] = frozenset()
    ) -> tuple[float, float, float, float]:
        """Bytes of one micro-batch of ``rows`` on layers [start, stop): its whole graph,
        its input, its output, and the most a ``recomputed`` layer holds again in its
        backward (``_Run.held``)."""
        a, b = self.runs
        graph, inp, out, again = self._scaled(
            a.held(start, stop, recomputed), b.held(start, stop, recomputed), rows
        )
        return graph, inp, out, again

    def skip_bytes(
        self, bounds: Sequence[tuple[int, int]], rows: int
    ) -> dict[tuple[int, int], float]:
        """Per skip route between stages, the bytes of one micro-batch of ``rows`` as its
        destination receives them."""
        a, b = (run.skip_bytes(bounds) for run in self.runs)
        return {route: self._scaled([a[route]], [b[route]], rows)[0] for route in a}

    def repeat(self, layer: int, times: int) -> Profile:
        """The profile of the model with ``layer`` repeated ``times`` times, such as the
        transformer blocks of a deeper model, without running it: each copy holds what the
        original held, and reads what the copy before it returned."""
        if not 0 < layer < len(self) - 1 or times < 1:
            raise ValueError(
                f"cannot repeat layer {layer} of {len(self)} {times} times: only a layer "
                "between the first and the last, at least once"
            )
        if any(len(run.inputs[layer]) != 1 or len(run.outputs[layer]) != 1 for run in self.runs):
            raise ValueError(f"layer {layer} must take one tensor and return one to be repeated")

        def spread(values: tuple[int, ...]) -> tuple[int, ...]:
            return values[:layer] + (values[layer],) * times + values[layer + 1 :]

        small, large = self.runs
        runs = (small.repeat(layer, times), large.repeat(layer, times))
        return Profile(spread(self.params), spread(self.param_bytes), self.rows, runs)

    def batch_bytes(self, start: int, stop: int, rows: int) -> float:
        """Bytes of the mini-batch of ``rows`` that layers [start, stop) read or keep."""
        a, b = self.runs
        return self._scaled([a.batch_bytes(start, stop)], [b.batch_bytes(start, stop)], rows)[0]


def profile(
    layers: nn.Sequential | Iterable[nn.Module],
    sample: Any,
    *,
    target: Any = None,
    loss_fn: Callable[..., Tensor] | None = None,
) -> Profile:
    """Profile ``layers`` on ``sample``, one micro-batch as the first layer takes it, on the
    device of the layers: the meta device (no memory, no compute; attention counted as the
    fused kernel) or a real one. ``target`` and ``loss_fn`` add the loss's saved tensors to
    the last layer. The layers' parameters and gradients are not touched."""
    module = as_sequential(layers)
    rows = _rows(sample)
    if rows < 1:
        raise ValueError("sample must have at least one row")
    half = max(1, rows // 2)

    def run(r: int) -> _Run:
        return _profile_run(
            module,
            _first_rows(sample, r),
            None if target is None else _first_rows(target, r),
            loss_fn,
        )

    runs = (run(half), run(rows))
    params = tuple(sum(p.numel() for p in layer.parameters()) for layer in module)
    param_bytes = tuple(
        sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in module
    )
    return Profile(params, param_bytes, (half, rows), runs)
