"""Where a Hugging Face causal LM's pipeline plan lies in the model, and where to cut it.

A model class that declares a plan (``config.base_model_pp_plan``) names, in order, the
modules of its base model that a pipeline runs: the embedding (and maybe a dropout), the list
of decoder layers, the final norm. ``plan_layout`` finds them in the model and checks that
every parameter lies in one of them or in the output head; ``plan_bounds`` chooses the
decoder layers where stages begin (named, or balanced by parameters or measured time);
``layout_to_cut_by`` is ``split``'s choice between a plan and tracing.

A causal LM whose config declares no plan (GPT-2, BLOOM, MPT, StableLM ...) has its plan read
from its base model's children: its one list of decoder layers, the children with
parameters registered before it (the embeddings) and after it (the final norm). Registration
order is no promise of the model's code, so where the weights are real the model runs once to
show that it calls them in that order, each decoder layer once, and ``check_read_plan`` runs
the stages against the model; on meta nothing runs, and nothing is checked.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.planning.balancing import partition

__all__ = [
    "PlanError",
    "PlanLayout",
    "check_read_plan",
    "declares_plan",
    "layer_list",
    "layout_to_cut_by",
    "plan_bounds",
    "plan_layout",
    "same_to_rounding",
]


class PlanError(ValueError):
    """A model that cannot be cut by its pipeline plan, with what to do instead."""


def declares_plan(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model whose config declares a pipeline plan."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    return isinstance(plan, Mapping) and len(plan) > 0


@dataclass(frozen=True)
class PlanLayout:
    """Where the plan's parts lie in a model: names are the model's own."""

    base: str  # the base model's name in the causal LM ("model", "transformer" ...)
    before: tuple[str, ...]  # the plan's modules before the layers (embedding, dropout)
    layers: str  # the list of decoder layers
    after: tuple[str, ...]  # the plan's modules after the layers (the final norm)
    head: str  # the output head, in the causal LM
    n_layers: int
    # what a decoder layer returns: its hidden states, or (in older model code) a tuple of
    # them first, which the model's loop indexes
    layers_return_tuples: bool = False
    read: bool = False  # read from the base model's children: the model declares no plan

    def layer_name(self, index: int) -> str:
        return f"{self.base}.{self.layers}.{index}"


def _child_name(parent: nn.Module, child: nn.Module) -> str | None:
    return next((name for name, m in parent.named_children() if m is child), None)


def plan_layout(model: nn.Module) -> PlanLayout:
    """The layout of ``model``'s plan, checked: one list of decoder layers, a base model and
    an output head; every parameter of the model inside one of them."""
    name = type(model).__name__
    base = getattr(model, "base_model", None)
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    base_name = _child_name(model, base) if isinstance(base, nn.Module) else None
    head_name = _child_name(model, head) if isinstance(head, nn.Module) else None
    if base_name is None or head_name is None:
        raise PlanError(
            f"{name} is not a causal LM with a base model and an output head; give the "
            "model with its head (AutoModelForCausalLM), or pass plan=None to trace it"
        )
    assert isinstance(base, nn.Module)
    config: Any = getattr(model, "config", None)
    declared = declares_plan(model)
    if declared:
        plan, tuples = list(config.base_model_pp_plan), False
    else:
        plan, tuples = _read_plan(model, base)
    missing = [entry for entry in plan if not isinstance(getattr(base, entry, None), nn.Module)]
    lists = [entry for entry in plan if isinstance(getattr(base, entry, None), nn.ModuleList)]
    if missing or len(lists) != 1:
        raise PlanError(
            f"{name}'s pipeline plan {plan} does not match its modules (missing: {missing}, "
            f"layer lists: {lists}); pass plan=None to trace it"
        )
    at = plan.index(lists[0])
    layout = PlanLayout(
        base=base_name,
        before=tuple(plan[:at]),
        layers=lists[0],
        after=tuple(plan[at + 1 :]),
        head=head_name,
        n_layers=len(getattr(base, lists[0])),
        layers_return_tuples=tuples,
        read=not declared,
    )
    outside = _parameters_outside(model, layout)
    if outside:
        raise PlanError(
            f"{name} holds parameters outside its pipeline plan ({', '.join(outside[:3])}); "
            "pass plan=None to cut it by tracing"
        )
    return layout


def layout_to_cut_by(model: nn.Module, plan: str | None, examples: bool) -> PlanLayout | None:
    """The layout ``split`` cuts ``model`` by, or None where it traces: under ``"hf"`` the
    model's plan, declared or read, or its refusal; under ``"auto"`` a declared plan that fits
    (one that does not is traced), and, given no examples to trace on, a Hugging Face model's
    plan, read where it declares none."""
    declared = declares_plan(model)
    without_examples = not examples and getattr(model, "config", None) is not None
    if plan is None or (plan == "auto" and not declared and not without_examples):
        return None
    try:
        return plan_layout(model)
    except PlanError as exc:
        if plan == "hf" or (not examples and declared):
            raise
        if examples:
            return None  # a declared plan that does not fit the model: traced
        raise ValueError(
            f"split traces {type(model).__name__} on example inputs, and none were given "
            f"(without them a Hugging Face causal LM is cut by its pipeline plan, and: {exc})"
        ) from None


def _read_plan(model: nn.Module, base: nn.Module) -> tuple[list[str], bool]:
    """The plan of a model that declares none, read from its base model's children: the one
    list of decoder layers, with the children that hold parameters registered before and
    after it, checked by running the model where its weights are real; and whether its
    layers return tuples (seen in that run; on meta, unless their ``forward`` is annotated
    to return a tensor)."""
    children = list(base.named_children())
    lists = [(i, c) for i, (_, c) in enumerate(children) if isinstance(c, nn.ModuleList)]
    if len(lists) != 1 or len(lists[0][1]) == 0:
        found = [children[i][0] for i, _ in lists]
        raise PlanError(
            f"{type(model).__name__} declares no pipeline plan (config.base_model_pp_plan), "
            f"and its base model's children hold {len(found)} lists of layers ({found}), not "
            "one to cut between; pass plan=None to cut it by tracing"
        )
    at, layers = lists[0]

    def held(entries: Sequence[tuple[str, nn.Module]]) -> list[str]:
        return [name for name, child in entries if any(True for _ in child.parameters())]

    plan = [*held(children[:at]), children[at][0], *held(children[at + 1 :])]
    tuples = _run_in_order(model, base, plan, children[at][0])
    if tuples is None:  # on meta
        returns = inspect.signature(type(layers[0]).forward).return_annotation
        tuples = returns not in (Tensor, "Tensor", "torch.Tensor")
    return plan, tuples


def _run_in_order(
    model: nn.Module, base: nn.Module, plan: Sequence[str], layers_name: str
) -> bool | None:
    """Run ``model`` once on two tokens and refuse a read plan that the model does not run in
    order: the children before and after the layers as registered (not a norm registered
    before the layers but run after them), and each decoder layer once, in turn (not layers
    run again in loops). Returns whether a decoder layer returned a tuple; None on meta,
    where nothing runs."""
    if any(p.is_meta for p in model.parameters()):
        return None
    layers = base.get_submodule(layers_name)
    assert isinstance(layers, nn.ModuleList)  # _read_plan found it so
    ran: list[str] = []
    returned: list[Any] = []
    handles = []
    for entry in plan:
        module = base.get_submodule(entry)
        if entry == layers_name:
            for index, layer in enumerate(layers):
                name = f"{entry}.{index}"
                handles.append(layer.register_forward_pre_hook(lambda *_, n=name: ran.append(n)))
                handles.append(layer.register_forward_hook(lambda *a: returned.append(a[-1])))
        else:
            handles.append(module.register_forward_pre_hook(lambda *_, n=entry: ran.append(n)))
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            model(input_ids=torch.ones(1, 2, dtype=torch.long, device=device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    at = plan.index(layers_name)
    in_turn = [f"{layers_name}.{i}" for i in range(len(layers))]
    expected = [*plan[:at], *in_turn, *plan[at + 1 :]]
    once = [n for i, n in enumerate(ran) if n not in ran[:i]]  # an embedding may run twice
    if once != expected or [n for n in ran if n in in_turn] != in_turn:
        raise PlanError(
            f"{type(model).__name__} declares no pipeline plan, and its base model does not "
            f"run the modules read as one ({expected}) once each in that order (it ran "
            f"{ran}); pass plan=None to cut it by tracing"
        )
    return isinstance(returned[0], tuple)


def check_read_plan(model: nn.Module, stages: Sequence[nn.Module]) -> None:
    """Refuse stages cut by a plan read from ``model``'s modules (``PlanLayout.read``) that
    do not compute what the model does on two rows of four tokens (a layer that takes more
    from the embeddings than the hidden states). Skipped on meta, where nothing runs."""
    if any(p.is_meta for p in model.parameters()):
        return
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 2))
    device = next(model.parameters()).device
    ids = (torch.arange(8, device=device) % vocab).reshape(2, 4)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(input_ids=ids, use_cache=False).logits
            x: Any = ids
            for stage in stages:
                stage.eval()
                x = stage(x)
            got = x.logits
    except Exception as exc:  # the stages do not run as the model does
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PlanError(
            f"{type(model).__name__} declares no pipeline plan, and the stages of the one "
            f"read from its modules fail where the model runs ({first}); pass plan=None to "
            "cut it by tracing"
        ) from exc
    finally:
        model.train(was_training)
        for stage in stages:
            stage.train(was_training)
    if not same_to_rounding(got, expected):
        raise PlanError(
            f"{type(model).__name__} declares no pipeline plan, and the stages of the one "
            "read from its modules do not compute what the model does; pass plan=None to cut "
            "it by tracing"
        )


def _parameters_outside(model: nn.Module, layout: PlanLayout) -> list[str]:
    inside = [f"{layout.base}.{entry}" for entry in (*layout.before, layout.layers)]
    inside += [f"{layout.base}.{entry}" for entry in layout.after] + [layout.head]
    return [
        name
        for name, _ in model.named_parameters()
        if not any(name == p or name.startswith(p + ".") for p in inside)
    ]


def layer_list(base: nn.Module, layout: PlanLayout) -> nn.ModuleList:
    """The base model's list of decoder layers."""
    layers = base.get_submodule(layout.layers)
    assert isinstance(layers, nn.ModuleList)  # plan_layout found it so
    return layers


