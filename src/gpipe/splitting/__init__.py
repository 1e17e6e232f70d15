"""``gpipe.split``: cut any model into pipeline stages, by its own pipeline plan or by
tracing it.

A Hugging Face model that declares a pipeline plan (``base_model_pp_plan``) is cut by it
(``hf_plan``): each stage keeps the model's own modules and runs the model's own code.
Any other model is traced:

``torch.export`` traces the model into one graph (every input dimension dynamic),
``torch.fx``'s ``split_module`` cuts the graph where the named submodules begin, and each
piece becomes a ``SplitStage``: an ``nn.Module`` holding its parameters under the original
names. The stages form a ``SplitModel``, an ``nn.Sequential`` that ``GPipe`` and ``Pipeline``
take as they are, and that runs the whole model when called in one process.
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx._pytree as fx_pytree
from torch import Tensor, fx, nn
from torch.fx.passes.split_module import split_module

from gpipe.parallel.tensor import placed_like
from gpipe.planning.balancing import partition
from gpipe.skip import Namespace
from gpipe.splitting.cuts import (
    CutError,
    assign_stages,
    candidates,
    drop_checks,
    module_starts,
    resolve,
)
from gpipe.splitting.hf_layout import (
    PlanError,
    PlanLayout,
    check_read_plan,
    layout_to_cut_by,
    plan_bounds,
)
from gpipe.splitting.hf_plan import PlanStage
from gpipe.splitting.stages import ATTR, SplitStage, part_module, plan_stages
from gpipe.splitting.tracing import (
    TraceError,
    check_one_row,
    trace,
    without_cache_output,
    without_own_checkpointing,
)

__all__ = ["CutError", "PlanError", "PlanStage", "SplitModel", "SplitStage", "TraceError", "split"]

BALANCES = ("parameters", "time")
PLANS = ("auto", "hf", None)


class SplitModel(nn.Sequential):
    """The stages of a split model, in order, and the map between their names and the
    original model's.

    A stage's parameters carry the original names: ``"1.transformer.h.7.mlp.c_fc.weight"``
    is stage 1's ``transformer.h.7.mlp.c_fc.weight``. A parameter that several stages use
    (a tied embedding and output projection) is held by each of them.
    """

    def __init__(
        self, stages: Sequence[nn.Module], aliases: Mapping[str, Sequence[str]], at: list[str]
    ) -> None:
        super().__init__(*stages)
        self.at = at  # where stages begin, by module name
        # every name of a tensor the original model holds under several, to all of them
        self._names = {alias: list(names) for names in aliases.values() for alias in names}
        # the buffers no state dict holds (a rotary embedding's frequencies): the model's own
        # tensors (None: built on meta), to be put back once a stage is allocated and loaded;
        # allocating a stage gives it new ones and leaves these as they are
        self._unsaved: dict[tuple[int, str], Tensor | None] = {}
        for index, stage in enumerate(stages):
            saved = set(stage.state_dict(keep_vars=True))
            for name, buffer in stage.named_buffers():
                if name not in saved:
                    self._unsaved[(index, name)] = None if buffer.is_meta else buffer.detach()

    def stages(self) -> list[nn.Module]:
        return list(self)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> SplitModel:
        """As ``nn.Module._apply``, keeping a parameter that several stages hold one
        parameter (moving from meta, ``to_empty`` would give each stage its own)."""
        shared: dict[int, list[str]] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            shared.setdefault(id(param), []).append(name)
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        for names in shared.values():
            first = self.get_parameter(names[0])
            for name in names[1:]:
                owner, _, attr = name.rpartition(".")
                setattr(self.get_submodule(owner), attr, first)
        return self

    def original_name(self, name: str) -> str:
        """The original model's name of the split model's parameter or buffer ``name`` (of
        a tensor it holds under several, the first, as ``named_parameters`` gives it)."""
        index, _, rest = name.partition(".")
        if not index.isdigit() or int(index) >= len(self) or not rest:
            raise KeyError(f"{name!r} is not a name of this split model ('<stage>.<name>')")
        stage = self[int(index)]
        if rest not in dict(stage.named_parameters()) and rest not in dict(stage.named_buffers()):
            raise KeyError(f"stage {index} holds no {rest!r}")
        return self._names.get(rest, [rest])[0]  # a shared tensor's first name

    def split_names(self, original: str) -> list[str]:
        """The split model's names for the original model's ``original`` (several where
        stages share it)."""
        names = self._names.get(original, [original])
        found = []
        for index, stage in enumerate(self):
            held = {*dict(stage.named_parameters()), *dict(stage.named_buffers())}
            found += [f"{index}.{name}" for name in names if name in held][:1]
        if not found:
            raise KeyError(f"no stage holds {original!r}")
        return found

    def _held_stages(self, module: nn.Module | None) -> list[tuple[int, nn.Module]]:
        mine = {id(stage): (index, stage) for index, stage in enumerate(self)}
        if module is None:
            return list(mine.values())
        return [mine[id(m)] for m in module.modules() if id(m) in mine]

    def original_state_dict(self, module: nn.Module | None = None) -> dict[str, Tensor]:
        """A state dict with the original model's names (every alias of a tied weight),
        of the stages held by ``module`` (a ``Pipeline`` holds only its own; default: all)."""
        out: dict[str, Tensor] = {}
        for _, stage in self._held_stages(module):
            for name, value in stage.state_dict().items():
                for alias in self._names.get(name, [name]):
                    out.setdefault(alias, value)
        return out

    def load_original_state_dict(
        self, state_dict: Mapping[str, Tensor], module: nn.Module | None = None
    ) -> list[int]:
        """Load the stages held by ``module`` (default: all) from a state dict with the
        original model's names, reading only the keys those stages hold, so that each rank
        of a ``Pipeline`` loads its own stage from a lazily read checkpoint. Returns the
        indices of the stages loaded. The buffers no state dict holds (non-persistent ones,
        such as a rotary embedding's frequencies) are put back from the model that was split,
        unless ``state_dict`` holds them too; one that was on the meta device then
        (a model built under ``torch.device("meta")``) and is not in ``state_dict`` is
        refused: nothing could give it its values."""
        loaded = []
        for index, stage in self._held_stages(module):
            wanted = stage.state_dict(keep_vars=True)
            values = {}
            missing = []
            for name in wanted:
                key = next((a for a in self._names.get(name, [name]) if a in state_dict), None)
                if key is None:
                    missing.append(name)
                else:  # split as this rank holds it, under tensor parallelism
                    values[name] = placed_like(state_dict[key], wanted[name])
            if missing:
                raise KeyError(
                    f"the state dict lacks {len(missing)} of stage {index}'s entries: {missing[:5]}"
                )
            stage.load_state_dict(values, assign=any(t.is_meta for t in wanted.values()))
            self._put_back_unsaved(index, stage, state_dict)
            loaded.append(index)
        return loaded

    def _put_back_unsaved(
        self, index: int, stage: nn.Module, state_dict: Mapping[str, Tensor]
    ) -> None:
        """Give stage ``index``'s buffers that no state dict holds their values: from
        ``state_dict`` if it has them, else from the model that was split."""
        device = next((p.device for p in stage.parameters()), None)
        for name, buffer in list(stage.named_buffers()):
            if (index, name) not in self._unsaved:
                continue
            key = next((a for a in self._names.get(name, [name]) if a in state_dict), None)
            value = state_dict[key] if key is not None else self._unsaved[(index, name)]
            if value is None:
                raise ValueError(
                    f"stage {index}'s buffer {name} is in no state dict and was on the meta "
                    "device when the model was split: build the model with its parameters "
                    "alone on meta (accelerate.init_empty_weights()), or give the buffer in "
                    "the state dict"
                )
            owner_name, _, attr = name.rpartition(".")
            owner = stage.get_submodule(owner_name) if owner_name else stage
            if buffer.is_meta:
                place = device if device is not None and device.type != "meta" else "cpu"
                owner.register_buffer(attr, value.detach().to(place).clone(), persistent=False)
            else:
                with torch.no_grad():
                    buffer.copy_(value)


def _canonical_names(model: nn.Module) -> tuple[dict[int, str], dict[str, list[str]], set[str]]:
    """For every tensor of ``model``: its first name, every name it has, and which names
    the state dict holds."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        canonical = first.setdefault(id(tensor), name)
        aliases.setdefault(canonical, []).append(name)
    return first, aliases, set(model.state_dict(keep_vars=True))


def _fetch(module: nn.Module, target: str) -> Tensor:
    owner_name, _, attr = target.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    return getattr(owner, attr)


def _device_of(model: nn.Module) -> torch.device:
    tensor = next(iter([*model.parameters(), *model.buffers()]), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _cut(
    model: nn.Module,
    traced: fx.GraphModule,
    at: list[str],
    spec: tuple[Any, ...],
    names: tuple[dict[int, str], dict[str, list[str]], set[str]],
) -> SplitModel:
    """Cut ``traced`` at the modules ``at`` into a SplitModel."""
    in_spec, out_spec, arg_names, example_inputs = spec
    cuts = resolve(model, traced.graph, at)
    starts = [position for _, position in cuts]
    stage_of = assign_stages(traced.graph, starts)
    root = split_module(
        traced,
        traced,  # root_m: unused by torch
        lambda node: stage_of[node],
        keep_original_order=True,
        keep_original_node_name=True,
    )
    calls = [n for n in root.graph.nodes if n.op == "call_module"]
    if len(calls) != len(starts) + 1:
        raise CutError(
            f"the split points {at} leave {len(starts) + 1 - len(calls)} stage(s) with nothing "
            "to compute"
        )
    plans = plan_stages(root, traced, in_spec, out_spec, arg_names, example_inputs)
    first, aliases, persistent = names
    namespace = Namespace()
    device = _device_of(model)
    held: list[dict[str, tuple[Tensor, bool]]] = []
    for index, plan in enumerate(plans):
        attrs: dict[str, tuple[Tensor, bool]] = {}
        args = []
        for source, ref in plan.args:
            if source != ATTR:
                args.append((source, ref))
                continue
            tensor = _fetch(traced, ref)
            name = first.get(id(tensor), ref)
            attrs[name] = (tensor, name in persistent)
            args.append((ATTR, name))
        plans[index] = replace(plan, args=tuple(args))
        held.append(attrs)
    _place_unused(model, traced.graph, starts, held, first)
    stages = [
        SplitStage(plan, part_module(root, call), attrs, namespace, device, model.training)
        for plan, call, attrs in zip(plans, calls, held, strict=True)
    ]
    return SplitModel(stages, aliases, [name for name, _ in cuts])


def _place_unused(
    model: nn.Module,
    graph: fx.Graph,
    starts: Sequence[int],
    held: list[dict[str, tuple[Tensor, bool]]],
    first: Mapping[int, str],
) -> None:
    """Give the state the traced graph never reads (a BatchNorm's batch count traced in eval
    mode, an unused layer) to the stage where its module runs, else the first, so that the
    stages' state dicts together are the model's."""
    taken = {name for attrs in held for name in attrs}
    begins = module_starts(graph)
    for name, tensor in model.state_dict(keep_vars=True).items():
        canonical = first.get(id(tensor), name)
        if canonical in taken:
            continue
        owner = canonical.rpartition(".")[0]
        position = begins.get(owner, 0)
        stage = sum(1 for start in starts if start <= position)
        held[stage][canonical] = (tensor, True)
        taken.add(canonical)


def _stage_costs(
    fine: SplitModel, balance: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> list[float]:
    """Each fine stage's cost: its parameters' elements, or its measured forward time."""
    if balance == "parameters":
        costs = []
        for stage in fine:
            costs.append(float(sum(p.numel() for p in stage.parameters())))
        return costs
    first = next(iter(fine.parameters()), None)
    if first is not None and first.is_meta:
        raise ValueError("balance='time' runs the model: split a model that is not on meta")
    inputs = dict(kwargs) if kwargs else (args[0] if len(args) == 1 else tuple(args))
    if kwargs and args:
        raise ValueError("balance='time' takes examples given all as args or all as kwargs")
    times: list[list[float]] = [[] for _ in fine]
    starts: dict[int, float] = {}

    def before(index: int) -> Any:
        def hook(*_: Any) -> None:
            starts[index] = time.perf_counter()

        return hook

    def after(index: int) -> Any:
        def hook(*_: Any) -> None:
            times[index].append(time.perf_counter() - starts[index])

        return hook

    handles = []
    for index, stage in enumerate(fine):
        handles.append(stage.register_forward_pre_hook(before(index)))
        handles.append(stage.register_forward_hook(after(index)))
    try:
        with torch.no_grad():
            for _ in range(4):
                fine(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return [statistics.median(t[1:]) for t in times]


def split(
    model: nn.Module,
    example_args: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    at: Iterable[str] | None = None,
    parts: int | None = None,
    balance: str = "parameters",
    check: bool = True,
    plan: str | None = "auto",
) -> SplitModel:
    """Cut ``model`` into pipeline stages: by its own pipeline plan, or by tracing it on the
    example inputs.

    Args:
        model: any ``nn.Module`` that ``torch.export`` can trace, or a Hugging Face causal LM
            that declares a pipeline plan; on a device or on meta.
        example_args: positional inputs as ``model(*example_args, **example_kwargs)`` takes
            them (a lone tensor is taken as one argument), at least 2 rows. A model cut by
            its plan needs none (``balance="time"`` runs it on them where given).
        example_kwargs: keyword inputs, the same way.
        at: qualified names of submodules where stages begin (``["layers.4", "layers.8"]``
            gives three stages; by plan, decoder layers such as ``"model.layers.4"``).
        parts: instead of ``at``, the number of stages, cut between the model's blocks (the
            children of its ``ModuleList`` and ``Sequential`` containers; by plan, its
            decoder layers) where the ``balance`` is most even: ``"parameters"`` (their
            count) or ``"time"`` (the measured forward time on the examples).
        check: make sure the traced graph computes what the model does for a 1-row input
            (a model that branches on a size being 1 would not), or that the stages of a
            plan read from the model's modules compute what it does; skipped on meta.
        plan: ``"hf"`` cuts a Hugging Face causal LM by its ``base_model_pp_plan``, or by
            the same layout read from its base model's children where it declares none (each
            stage keeps the model's own modules, attention implementation and cache
            classes); ``None`` traces; ``"auto"`` (default) uses the plan where the model
            declares one and traces otherwise, or, given no examples to trace on, reads it.

    The first stage takes what the model takes: a tensor, a tuple of positional arguments,
    or a dict of arguments by name; the last returns what the model returns. A Hugging Face
    model is traced with its config's ``use_cache`` off (its cache is no tensor to return)
    and its own activation checkpointing off (a traced stage keeps none; the pipeline's
    ``checkpoint=`` re-materializes stages); cut by its plan, its layers keep theirs.
    """
    at = _checked_arguments(model, at, parts, balance, plan)
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    kwargs = dict(example_kwargs or {})
    layout = layout_to_cut_by(model, plan, examples=bool(args or kwargs))
    if layout is not None:
        return _split_by_plan(
            model, layout, args, kwargs, at=at, parts=parts, balance=balance, check=check
        )
    if not args and not kwargs:
        raise ValueError(
            f"split traces {type(model).__name__} on example inputs, and none were given "
            "(only a Hugging Face causal LM is cut without them, by its pipeline plan)"
        )
    with without_cache_output(model, kwargs), without_own_checkpointing(model):
        return _split_by_tracing(
            model, args, kwargs, at=at, parts=parts, balance=balance, check=check
        )


def _checked_arguments(
    model: Any, at: Any, parts: Any, balance: Any, plan: Any
) -> list[str] | None:
    """``split``'s arguments refused in one line each; ``at`` as a list."""
    if (at is None) == (parts is None):
        raise ValueError("split needs either at=[module names] or parts=K, not both or neither")
    if parts is not None and (isinstance(parts, bool) or not isinstance(parts, int) or parts < 1):
        raise ValueError(f"parts must be a positive integer, got {parts!r}")
    if at is not None:
        names = [] if isinstance(at, str) else list(at)
        if isinstance(at, str) or not all(isinstance(name, str) for name in names):
            raise TypeError(f"at must be a list of submodule names, got {at!r}")
        at = names
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {list(BALANCES)}, got {balance!r}")
    if plan not in PLANS:
        raise ValueError(f"plan must be 'hf', None or 'auto', got {plan!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return at


def _split_by_plan(
    model: nn.Module,
    layout: PlanLayout,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    at: list[str] | None,
    parts: int | None,
    balance: str,
    check: bool,
) -> SplitModel:
    """``split`` by the model's pipeline plan."""
    example = dict(kwargs)
    if args:
        example.update(inspect.signature(model.forward).bind_partial(*args).arguments)
    if not example and balance == "time":
        vocab = int(getattr(model.config, "vocab_size", 2))
        example = {"input_ids": torch.randint(vocab, (2, 16), device=_device_of(model))}
    bounds = plan_bounds(model, layout, at=at, parts=parts, balance=balance, example=example)
    stages = [PlanStage(model, layout, index, bounds) for index in range(len(bounds) - 1)]
    if layout.read and check:
        check_read_plan(model, stages)
    for stage in stages:
        stage.train(model.training)
    _, aliases, _ = _canonical_names(model)
    return SplitModel(stages, aliases, [layout.layer_name(b) for b in bounds[1:-1]])


def _split_by_tracing(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    at: list[str] | None,
    parts: int | None,
    balance: str,
    check: bool,
) -> SplitModel:
    """``split`` by tracing the model on its examples."""
    exported = trace(model, args, kwargs)
    traced = exported.module()
    drop_checks(traced.graph)
    traced.recompile()
    meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    if check and not meta:
        check_one_row(model, traced, args, kwargs)
    in_spec, out_spec = exported.call_spec.in_spec, exported.call_spec.out_spec
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    arg_names = list(bound.arguments)[: len(args)]
    example_inputs = fx_pytree.tree_flatten_spec((args, kwargs), in_spec)
    spec = (in_spec, out_spec, arg_names, example_inputs)
    canonical = _canonical_names(model)
    if parts is not None:
        options = candidates(model, traced.graph)
        if parts - 1 > len(options):
            raise CutError(
                f"parts={parts} but {type(model).__name__} has {len(options)} places to cut "
                f"between its blocks, so at most {len(options) + 1} parts; pass at= to cut "
                "elsewhere"
            )
        if parts == 1:
            at = []
        else:
            fine = _cut(model, traced, options, spec, canonical)
            costs = _stage_costs(fine, balance, args, kwargs)
            counts = partition(costs, parts)
            positions = [sum(counts[:i]) for i in range(1, parts)]
            at = [options[p - 1] for p in positions]
    return _cut(model, traced, list(at or []), spec, canonical)
