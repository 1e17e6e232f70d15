"""Tensor parallelism inside each stage: a stage's layers split over T ranks with PyTorch's
DTensor styles, beside the pipeline and its data-parallel replicas on one device mesh.

The world is a ``DeviceMesh`` of shape ``(pipeline, data, tensor)``, tensor innermost: the T
ranks of a stage are neighbours (one machine's GPUs, joined by its fast links), then the D
replicas, then the K positions of the pipeline. Each (replica, tensor rank) pair runs a
pipeline of its own: rank t of stage p exchanges boundary tensors with rank t of stage p + 1,
and the boundary tensors are whole (replicated over the tensor ranks), as the styles of a plan
leave them at a layer's end.

A plan maps module names of the whole model (an ``nn.Sequential``'s child names such as
``"3"``, dotted paths inside, ``*`` for any one name) to a style: ``"colwise"``,
``"rowwise"``, ``"sequence"`` or a ``ParallelStyle``. Layers may declare their own plan, keyed
inside themselves, as a ``tp_plan`` attribute (the built-in GPT's blocks do, and so do the
stages ``gpipe.split`` cuts from a Hugging Face model by its ``base_model_tp_plan``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.comm.agreement import on_first_rank
from gpipe.runtime.dtensors import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

    from gpipe.parallel.ties import Tie

    PlanValue = str | ParallelStyle

# PyTorch's DTensor styles are imported where a plan is resolved or applied, not with this
# module: ``import gpipe`` need not pay for them (gpipe.runtime.dtensors says why).

__all__ = [
    "MESH_DIMS",
    "STYLES",
    "ParallelMesh",
    "TensorPlan",
    "check_tensor_parallel",
    "declared_plan",
    "mesh_shape",
    "placed_like",
    "resolve_plan",
]

V = TypeVar("V")
MESH_DIMS = ("pipeline", "data", "tensor")
STYLES = ("colwise", "rowwise", "sequence")


def check_tensor_parallel(tensor_parallel: object) -> int:
    if (
        isinstance(tensor_parallel, bool)
        or not isinstance(tensor_parallel, int)
        or tensor_parallel < 1
    ):
        raise ValueError(f"tensor_parallel must be a positive integer, got {tensor_parallel!r}")
    return tensor_parallel


def mesh_shape(world: int, data_parallel: int, tensor_parallel: int) -> tuple[int, int, int]:
    """``(K, D, T)`` for a world of ``world`` processes; refuses one that is not K x D x T."""
    per_position = data_parallel * tensor_parallel
    if world % per_position:
        raise ValueError(
            f"the world size {world} is not pipeline x data_parallel x tensor_parallel: "
            f"data_parallel={data_parallel} x tensor_parallel={tensor_parallel} = "
            f"{per_position} does not divide it"
        )
    return world // per_position, data_parallel, tensor_parallel


@dataclass(frozen=True)
class ParallelMesh:
    """The world as ``(pipeline, data, tensor)``, and this rank's groups along each."""

    mesh: DeviceMesh

    @classmethod
    def create(cls, device: torch.device, data_parallel: int, tensor_parallel: int) -> ParallelMesh:
        """Collective over the world, which must be K x D x T processes."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = mesh_shape(dist.get_world_size(), data_parallel, tensor_parallel)
        return cls(init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS))

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.mesh.get_group(dim)

    @property
    def tensor(self) -> DeviceMesh:
        return self.mesh["tensor"]

    @property
    def data(self) -> DeviceMesh:
        return self.mesh["data"]

    def first_tensor_ranks(self, value: V) -> V:
        """``value`` as the first tensor rank of this rank's stage has it: what each rank
        would draw on its own (a sampling seed) must be one on the T ranks of a stage, whose
        copies of the activations and tokens must stay equal."""
        return on_first_rank(lambda: value, self.group("tensor"), "agreeing over tensor ranks")

    def align_random_state(self, device: torch.device) -> None:
        """Give every tensor rank of this stage the random state of the first (CPU, and
        ``device``'s where it is a GPU), so that they draw the same dropout masks on the
        whole activations they each hold: ranks seeded apart (``torch.manual_seed(rank)``)
        would otherwise compute different gradients for the parameters they keep whole."""
        group = self.group("tensor")
        source = dist.get_global_rank(group, 0)
        wire = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        states: list[tuple[Callable[[], Tensor], Callable[[Tensor], None]]] = [
            (torch.get_rng_state, torch.set_rng_state)
        ]
        if device.type == "cuda":
            states.append(
                (
                    lambda: torch.cuda.get_rng_state(device),
                    lambda state: torch.cuda.set_rng_state(state, device),
                )
            )
        for get, put in states:
            state = get().to(wire)
            dist.broadcast(state, source, group=group)
            put(state.cpu())


def declared_plan(module: nn.Sequential) -> dict[str, PlanValue]:
    """The plan the layers of ``module`` declare (``layer.tp_plan``), keyed by their names."""
    plan: dict[str, PlanValue] = {}
    for name, layer in module.named_children():
        own = getattr(layer, "tp_plan", None)
        if own:
            plan.update({f"{name}.{key}": style for key, style in dict(own).items()})
    return plan


def _matches(pattern: str, name: str) -> bool:
    """Whether the dotted module name ``name`` matches ``pattern``, one name per ``*``."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(
        fnmatchcase(part, atom) for atom, part in zip(atoms, parts, strict=True)
    )