def layer_costs(model: nn.Module, layout: PlanLayout, balance: str, example: Any) -> list[float]:
    """Each decoder layer's cost, the first's with the modules before the layers and the
    last's with those after and the head: parameter count, or measured forward time."""
    base = model.get_submodule(layout.base)
    layers = list(layer_list(base, layout))
    before = [base.get_submodule(e) for e in layout.before]
    after = [base.get_submodule(e) for e in layout.after] + [model.get_submodule(layout.head)]
    if balance == "parameters":

        def size(modules: Sequence[nn.Module]) -> float:
            return float(sum(p.numel() for m in modules for p in m.parameters()))

        costs = [size([layer]) for layer in layers]
        costs[0] += size(before)
        costs[-1] += size(after)
        return costs
    groups = [before, *[[layer] for layer in layers], after]
    times = _measured(model, groups, example)
    costs = times[1:-1]
    costs[0] += times[0]
    costs[-1] += times[-1]
    return costs


def _measured(model: nn.Module, groups: Sequence[Sequence[nn.Module]], example: Any) -> list[float]:
    """Each group of modules' forward time per run of ``model``, over three runs after one
    to warm up."""
    if any(p.is_meta for p in model.parameters()):
        raise PlanError("balance='time' runs the model: split a model that is not on meta")
    totals = [0.0] * len(groups)
    began: dict[int, float] = {}
    handles = []
    for index, group in enumerate(groups):
        for module in group:

            def before(*_: Any, key: int = id(module)) -> None:
                began[key] = time.perf_counter()

            def after(*_: Any, key: int = id(module), into: int = index) -> None:
                totals[into] += time.perf_counter() - began[key]

            handles.append(module.register_forward_pre_hook(before))
            handles.append(module.register_forward_hook(after))
    runs = 3
    try:
        with torch.no_grad():
            for run in range(runs + 1):
                if run == 1:
                    totals[:] = [0.0] * len(groups)
                model(**example, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [total / runs for total in totals]


def plan_bounds(
    model: nn.Module,
    layout: PlanLayout,
    *,
    at: Sequence[str] | None,
    parts: int | None,
    balance: str,
    example: Mapping[str, Any],
) -> list[int]:
    """Where each stage's layers begin and the last ends: at the layers named by ``at``, or
    ``parts`` stages balanced by ``balance``."""
    n = layout.n_layers
    if at is not None:
        names = {layout.layer_name(i): i for i in range(1, n)}
        unknown = [name for name in at if name not in names]
        if unknown:
            raise PlanError(
                f"at={list(at)}: {unknown} are not decoder layers a stage can begin at; "
                f"{type(model).__name__}'s are {layout.layer_name(1)} to {layout.layer_name(n - 1)}"
            )
        starts = [names[name] for name in at]
        if starts != sorted(set(starts)):
            raise PlanError(f"at={list(at)}: the layers must be named once each, in order")
        return [0, *starts, n]
    assert parts is not None
    if parts > n:
        raise PlanError(
            f"parts={parts} but {type(model).__name__} has {n} decoder layers, so at most {n} "
            "stages (each stage holds at least one layer)"
        )
    counts = partition(layer_costs(model, layout, balance, example), parts)
    return [sum(counts[:i]) for i in range(parts + 1)]


def same_to_rounding(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether stages that run a model's own modules on the same rows in the same order
    computed its ``expected`` logits: they differ by rounding at most, within 64 units of
    ``expected``'s largest value, where a wrong layout may differ by little (a norm of hidden
    states whose scale is already about one). Logits that are not finite compare nothing."""
    if got.shape != expected.shape or not bool(torch.isfinite(expected).all()):
        return False
    tolerance = 64 * torch.finfo(expected.dtype).eps * (float(expected.abs().max()) or 1.0)
    return torch.allclose(got, expected, rtol=0.0, atol=tolerance)
