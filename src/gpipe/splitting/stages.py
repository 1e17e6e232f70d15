"""The stage modules of a split model, and what each sends to and receives from the others.

``torch.fx``'s ``split_module`` cuts the traced graph into one graph per stage and a root
graph that calls them in order; the root graph says which values every stage takes from
which. From it each stage gets a ``StagePlan``:

- what it receives from the stage before it (its payload: a tuple) and what it sends on;
- the tensors it takes straight from an earlier stage, and those it hands straight to a
  later one, as ``gpipe.skip`` skips (one per stage that uses them);
- sizes (the integers the graph computes from its inputs' shapes) that a later stage uses:
  these ride in the payload through the stages between, as plain values;
- on the first stage, how the model's arguments become the graph's inputs; on the last,
  how the graph's outputs become the model's output (a ``ModelOutput``, a dict ...).

A ``SplitStage`` holds the parameters and buffers its graph uses under the original
model's names, so its ``state_dict`` reads like a piece of the original's.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch import Tensor, fx, nn

from gpipe.skip import Namespace, pop, stash
from gpipe.skip.skippable import Skippable

__all__ = ["SplitStage", "StagePlan", "part_module", "plan_stages"]

VALUE, ATTR = "value", "attr"


@dataclass(frozen=True)
class StagePlan:
    """What one stage computes from what, and what it passes on."""

    index: int
    n_stages: int
    args: tuple[tuple[str, str], ...]  # its graph's arguments: (VALUE, key) or (ATTR, name)
    produces: tuple[str, ...]  # keys of its graph's outputs, in order
    receives: tuple[str, ...]  # keys in the payload from the stage before
    sends: tuple[str, ...]  # keys in the payload to the stage after
    pops: tuple[tuple[str, str], ...]  # (skip name, key) taken from earlier stages
    stashes: tuple[tuple[str, str], ...]  # (skip name, key) handed to later stages
    kinds: Mapping[str, str] = field(default_factory=dict)  # key -> "tensor", "int" ...
    # the first stage: the graph's inputs, in flattening order, and the model's signature
    inputs: tuple[str, ...] = ()
    in_spec: pytree.TreeSpec | None = None
    arg_names: tuple[str, ...] = ()
    fixed: tuple[
        tuple[int, str, Any], ...
    ] = ()  # (input position, path, value) traced as constants
    # the last stage: the flat outputs, (True, key) or (False, a constant), and their tree
    outputs: tuple[tuple[bool, Any], ...] = ()
    out_spec: pytree.TreeSpec | None = None


def _kind(value: Any) -> str:
    if isinstance(value, Tensor):
        return "tensor"
    if isinstance(value, torch.SymInt | int) and not isinstance(value, bool):
        return "int"
    if isinstance(value, torch.SymFloat | float):
        return "float"
    if isinstance(value, torch.SymBool | bool):
        return "bool"
    return "other"


def part_module(root: fx.GraphModule, call: fx.Node) -> fx.GraphModule:
    """The part of ``split_module``'s ``root`` that its ``call_module`` node ``call`` runs (a
    graph module, named by a string)."""
    return cast(fx.GraphModule, root.get_submodule(str(call.target)))


def _outputs_of(graph: fx.Graph) -> list[Any]:
    (out,) = [n for n in graph.nodes if n.op == "output"]
    result = out.args[0]
    return list(result) if isinstance(result, (tuple, list)) else [result]


def plan_stages(
    root: fx.GraphModule,
    traced: fx.GraphModule,
    in_spec: pytree.TreeSpec,
    out_spec: pytree.TreeSpec,
    arg_names: Sequence[str],
    example_inputs: Sequence[Any],
) -> list[StagePlan]:
    """One plan per ``submod_i`` of ``split_module``'s ``root``."""
    placeholders = [n for n in root.graph.nodes if n.op == "placeholder"]
    calls = [n for n in root.graph.nodes if n.op == "call_module"]
    n_stages = len(calls)
    last = n_stages - 1
    producer, kinds, produces = _stage_outputs(root, calls, placeholders, traced)
    consumers: dict[str, list[int]] = {}  # value -> the later stages that read it
    stage_args = _stage_arguments(calls, producer, consumers)
    outputs = _model_outputs(root, producer, consumers, last)
    receives, pops, stashes = _routes(consumers, producer, kinds, n_stages)
    fixed = tuple(
        (position, name, value)
        for position, (name, value) in enumerate(
            zip((n.name for n in placeholders), example_inputs, strict=True)
        )
        if not isinstance(value, Tensor)
    )
    return [
        StagePlan(
            index=i,
            n_stages=n_stages,
            args=tuple(stage_args[i]),
            produces=tuple(produces[i]),
            receives=tuple(receives[i]),
            sends=tuple(receives[i + 1]) if i + 1 < n_stages else (),
            pops=tuple(pops[i]),
            stashes=tuple(stashes[i]),
            kinds=dict(kinds),
            inputs=tuple(n.name for n in placeholders) if i == 0 else (),
            in_spec=in_spec if i == 0 else None,
            arg_names=tuple(arg_names) if i == 0 else (),
            fixed=fixed if i == 0 else (),
            outputs=tuple(outputs) if i == last else (),
            out_spec=out_spec if i == last else None,
        )
        for i in range(n_stages)
    ]