def _style(key: str, value: object, module: nn.Module) -> ParallelStyle:
    """The ``ParallelStyle`` that ``value`` names for ``module``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
    )

    if isinstance(value, ParallelStyle):
        kind = _named_style(value)
        if kind in ("colwise", "rowwise") and not isinstance(module, nn.Linear | nn.Embedding):
            raise ValueError(
                f"tp_plan[{key!r}] = {type(value).__name__}() applies to nn.Linear and "
                f"nn.Embedding, and {key} is a {type(module).__name__}"
            )
        return value
    if value not in STYLES:
        raise ValueError(
            f"tp_plan[{key!r}] must be one of {list(STYLES)} or a "
            f"torch.distributed.tensor.parallel.ParallelStyle, got {value!r}"
        )
    if value == "sequence":
        return SequenceParallel()
    if not isinstance(module, nn.Linear | nn.Embedding):
        raise ValueError(
            f"tp_plan[{key!r}] = {value!r} applies to nn.Linear and nn.Embedding, and "
            f"{key} is a {type(module).__name__}"
        )
    if value == "colwise":
        return ColwiseParallel()
    # an embedding's rows are the vocabulary, looked up by whole token ids
    return (
        RowwiseParallel(input_layouts=Replicate())
        if isinstance(module, nn.Embedding)
        else (RowwiseParallel())
    )


def _named_style(value: object) -> object:
    """A plan's value as the style's name where PyTorch's own style class says it
    (``ColwiseParallel()`` is ``"colwise"``), so that it is checked as the name is; other
    values as they are."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    for kind, name in (
        (ColwiseParallel, "colwise"),
        (RowwiseParallel, "rowwise"),
        (SequenceParallel, "sequence"),
    ):
        if isinstance(value, kind):
            return name
    return value


def _split_size(module: nn.Module, value: object) -> tuple[int, str] | None:
    """The size a named style splits ``module`` along, and what it is."""
    value = _named_style(value)
    if isinstance(module, nn.Linear):
        if value == "colwise":
            return module.out_features, "output features"
        if value == "rowwise":
            return module.in_features, "input features"
    if isinstance(module, nn.Embedding):
        if value == "colwise":
            return module.embedding_dim, "embedding size"
        if value == "rowwise":
            return module.num_embeddings, "vocabulary"
    return None


def _check_divides(
    name: str, module: nn.Module, parent: nn.Module | None, value: object, tensor_parallel: int
) -> None:
    split = _split_size(module, value)
    if split is None:
        return
    value = _named_style(value)
    size, what = split
    head_dim = getattr(parent, "head_dim", None)
    if value == "colwise" and isinstance(head_dim, int) and head_dim > 0 and size % head_dim == 0:
        heads = size // head_dim
        if heads % tensor_parallel:
            raise ValueError(
                f"tensor_parallel={tensor_parallel} does not divide the {heads} heads of "
                f"{name} ({size} output features of {head_dim} per head)"
            )
    if size % tensor_parallel:
        raise ValueError(
            f"tensor_parallel={tensor_parallel} does not divide the {size} {what} of {name} "
            f"({type(module).__name__}), which tp_plan splits {value}"
        )


