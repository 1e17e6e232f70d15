"""What fits: peak memory per stage, predicted before a run and measured during one.

A stage's memory is its parameters, their gradients and the optimizer's state, plus the
activations it holds for backward. The activations come from a profile: one forward of a small
micro-batch records every storage autograd saves, and each layer's input and output, so the
bytes a stage holds for one micro-batch are known exactly for any cut, then scaled to the real
micro-batch size (the profile runs at two sizes to find what grows with the rows and what
does not). The schedule and the re-materialization mode say how many micro-batches a stage
holds at once, and which of them keep only their input: ``plan`` walks each process's program
in order and takes the peak.

``ActivationMeter`` measures the same thing in a run: the live bytes of tensors saved for
backward and of every layer's inputs and outputs, parameters left out.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from gpipe.comm.payload import flatten, tensors_of
from gpipe.runtime.microbatch import check_payload, split_sizes
from gpipe.runtime.partitions import as_sequential, check_balance, stage_bounds
from gpipe.runtime.recompute import Layers, check_checkpoint, recomputed_layers, should_checkpoint
from gpipe.schedules import Kind, Schedule, add_recompute, get_schedule
from gpipe.skip.tracker import observe, use_tracker

__all__ = [
    "OPTIMIZER_STATES",
    "ActivationMeter",
    "MemoryPlan",
    "Profile",
    "StagePlan",
    "plan",
    "profile",
]

# Tensors of optimizer state per parameter, each the parameter's size and dtype.
OPTIMIZER_STATES = {
    "sgd": 0,
    "momentum": 1,  # SGD with momentum: the momentum buffer
    "adagrad": 1,  # the sum of squares
    "rmsprop": 1,  # the running mean of squares (no momentum, not centered)
    "adam": 2,  # first and second moments
    "adamw": 2,
}


def _key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(value: Any) -> list[Tensor]:
    if value is None:
        return []
    return list(tensors_of(value))


class _FusedAttention(TorchFunctionMode):
    """On the meta device, attention as the CPU runs it: the fused kernel where the CPU would
    choose it (it keeps inputs, output and log-sum-exp), the unfused formula with its T x T
    weights otherwise (with dropout, for one). Meta tensors alone always take the latter."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
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
                if fused == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
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

    def save(self, key: Any, tensor: Tensor | None) -> None:
        self._tensors[key] = (self._layer[0], tensor)

    def load(self, key: Any) -> Tensor | None:
        if key not in self._tensors:
            raise RuntimeError(f"skip {key[1]!r} was popped before it was stashed")
        stashed, tensor = self._tensors.pop(key)
        keys = frozenset() if tensor is None else self._note([tensor])
        self.skips.append((stashed, self._layer[0], keys))
        return tensor