def _stage_outputs(
    root: fx.GraphModule, calls: list[fx.Node], placeholders: list[fx.Node], traced: fx.GraphModule
) -> tuple[dict[str, int], dict[str, str], list[list[str]]]:
    """Which stage produces each value (the model's inputs: the first), each value's kind, and
    the keys of every stage's outputs in order ("" for an output nothing reads)."""
    traced_values = {n.name: n.meta.get("val") for n in traced.graph.nodes if n.op == "placeholder"}
    producer: dict[str, int] = {n.name: 0 for n in placeholders}
    kinds: dict[str, str] = {n.name: _kind(traced_values.get(n.name)) for n in placeholders}
    produces: list[list[str]] = []
    for i, call in enumerate(calls):
        submod = part_module(root, call)
        outputs = _outputs_of(submod.graph)
        multiple = isinstance(
            next(n for n in submod.graph.nodes if n.op == "output").args[0], (tuple, list)
        )
        keys = [call.name] if not multiple else [""] * len(outputs)
        if multiple:
            for user in call.users:
                if user.target is operator.getitem:
                    keys[cast(int, user.args[1])] = user.name  # the output's position
        for key, out in zip(keys, outputs, strict=True):
            if key:
                producer[key] = i
                kinds[key] = _kind(out.meta.get("val") if isinstance(out, fx.Node) else out)
        produces.append(keys)
    return producer, kinds, produces


def _stage_arguments(
    calls: list[fx.Node], producer: Mapping[str, int], consumers: dict[str, list[int]]
) -> list[list[tuple[str, str]]]:
    """Each stage's graph arguments; adds to ``consumers`` each stage that reads a value
    another stage produced."""
    stage_args: list[list[tuple[str, str]]] = []
    for i, call in enumerate(calls):
        args = []
        for arg in call.args:
            if not isinstance(arg, fx.Node):
                raise TypeError(f"stage {i} of the split takes a constant argument {arg!r}")
            if arg.op == "get_attr":
                args.append((ATTR, str(arg.target)))
                continue
            args.append((VALUE, arg.name))
            if producer[arg.name] != i:
                consumers.setdefault(arg.name, []).append(i)
        stage_args.append(args)
    return stage_args


def _model_outputs(
    root: fx.GraphModule,
    producer: Mapping[str, int],
    consumers: dict[str, list[int]],
    last: int,
) -> list[tuple[bool, Any]]:
    """The model's flat outputs, (True, key) or (False, a constant); the last stage returns
    them, so it is added to ``consumers`` of each one an earlier stage produced."""
    (output,) = [n for n in root.graph.nodes if n.op == "output"]
    flat_out = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    outputs: list[tuple[bool, Any]] = []
    for item in flat_out:
        if isinstance(item, fx.Node):
            outputs.append((True, item.name))
            if producer[item.name] != last:
                consumers.setdefault(item.name, []).append(last)
        else:
            outputs.append((False, item))
    return outputs


def _routes(
    consumers: Mapping[str, list[int]],
    producer: Mapping[str, int],
    kinds: Mapping[str, str],
    n_stages: int,
) -> tuple[list[list[str]], list[list[tuple[str, str]]], list[list[tuple[str, str]]]]:
    """How each value reaches the stages that read it: per stage, the keys it receives in the
    payload, and the skips it pops and stashes. A tensor goes to the next stage in the
    payload and further as a skip; sizes and flags ride in the payload through each stage."""
    receives: list[list[str]] = [[] for _ in range(n_stages)]
    pops: list[list[tuple[str, str]]] = [[] for _ in range(n_stages)]
    stashes: list[list[tuple[str, str]]] = [[] for _ in range(n_stages)]
    for key, users in consumers.items():
        source = producer[key]
        targets = sorted(set(users))
        if kinds[key] != "tensor":
            for stage in range(source + 1, targets[-1] + 1):
                receives[stage].append(key)
            continue
        for target in targets:
            if target == source + 1:
                receives[target].append(key)
            else:
                name = f"{key}>{target}"
                stashes[source].append((name, key))
                pops[target].append((name, key))
    return receives, pops, stashes