@dataclass(frozen=True)
class TensorPlan:
    """A plan resolved on the whole model: each module's concrete name and its style."""

    tensor_parallel: int
    styles: dict[str, ParallelStyle]

    def within(self, layer_names: set[str]) -> dict[str, ParallelStyle]:
        """The styles of the modules inside the layers named ``layer_names``."""
        return {n: s for n, s in self.styles.items() if n.split(".", 1)[0] in layer_names}

    def with_split_logits(self, last_layer: str) -> TensorPlan:
        """The plan for ``loss_parallel``: the map of ``last_layer`` that splits the
        vocabulary and gathers its logits keeps them split instead (a DTensor over the tensor
        ranks), for a loss computed under torch's ``loss_parallel``."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel

        styles = dict(self.styles)
        gathering = [
            name
            for name, style in styles.items()
            if name.split(".", 1)[0] == last_layer
            and isinstance(style, ColwiseParallel)
            and tuple(style.output_layouts) == (Replicate(),)
        ]
        if not gathering:
            raise ValueError(
                f"loss_parallel=True needs a map in the last layer ({last_layer}) that tp_plan "
                "splits by vocabulary and whose logits it gathers "
                "(ColwiseParallel(output_layouts=Replicate())); found none"
            )
        for name in gathering:
            given = cast(ColwiseParallel, styles[name])
            styles[name] = ColwiseParallel(
                input_layouts=given.input_layouts[0],
                output_layouts=Shard(-1),
                use_local_output=False,
            )
        return TensorPlan(self.tensor_parallel, styles)

    def split_dim(self, parameter: str, module: nn.Module) -> int | None:
        """The dimension along which the plan splits ``parameter`` (named in the whole
        model; ``module`` holds it), -1 when it stays whole, None when a style of the
        user's own says nothing PyTorch's styles would tell."""
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
        )

        owner, _, attr = parameter.rpartition(".")
        style = self.styles.get(owner)
        if style is None or isinstance(style, SequenceParallel):
            return -1
        kind = (
            "colwise"
            if isinstance(style, ColwiseParallel)
            else "rowwise"
            if isinstance(style, RowwiseParallel)
            else None
        )
        if kind is None or not isinstance(module, nn.Linear | nn.Embedding):
            return None
        # a linear map's weight is (out, in), an embedding's (vocabulary, size)
        by_rows = (kind == "colwise") == isinstance(module, nn.Linear)
        if attr == "bias":
            return 0 if kind == "colwise" else -1
        return 0 if by_rows else 1

    def check_sharing(
        self, module: nn.Sequential, stages: Sequence[Sequence[str]], ties: Sequence[Tie]
    ) -> None:
        """Refuse, on every rank alike, parameters shared in a way the plan would break: by
        modules of one stage (``stages``: each stage's layer names) of which it splits one,
        each would get a split parameter of its own; and the copies of a weight tied across
        stages must be split alike, since they are summed shard by shard."""
        for names in stages:
            styles = self.within(set(names))
            partition = nn.ModuleDict({name: module.get_submodule(name) for name in names})
            _refuse_shared(partition, styles)
        modules = dict(module.named_modules())
        for tie in ties:
            names = [name for _, copies in tie.copies for name in copies]
            dims = {n: self.split_dim(n, modules[n.rpartition(".")[0]]) for n in names}
            if None in dims.values() or len(set(dims.values())) == 1:
                continue
            said = ", ".join(f"{n}: {_said(d)}" for n, d in dims.items())
            raise ValueError(
                f"tp_plan splits the copies of a weight tied across stages differently ({said}); "
                "split them alike (an embedding rowwise and its tied head colwise) or leave "
                "both whole"
            )

    def apply(self, partition: nn.Sequential, mesh: DeviceMesh) -> None:
        """Split ``partition``'s modules (named as in the whole model) over ``mesh``."""
        styles = self.within({name for name, _ in partition.named_children()})
        if not styles:
            return
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(partition, mesh, styles)
        for param in partition.parameters():
            if param.requires_grad:  # the hook passes over whole parameters
                param.register_post_accumulate_grad_hook(_placed_like_parameter)


def _said(dim: int | None) -> str:
    return "whole" if dim == -1 else f"split along dim {dim}"


def _refuse_shared(partition: nn.Module, styles: Mapping[str, ParallelStyle]) -> None:
    """Refuse a parameter that several modules of one stage share where the plan splits one
    of them: each would be given a split parameter of its own, and the tie would be lost."""
    users: dict[int, list[str]] = {}
    for name, module in partition.named_modules():
        for param in module.parameters(recurse=False):
            users.setdefault(id(param), []).append(name)
    for names in users.values():
        if len(names) > 1 and any(n in styles for n in names):
            raise ValueError(
                f"tp_plan splits {' and '.join(names)}, which share a parameter within one "
                "stage: splitting would make it two; put them on different stages or leave "
                "them whole"
            )


def placed_like(value: Tensor, target: Tensor) -> Tensor:
    """``value``, a whole tensor, as ``target`` holds it: this rank's part of it where
    ``target`` is split over tensor ranks (a DTensor), taken from the whole with no message,
    since every rank has it; else ``value`` itself."""
    if not is_dtensor(target) or is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        value.to(device=target.device, dtype=target.dtype),
        target.device_mesh,
        target.placements,
        src_data_rank=None,
    )


