"""Where a traced graph is cut: split points named by module, and each node's stage.

A split point is a submodule's qualified name; its stage begins with the first node of the
graph that runs inside that submodule (``torch.export`` records, for every node, the
modules it ran in). Every node from there up to the next split point belongs to that stage,
so a stage is a run of consecutive nodes and values only ever flow to later stages. Two
kinds of node follow other rules: a ``getitem`` stays with the node whose tuple it takes
apart (so no tuple crosses a cut), and the checks ``torch.export`` adds on a tensor's device
and dtype are dropped (the stages may run on any device).
"""

from __future__ import annotations

import difflib
import itertools
import operator
from collections.abc import Iterable, Sequence

import torch
from torch import fx, nn

__all__ = [
    "CutError",
    "assign_stages",
    "candidates",
    "drop_checks",
    "module_paths",
    "module_starts",
    "resolve",
]


class CutError(ValueError):
    """A split point that cannot be used, named with what would do."""


def module_paths(node: fx.Node) -> list[str]:
    """The qualified names of the modules ``node`` ran in, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values() if isinstance(path, str) and path]


def module_starts(graph: fx.Graph) -> dict[str, int]:
    """For every module the graph runs, the position of its first node."""
    first: dict[str, int] = {}
    for position, node in enumerate(graph.nodes):
        for path in module_paths(node):
            first.setdefault(path, position)
    return first


def _first_computation(graph: fx.Graph) -> int:
    return next((i for i, n in enumerate(graph.nodes) if n.op == "call_function"), 0)


def resolve(model: nn.Module, graph: fx.Graph, at: Iterable[str]) -> list[tuple[str, int]]:
    """The split points in graph order, each with the position in ``graph`` where its stage
    begins."""
    names = list(at)
    if isinstance(at, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"at must be a list of submodule names, got {at!r}")
    modules = dict(model.named_modules())
    first = module_starts(graph)
    positions = {}
    for name in names:
        if name not in modules or not name:
            near = difflib.get_close_matches(name, [m for m in modules if m], n=5, cutoff=0.5)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            raise CutError(
                f"split point {name!r} is not a submodule of {type(model).__name__}{hint}"
            )
        if name not in first:
            raise CutError(
                f"split point {name!r} never runs in {type(model).__name__}.forward on the "
                "example inputs, so no stage can begin there"
            )
        if first[name] <= _first_computation(graph):
            raise CutError(
                f"split point {name!r} is where {type(model).__name__}.forward begins: the "
                "stage before it would be empty"
            )
        positions[name] = first[name]
    ordered = sorted(positions.items(), key=operator.itemgetter(1))
    for (a, pa), (b, pb) in itertools.pairwise(ordered):
        if pa == pb:
            raise CutError(
                f"split points {a!r} and {b!r} begin at the same node: the stage between "
                "them would be empty"
            )
    return ordered


def candidates(model: nn.Module, graph: fx.Graph) -> list[str]:
    """Where ``parts=`` may cut, in graph order: the children of every ``nn.ModuleList``
    and ``nn.Sequential`` (the blocks of a model), and the model's own children."""
    first = module_starts(graph)
    names = [name for name, _ in model.named_children()]
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            prefix = f"{name}." if name else ""
            names += [prefix + child for child, _ in module.named_children()]
    begin = _first_computation(graph)
    found = {name: first[name] for name in names if name in first and first[name] > begin}
    by_position: dict[int, str] = {}
    for name, position in sorted(found.items(), key=operator.itemgetter(1)):
        by_position.setdefault(position, name)  # the outermost name at each position
    return [by_position[p] for p in sorted(by_position)]


_DROPPED = (torch.ops.aten._assert_tensor_metadata.default,)


def drop_checks(graph: fx.Graph) -> None:
    """Erase the checks ``torch.export`` adds on a tensor's device and dtype, which would
    pin the stages to the device the model was traced on."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _DROPPED and not node.users:
            graph.erase_node(node)


def assign_stages(graph: fx.Graph, starts: Sequence[int]) -> dict[fx.Node, int]:
    """Each computing node's stage, for stages beginning at the positions ``starts``."""
    stage_of: dict[fx.Node, int] = {}
    bounds = list(starts)
    stage = 0
    for position, node in enumerate(graph.nodes):
        while stage < len(bounds) and position >= bounds[stage]:
            stage += 1
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            source = node.args[0]
            stage_of[node] = stage_of.get(source, stage)
            continue
        stage_of[node] = stage
    return stage_of