# ops whose behaviour follows the module's mode, and the position of that flag
_MODE_FLAGS = {
    torch.ops.aten.dropout.default: 2,
    torch.ops.aten.feature_dropout.default: 2,
    torch.ops.aten.alpha_dropout.default: 2,
    torch.ops.aten.feature_alpha_dropout.default: 2,
    torch.ops.aten.batch_norm.default: 5,
}
# attention's dropout is a rate, not a flag: traced in training it is the model's rate, and
# out of training it is 0 (as the model's own attention passes it in evaluation)
_ATTENTION_DROPOUT = {
    torch.ops.aten.scaled_dot_product_attention.default: 4,
    torch.ops.aten._scaled_dot_product_attention_math.default: 4,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
    torch.ops.aten._scaled_dot_product_flash_attention.default: 3,
    torch.ops.aten._scaled_dot_product_efficient_attention.default: 5,
}


def other_mode(graph: fx.GraphModule, traced_training: bool) -> fx.GraphModule:
    """The graph for the other mode than the one it was traced in: dropout and batch norm
    flags flipped, and out of training, no count of batches tracked and no attention
    dropout."""
    flipped = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.graph.nodes:
        if (
            traced_training
            and node.op == "call_function"
            and node.target is torch.ops.aten.add_.Tensor
            and isinstance(node.args[0], fx.Node)
            and str(node.args[0].target).endswith("num_batches_tracked")
        ):
            continue  # BatchNorm out of training counts nothing
        new = flipped.node_copy(node, lambda n: env[n])
        position = _MODE_FLAGS.get(node.target) if node.op == "call_function" else None
        flag = new.args[position] if position is not None and len(new.args) > position else None
        if position is not None and flag is traced_training:
            args = list(new.args)
            args[position] = not traced_training
            new.args = tuple(args)
        if traced_training and node.op == "call_function" and node.target in _ATTENTION_DROPOUT:
            _no_attention_dropout(new, _ATTENTION_DROPOUT[node.target])
        env[node] = new
    return fx.GraphModule(graph, flipped)


def _no_attention_dropout(node: fx.Node, position: int) -> None:
    """``node``'s attention with a dropout rate of 0, given by position or by name."""
    if "dropout_p" in node.kwargs:
        node.kwargs = {**node.kwargs, "dropout_p": 0.0}
    elif len(node.args) > position:
        args = list(node.args)
        args[position] = 0.0
        node.args = tuple(args)


def _set_path(owner: nn.Module, name: str, value: Tensor, *, persistent: bool) -> None:
    """Register ``value`` at the dotted ``name`` under ``owner``, making the modules between:
    a parameter, or a buffer (in the state dict if ``persistent``)."""
    *path, attr = name.split(".")
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    if isinstance(value, nn.Parameter):
        owner.register_parameter(attr, value)
    else:
        owner.register_buffer(attr, value, persistent=persistent)