def _placed_like_parameter(param: Tensor) -> None:
    """Give ``param``'s gradient the parameter's placements as soon as it is accumulated.

    A style may leave a gradient placed otherwise (a vocabulary-split embedding's comes
    back whole); the optimizer, the replicas' reduction and tied copies all need each rank
    to hold its own shard, which is a slice of the whole, with no message."""
    grad = param.grad
    if is_dtensor(grad) and is_dtensor(param) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def resolve_plan(
    plan: Mapping[str, PlanValue] | None, module: nn.Sequential, tensor_parallel: int
) -> TensorPlan:
    """``plan`` (None: the one the layers declare) checked against ``module``, the whole
    model: every key names at least one module, every style exists and fits its module, and
    ``tensor_parallel`` divides every size it splits. Refuses, in one line, what does not."""
    given = declared_plan(module) if plan is None else plan
    if not isinstance(given, Mapping):
        raise TypeError(f"tp_plan must be a dict of module name to style, got {given!r}")
    if not given and tensor_parallel > 1:
        linear = next((n for n, m in module.named_modules() if isinstance(m, nn.Linear)), "0")
        raise ValueError(
            f"tensor_parallel={tensor_parallel} needs a tp_plan: none was given and no layer "
            "declares one (a tp_plan attribute, or a Hugging Face config's base_model_tp_plan); "
            f"pass tp_plan={{{linear!r}: 'colwise', ...}}"
        )
    modules = dict(module.named_modules())
    styles: dict[str, ParallelStyle] = {}
    for key, value in given.items():
        if not isinstance(key, str):
            raise TypeError(f"tp_plan keys must be module names, got {key!r}")
        found = [name for name in modules if name and _matches(key, name)]
        if not found:
            examples = [n for n in modules if n][:4]
            raise ValueError(
                f"tp_plan[{key!r}] names no module of the model (its modules are named like "
                f"{examples})"
            )
        for name in found:
            parent = modules[name.rsplit(".", 1)[0]] if "." in name else None
            style = _style(key, value, modules[name])
            _check_divides(name, modules[name], parent, value, tensor_parallel)
            styles[name] = style
    _refuse_whole_per_head(modules, styles)
    return TensorPlan(tensor_parallel, styles)


def _refuse_whole_per_head(
    modules: Mapping[str, nn.Module], styles: Mapping[str, ParallelStyle]
) -> None:
    """Refuse a module left whole beside maps split by heads whose parameters are one head
    wide (a per-head norm of the queries or keys): it sees only its rank's heads, so each
    rank's gradient would be a share of it, never summed; Hugging Face's plans name such a
    module ``replicated_with_grad_allreduce`` (``SummedGradients``)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    for name, style in styles.items():
        parent_name, _, _ = name.rpartition(".")
        parent = modules.get(parent_name)
        head_dim = getattr(parent, "head_dim", None)
        gathered = isinstance(style, ColwiseParallel) and tuple(style.output_layouts) == (
            Replicate(),
        )
        if not isinstance(style, ColwiseParallel) or gathered or not isinstance(head_dim, int):
            continue
        assert parent is not None
        for child, module in parent.named_children():
            full = f"{parent_name}.{child}" if parent_name else child
            params = list(module.parameters(recurse=False))
            if full in styles or not params or any(p.numel() != head_dim for p in params):
                continue
            raise ValueError(
                f"tp_plan splits {name} by heads but leaves {full} whole, whose parameters are "
                f"one head wide ({head_dim}): it sees only each rank's heads, so its gradient "
                f"would be one rank's share; give it "
                "gpipe.parallel.summed_gradients.SummedGradients() (Hugging Face's "
                "'replicated_with_grad_allreduce') or leave the heads whole"
            )