def _profile_run(
    layers: nn.Sequential,
    sample: Any,
    target: Any,
    loss_fn: Callable[..., Tensor] | None,
) -> _Run:
    skip = {_key(t) for t in [*layers.parameters(), *layers.buffers()]}
    sizes: dict[int, int] = {}
    saved: list[set[int]] = [set() for _ in layers]
    inputs: list[frozenset[int]] = []
    outputs: list[frozenset[int]] = []
    keep: list[Any] = []  # every tensor stays alive, so no storage key is reused
    current = [0]

    def note(tensors: Iterable[Tensor]) -> frozenset[int]:
        keys = set()
        for t in tensors:
            key = _key(t)
            if key not in skip:
                sizes[key] = t.untyped_storage().nbytes()
                keys.add(key)
        return frozenset(keys)

    def pack(t: Tensor) -> Tensor:
        saved[current[0]] |= note([t])
        keep.append(t)
        return t.detach()  # the tensor itself would tie an output to its own graph

    batch = note([*_tensors(sample), *_tensors(target)])
    x: Any = sample
    meta = any(t.is_meta for t in _tensors(sample))
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
            inputs.append(note(_tensors(x)))
            x = layer(x)
            outputs.append(note(_tensors(x)))
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

        runs = tuple(run.repeat(layer, times) for run in self.runs)
        return Profile(spread(self.params), spread(self.param_bytes), self.rows, runs)  # type: ignore[arg-type]

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
    runs = tuple(
        _profile_run(
            module,
            _first_rows(sample, r),
            None if target is None else _first_rows(target, r),
            loss_fn,
        )
        for r in (half, rows)
    )
    params = tuple(sum(p.numel() for p in layer.parameters()) for layer in module)
    param_bytes = tuple(
        sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in module
    )
    return Profile(params, param_bytes, (half, rows), runs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class StagePlan:
    """Predicted peak bytes of one process (its stages together)."""

    rank: int
    stages: tuple[int, ...]
    layers: int
    params: int
    param_bytes: float  # the parameters themselves
    state_bytes: float  # their gradients and the optimizer's state
    activation_bytes: float  # peak of what is held for backward
    peak_live: int  # most micro-batches held at once
    # with replicas: the gradients' copies in the all-reduce buckets, live from the last
    # backward (buckets start during it) to the step's end, beside at most the graph of the
    # one micro-batch still being backpropagated (``last_graph_bytes``)
    allreduce_bytes: float = 0.0
    last_graph_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        during = max(self.activation_bytes, self.allreduce_bytes + self.last_graph_bytes)
        return self.param_bytes + self.state_bytes + during


@dataclass(frozen=True)
class MemoryPlan:
    balance: tuple[int, ...]
    schedule: str
    checkpoint: str
    chunks: int
    optimizer: str
    ranks: tuple[StagePlan, ...]

    @property
    def peak_bytes(self) -> float:
        return max(r.total_bytes for r in self.ranks)

    def fits(self, device_bytes: float) -> bool:
        return self.peak_bytes <= device_bytes


def _schedule(name: str, n_stages: int, n_ranks: int, chunks: int) -> Schedule:
    make = get_schedule(name)
    if n_stages == n_ranks:
        return make(n_stages, chunks)
    return make(n_stages, chunks, n_ranks)  # type: ignore[call-arg]


@dataclass(frozen=True)
class _Held:
    """What one stage holds for one micro-batch (bytes): its graph, its input, its output;
    skip tensors received and kept while its graph is (``skip_in``: those copied from
    another process) or while only its input is (``skip_in_ckpt``: also those of a stage of
    this process, whose graph no longer holds them)."""

    graph: float
    inp: float
    out: float
    skip_in: float
    skip_in_ckpt: float
    again: float = 0.0  # a layer recomputed inside the backward (``Layers``), at most


def _activation_peak(
    program: Sequence[Any],
    split: bool,
    held: dict[int, list[_Held]],
    checkpointed: Callable[[int], bool],
) -> tuple[float, int]:
    """Walk one process's program: the most activation bytes and micro-batches it holds.

    A micro-batch holds its whole graph from F to B (to W with a split backward), or only
    its input if it is recomputed, and then the whole graph again from its R. What is sent
    to another process is freed as its send completes, which the receiver's buffer, posted
    ahead, makes prompt: it is counted as freed at once.
    """
    now = peak = 0.0
    live = most = 0
    for a in program:
        if not a.is_compute:
            continue
        h = held[a.stage][a.microbatch]
        ckpt = checkpointed(a.microbatch)
        inp = h.inp + h.skip_in_ckpt if ckpt else 0.0  # what a recomputed micro-batch keeps
        if a.kind is Kind.FORWARD:
            live += 1
            most = max(most, live)
            if ckpt:
                now += inp
                peak = max(peak, now + h.out)  # the output, until it is sent
            else:
                now += h.graph + h.skip_in
                peak = max(peak, now)
        elif a.kind is Kind.RECOMPUTE:  # the graph again, its input shared
            now += h.graph - h.inp
            peak = max(peak, now)
        elif a.kind is Kind.BACKWARD:
            peak = max(peak, now + h.again)
            if not split:
                live -= 1
                now -= h.graph + (h.skip_in_ckpt if ckpt else h.skip_in)
        else:  # W: the end of a split backward
            peak = max(peak, now + h.again)
            live -= 1
            now -= h.graph + (h.skip_in_ckpt if ckpt else h.skip_in)
    return peak, most


class _LayerNames(nn.Sequential):
    """Stand-ins for a model's layers, for a ``Layers(every=k)`` policy to pick from."""

    def __init__(self, n: int) -> None:
        super().__init__(*[nn.Identity() for _ in range(n)])


def plan(
    prof: Profile,
    balance: Sequence[int],
    *,
    batch_size: int,
    chunks: int,
    schedule: str = "gpipe",
    checkpoint: str | Layers = "except_last",
    optimizer: str = "adam",
    n_ranks: int | None = None,
    layers: nn.Sequential | None = None,
    data_parallel: int = 1,
) -> MemoryPlan:
    """Predicted peak memory of every process for a mini-batch of ``batch_size`` rows cut
    into ``chunks`` micro-batches. ``n_ranks`` below ``len(balance)`` puts several stages on
    each process (the interleaved schedule). A ``Layers(select=...)`` policy needs the
    model's ``layers`` to apply its predicate to. With ``data_parallel`` replicas,
    ``batch_size`` is the global mini-batch (each replica takes its share, the largest
    counted) and each process also holds its gradients' copies in the all-reduce buckets."""
    balance = check_balance(len(prof), list(balance))
    checkpoint = check_checkpoint(checkpoint)
    if isinstance(checkpoint, Layers) and checkpoint.select is not None and layers is None:
        raise ValueError("plan(checkpoint=Layers(select=...)) needs layers= to pick from")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be a positive integer, got {data_parallel!r}")
    if batch_size < data_parallel:
        raise ValueError(
            f"batch_size {batch_size} cannot give each of {data_parallel} replicas a row"
        )
    n_stages = len(balance)
    n_ranks = n_stages if n_ranks is None else n_ranks
    batch_size = split_sizes(batch_size, data_parallel)[0]  # the largest replica's share
    sizes = split_sizes(batch_size, chunks)
    recomputed = frozenset(
        i for i in range(len(sizes)) if should_checkpoint(checkpoint, i, len(sizes))
    )
    sched = add_recompute(_schedule(schedule, n_stages, n_ranks, len(sizes)), recomputed)
    bounds = stage_bounds(balance)
    rank_of = sched.stage_to_rank
    held: dict[int, list[_Held]] = {s: [] for s in range(n_stages)}
    picks = recomputed_layers(
        checkpoint, _LayerNames(len(prof)) if layers is None else as_sequential(layers), balance
    )
    for rows in sizes:
        routes = prof.skip_bytes(bounds, rows)
        for s, (start, stop) in enumerate(bounds):
            picked = frozenset(start + position for position in picks[s])
            graph, inp, out, again = prof.held(start, stop, rows, picked)
            remote_in = sum(
                n for (a, b), n in routes.items() if b == s and rank_of[a] != rank_of[s]
            )
            local_in = sum(n for (a, b), n in routes.items() if b == s and rank_of[a] == rank_of[s])
            held[s].append(_Held(graph, inp, out, remote_in, remote_in + local_in, again))
    states = 1 + OPTIMIZER_STATES[optimizer]  # gradient + optimizer state
    ranks = []
    for rank in range(n_ranks):
        stages = tuple(s for s in range(n_stages) if sched.stage_to_rank[s] == rank)
        layers = [i for s in stages for i in range(*bounds[s])]
        weights = sum(prof.param_bytes[i] for i in layers)
        peak, live = _activation_peak(
            sched.programs[rank],
            sched.split_backward,
            held,
            recomputed.__contains__,
        )
        peak += sum(prof.batch_bytes(*bounds[s], batch_size) for s in stages)
        replicated = data_parallel > 1
        ranks.append(
            StagePlan(
                rank=rank,
                stages=stages,
                layers=len(layers),
                params=sum(prof.params[i] for i in layers),
                param_bytes=weights,
                state_bytes=weights * states,
                activation_bytes=peak,
                peak_live=live,
                allreduce_bytes=weights if replicated else 0.0,  # gradients: the weights' size
                last_graph_bytes=max((h.graph for s in stages for h in held[s]), default=0.0)
                if replicated
                else 0.0,
            )
        )
    return MemoryPlan(tuple(balance), schedule, checkpoint, chunks, optimizer, tuple(ranks))


class ActivationMeter:
    """Peak live bytes of activations in a run: tensors autograd saves for backward, the
    inputs and outputs of ``module``'s layers and the tensors its skippable layers stash and
    pop, each storage once, parameters and buffers left out. ``with meter: ...`` watches a
    region; ``peak`` and ``saved_peak`` (saved tensors alone) hold the largest values seen.

    What the layers save is seen on whichever thread runs them (saved-tensor hooks are
    per thread, so each layer call installs them for itself); what is saved outside the
    layers, a loss for one, only on the thread that entered the meter."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._skip = {_key(t) for t in [*module.parameters(), *module.buffers()]}
        self._live: dict[int, tuple[StorageWeakRef, int, bool]] = {}
        self.peak = 0
        self.saved_peak = 0
        self._stack = contextlib.ExitStack()

    def _track(self, tensors: Iterable[Tensor], saved: bool) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._skip or t.is_meta:
                continue
            known = self._live.get(key)
            if known is None or known[0].expired():
                self._live[key] = (StorageWeakRef(storage), storage.nbytes(), saved)
            elif saved and not known[2]:
                self._live[key] = (known[0], known[1], True)
        self._sample()

    def _sample(self) -> None:
        total = saved = 0
        for key, (ref, nbytes, was_saved) in list(self._live.items()):
            if ref.expired():
                self._live.pop(key, None)  # another thread may have dropped it already
                continue
            total += nbytes
            saved += nbytes if was_saved else 0
        self.peak = max(self.peak, total)
        self.saved_peak = max(self.saved_peak, saved)

    def __enter__(self) -> ActivationMeter:
        def pack(t: Tensor) -> Tensor:
            self._track([t], saved=True)
            return t.detach()  # the tensor itself would tie an output to its own graph

        local = threading.local()

        def enter(layer: nn.Module, args: Any) -> None:
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            hooks.__enter__()
            local.__dict__.setdefault("hooks", []).append(hooks)

        def leave(layer: nn.Module, args: Any, output: Any) -> None:
            local.hooks.pop().__exit__(None, None, None)

        def after(layer: nn.Module, args: Any, output: Any) -> None:
            self._track([*_tensors(args), *_tensors(output)], saved=False)

        stack = self._stack
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        stack.enter_context(observe(lambda t: self._track([t], saved=False)))  # skip tensors
        for layer in self._module.children():
            stack.callback(layer.register_forward_pre_hook(enter).remove)
            stack.callback(layer.register_forward_hook(leave, always_call=True).remove)
            stack.callback(layer.register_forward_hook(after).remove)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._stack = contextlib.ExitStack()