class _Body(nn.Module):
    """A stage's forward as a skippable generator; ``SplitStage`` is its skippable class."""

    _plan: StagePlan
    _graph: fx.GraphModule  # traced in the mode ``_traced_training``
    _other: fx.GraphModule | None  # the other mode's, once needed
    _traced_training: bool
    _device: torch.device

    def _inputs(self, x: Any) -> dict[str, Any]:
        """The first stage: the model's arguments, as the graph's inputs by key."""
        plan = self._plan
        assert plan.in_spec is not None
        if isinstance(x, Mapping):
            given = dict(x)
            missing = [n for n in plan.arg_names if n not in given]
            if missing:
                raise TypeError(
                    f"the split model's input lacks {missing}: a dict input names every "
                    f"argument the examples gave ({[*plan.arg_names, *self._kwarg_names()]})"
                )
            args = tuple(given.pop(n) for n in plan.arg_names)
            kwargs = given
        elif isinstance(x, Tensor):
            args, kwargs = (x,), {}
        elif isinstance(x, (tuple, list)):
            args, kwargs = tuple(x), {}
        else:
            raise TypeError(
                "a split model takes a tensor, a tuple of positional arguments or a dict of "
                f"arguments by name, got {type(x).__name__}"
            )
        try:
            flat = fx_pytree.tree_flatten_spec((args, kwargs), plan.in_spec)
        except Exception as exc:  # the spec names what it expected
            raise TypeError(
                f"the split model's input does not match the examples it was traced with: {exc}"
            ) from None
        for position, name, value in plan.fixed:
            if flat[position] != value:
                raise ValueError(
                    f"input {name!r} was {value!r} when the model was traced and is fixed in "
                    f"the graph; got {flat[position]!r}"
                )
        return dict(zip(plan.inputs, flat, strict=True))

    def _kwarg_names(self) -> list[str]:
        spec = self._plan.in_spec
        assert spec is not None
        kwargs = spec.children()[1] if hasattr(spec, "children") else spec.children_specs[1]
        return list(kwargs.context or [])

    def _received(self, x: Any) -> dict[str, Any]:
        keys = self._plan.receives
        if not keys:
            return {}
        values = x if isinstance(x, tuple) else (x,)
        if len(values) != len(keys):
            raise RuntimeError(
                f"split stage {self._plan.index} expected {len(keys)} values from the stage "
                f"before it, got {len(values)}"
            )
        return dict(zip(keys, values, strict=True))

    def forward(self, x: Any) -> Any:
        plan = self._plan
        env = self._inputs(x) if plan.index == 0 else self._received(x)
        for name, key in plan.pops:
            env[key] = yield pop(name)
        args = [env[ref] if source == VALUE else self._attr(ref) for source, ref in plan.args]
        self._follow(args)
        results = self._mode_graph()(*args)
        if len(plan.produces) == 1:
            results = (results,)
        env.update((key, value) for key, value in zip(plan.produces, results, strict=True) if key)
        for name, key in plan.stashes:
            yield stash(name, env[key])
        if plan.index == plan.n_stages - 1:
            flat = [env[item] if is_key else item for is_key, item in plan.outputs]
            assert plan.out_spec is not None
            return pytree.tree_unflatten(flat, plan.out_spec)
        sent = tuple(env[key] for key in plan.sends)
        return sent if sent else (torch.empty(0, device=self._device),)

    def _attr(self, name: str) -> Tensor:
        owner_name, _, attr = name.rpartition(".")
        owner = self.get_submodule(owner_name) if owner_name else self
        return getattr(owner, attr)

    def _mode_graph(self) -> fx.GraphModule:
        """The graph for the stage's mode (``train()`` / ``eval()``): the traced one, or its
        copy for the other mode, made once."""
        if self.training == self._traced_training:
            return self._graph
        if self._other is None:
            self._other = other_mode(self._graph, self._traced_training)
        return self._other

    def _follow(self, args: Sequence[Any]) -> None:
        """Put the graph's own tensors (``arange``'s, ``zeros``'...) on the device its inputs
        are on: the model was traced on another, or on the meta device."""
        device = next((a.device for a in args if isinstance(a, Tensor)), None)
        if device is None or device == self._device:
            return
        for graph in (self._graph, self._other):
            if graph is None:
                continue
            for node in graph.graph.nodes:
                if node.op != "call_function":
                    continue
                if isinstance(node.kwargs.get("device"), torch.device):
                    node.update_kwarg("device", device)
                node.args = tuple(device if isinstance(a, torch.device) else a for a in node.args)
            graph.recompile()
        self._device = device


class SplitStage(Skippable, _Body):
    """One stage of a model cut by ``gpipe.split``: an ``nn.Module`` whose ``forward`` runs
    its piece of the traced graph. It takes the stage before's payload (the first stage:
    the model's arguments) and returns the next stage's (the last: the model's output)."""

    def __init__(
        self,
        plan: StagePlan,
        graph: fx.GraphModule,
        attrs: Mapping[str, tuple[Tensor, bool]],
        namespace: Namespace,
        device: torch.device,
        traced_training: bool = True,
    ) -> None:
        super().__init__()
        self._plan = plan
        self._graph = graph
        self.__dict__["_other"] = None  # not a submodule: a derived copy of ``_graph``
        self._traced_training = traced_training
        self._device = device
        self.stashable_names = frozenset(name for name, _ in plan.stashes)
        self.poppable_names = frozenset(name for name, _ in plan.pops)
        for name, (value, persistent) in attrs.items():
            _set_path(self, name, value, persistent=persistent)
        self.isolate(namespace)

    @property
    def plan(self) -> StagePlan:
        return self._plan

    def extra_repr(self) -> str:
        plan = self._plan
        return (
            f"stage={plan.index} of {plan.n_stages}, receives={len(plan.receives)}, "
            f"sends={len(plan.sends)}, skips in={len(plan.pops)} out={len(plan.stashes)}"
        )
