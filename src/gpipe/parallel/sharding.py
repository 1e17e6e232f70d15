"""Sharded replicas: each stage's parameters, gradients and optimizer state split over its D
replicas by PyTorch's ``fully_shard`` (FSDP2), driven the way a pipeline needs.

A step runs many micro-batches through a stage, so the default gathers the parameters once,
at the step's first forward, and keeps them whole until the last backward
(``reshard_after_forward=False``): one all-gather per unit and step rather than one per
micro-batch and pass. Gradients accumulate whole, unreduced, over the micro-batches; the
stage's last backward reduce-scatters each unit as it passes it (``arm``), or, when the
backward is split into B and W, the last W is followed by every unit's reduction
(``launch``), so W never reduces per micro-batch. The optimizer, built from
``Pipeline.parameters()``, then steps on the shards. Parameters keep their names in the
whole model (``named_parameters``, ``state_dict``, checkpoints); they and their gradients
are DTensors, whose ``.full_tensor()`` gathers the whole (collective over the replicas).
A unit's ``forward_cached``, which sub-sequences run (``seq_chunks``), gathers its parameters
as its ``forward`` does.

The replicas of a stage sum their gradients, as unsharded ones do (each micro-batch's loss is
already weighted by its share of the global mini-batch), so the reduction divides by 1.

Only ``"full"`` exists. ``fully_shard`` keeps no whole gradient (``"optimizer"``, ZeRO-1,
needs one on every replica), and its optimizer steps on the parameter shards, so the
parameters must be gathered again every step whichever way they were kept between steps:
``"gradients"`` (ZeRO-2) would cost the memory of whole parameters and save no message
over ``"full"``, which already gathers once a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from gpipe.parallel.replicas import Replicas
    from gpipe.runtime.stage import Stage

__all__ = [
    "SHARD_MODES",
    "TRAINED_SHARD_MODES",
    "ShardedGradients",
    "ShardedStages",
    "Sharding",
    "check_shard",
    "check_shardable",
    "check_units_for_sub_sequences",
]

SHARD_MODES = (None, "optimizer", "gradients", "full")
Unit = Callable[[str, nn.Module], bool] | tuple[type[nn.Module], ...]

_DROPPED = {
    "optimizer": "fully_shard reduce-scatters every gradient into shards, and ZeRO-1 needs the "
    "whole gradient on every replica: use shard=None for that, or shard='full'",
    "gradients": "fully_shard's optimizer steps on the parameter shards, so the parameters "
    "are gathered again every step however they were kept: keeping them whole between steps "
    "(ZeRO-2) costs their memory and saves no message over shard='full', which gathers them "
    "once a step",
}
# the modes a Pipeline runs; the others are named so that asking for them says why not
TRAINED_SHARD_MODES = tuple(mode for mode in SHARD_MODES if mode not in _DROPPED)


@dataclass(frozen=True)
class Sharding:
    """``Pipeline(shard=Sharding(...))``: sharding with its options (``shard="full"`` is
    ``Sharding()``).

    ``unit``: what one ``fully_shard`` unit is, gathered and reduced in one message. None:
    each layer of the stage (each child of the whole ``nn.Sequential``); a tuple of module
    classes: every module of those classes inside the stage's layers (a transformer's
    blocks); or a predicate ``unit(name, module)`` over the stage's modules, named as in the
    whole model (``"3.attn"``). Parameters outside every unit, and those that several layers
    of one stage share, belong to the stage's own unit.

    ``reshard_after_forward``: free each unit's whole parameters after every micro-batch's
    forward and gather them again for its backward, saving their memory at the cost of two
    all-gathers per micro-batch (default False: gathered once per step).

    ``mp_policy``: ``fully_shard``'s ``MixedPrecisionPolicy``, say ``param_dtype=bfloat16``
    to gather in bfloat16 while the shards stay float32 master weights (default: none;
    ``Pipeline(autocast=...)`` works on the float32 parameters as unsharded).
    """

    mode: str = "full"
    unit: Unit | None = None
    reshard_after_forward: bool = False
    mp_policy: MixedPrecisionPolicy | None = None


def check_shard(shard: object, data_parallel: int, module: nn.Sequential) -> Sharding | None:
    """``Pipeline``'s ``shard`` argument as a ``Sharding`` (None: unsharded replicas), for
    the whole model ``module``."""
    mode = shard.mode if isinstance(shard, Sharding) else shard
    if not isinstance(mode, str | type(None)) or mode not in SHARD_MODES:
        raise ValueError(
            f"shard must be one of None, 'optimizer', 'gradients', 'full' or a Sharding, "
            f"got {shard!r}"
        )
    if mode is None:
        return None
    if mode in _DROPPED:
        raise ValueError(f"shard={mode!r} is not offered: {_DROPPED[mode]}")
    if data_parallel < 2:
        raise ValueError(
            f"shard={mode!r} splits each stage over its replicas and needs data_parallel > 1, "
            f"got data_parallel={data_parallel}"
        )
    sharding = shard if isinstance(shard, Sharding) else Sharding(mode)
    check_shardable(module, sharding)
    return sharding


def _selected(unit: Unit | None, name: str, module: nn.Module, is_layer: bool) -> bool:
    if unit is None:
        return is_layer
    if isinstance(unit, tuple):
        return isinstance(module, unit)
    return bool(unit(name, module))


def _units(partition: nn.Module, unit: Unit | None) -> list[tuple[str, nn.Module]]:
    """The modules of ``partition`` to wrap, innermost first: those ``unit`` selects that
    hold parameters and share none with modules outside them."""
    uses: dict[int, int] = {}
    for _, p in partition.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    layers = {id(m) for m in partition.children()}
    found = []
    for name, module in reversed(list(partition.named_modules())):
        if module is partition or not _selected(unit, name, module, id(module) in layers):
            continue
        inside: dict[int, int] = {}
        for _, p in module.named_parameters(remove_duplicate=False):
            inside[id(p)] = inside.get(id(p), 0) + 1
        if inside and all(uses[key] == n for key, n in inside.items()):
            found.append((name, module))
    return found


def _check_unit(name: str, module: nn.Module, wrapped: set[int], where: str = "") -> None:
    """Refuse a unit ``fully_shard`` cannot wrap, naming it and why."""
    what = f"layer {name} ({type(module).__name__})" if name else "the stage's own unit"

    def refuse(why: str) -> None:
        raise ValueError(f"shard: {what}{where} cannot be wrapped by fully_shard: {why}")

    if isinstance(module, torch.jit.ScriptModule):
        refuse("it is a ScriptModule, which takes no hooks; pass the module unscripted")
    own = list(_own_parameters(module, wrapped))
    scalar = next((p for p in own if p.dim() == 0), None)
    if scalar is not None:
        refuse("it holds a scalar parameter, and fully_shard splits dim 0: give it shape (1,)")
    dtypes = sorted({str(p.dtype) for p in own})
    if len(dtypes) > 1:
        refuse(
            f"its parameters have dtypes {dtypes}, and a unit is gathered in one: give them "
            "one, or make its parts units of their own (Sharding(unit=...))"
        )


def check_shardable(module: nn.Sequential, sharding: Sharding) -> None:
    """Refuse, before any process group work, a model with a unit that cannot be wrapped, so
    that every rank raises alike (the stage's own unit is checked as it is built)."""
    wrapped: set[int] = set()
    for name, unit in _units(module, sharding.unit):
        _check_unit(name, unit, wrapped)
        wrapped.add(id(unit))


def check_units_for_sub_sequences(partition: nn.Sequential, sharding: Sharding, stage: int) -> None:
    """Refuse a stage where a layer's parameters would be held by the stage's own unit.

    Sub-sequences (``seq_chunks``) run each layer's cached forward, registered with
    ``fully_shard`` so that it gathers its unit's parameters; the stage's own forward, which
    gathers the rest, never runs. Every rank checks every stage, so all refuse alike."""
    wrapped = {id(unit) for _, unit in _units(partition, sharding.unit)}
    for name, layer in partition.named_children():
        if id(layer) not in wrapped and next(_own_parameters(layer, wrapped), None) is not None:
            raise ValueError(
                f"seq_chunks with shard: layer {name} ({type(layer).__name__}) of stage "
                f"{stage} has parameters outside every fully_shard unit (Sharding(unit=...) "
                "leaves them out, or another layer of the stage shares them), and sub-sequences "
                "never gather those: make each layer a unit (the default, unit=None)"
            )


def _own_parameters(module: nn.Module, wrapped: set[int]) -> Iterator[nn.Parameter]:
    """``module``'s parameters outside the units already wrapped inside it."""
    seen: set[int] = set()
    for sub in module.modules():
        if sub is not module and id(sub) in wrapped:
            continue
        for p in sub.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield p


def _shard_stage(stage: Stage, mesh: Any, sharding: Sharding) -> FSDPModule:
    """Wrap ``stage``'s units, then its partition as the root; returns the root."""
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": sharding.reshard_after_forward,
    }
    if sharding.mp_policy is not None:
        options["mp_policy"] = sharding.mp_policy
    wrapped: set[int] = set()
    units = [*_units(stage.module, sharding.unit), ("", stage.module)]
    for name, module in units:
        where = f" of stage {stage.index}"
        _check_unit(name, module, wrapped, where)
        try:
            fully_shard(module, **options)
        except (TypeError, ValueError, RuntimeError, AssertionError) as exc:
            what = f"layer {name} ({type(module).__name__})" if name else "the stage's own unit"
            raise ValueError(
                f"shard: {what}{where} cannot be wrapped by fully_shard: {exc}"
            ) from exc
        if hasattr(module, "forward_cached"):  # what sub-sequences (seq_chunks) call
            register_fsdp_forward_method(module, "forward_cached")
        wrapped.add(id(module))
    # fully_shard turned each unit into an FSDPModule in place; torch types them as before
    root: FSDPModule = stage.module  # type: ignore[assignment]  # made one in place
    _prefetch_in_order([root, *(m for n, m in units if n)])  # type: ignore[list-item]  # so were these
    # the root's lazy set-up now, not at its first forward: a stage that recomputes some
    # layers calls them one by one, and the root's own forward never runs
    fully_shard.state(root)._lazy_init()  # type: ignore[attr-defined]  # @contract adds .state
    root.set_gradient_divide_factor(1.0)  # the replicas' gradients are summed
    root.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    for module in stage.module.modules():
        if module is not stage.module and isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root


def _prefetch_in_order(order: list[FSDPModule]) -> None:
    """Each unit's backward gathers the next one's parameters in ``order``, the backward's.

    fully_shard would guess the next unit from the order of the forwards; a step runs
    several forwards before a backward, and its guess would gather again, after the last
    backward reduced it, the last unit of an earlier micro-batch. The last unit names itself:
    nothing to gather."""
    for unit, after in zip(order, [*order[1:], order[-1]], strict=True):
        unit.set_modules_to_backward_prefetch([after])


def _reduce_unused(root: FSDPModule) -> None:
    """Make every unit reduce-scatter its parameters that got no gradient this step (as
    zeros), as ``GradientBuckets`` sums them: a replica whose data skips a layer (a branch,
    an expert) must still join the others' collective, or the replicas' reductions pair up
    wrong and gloo aborts the process. A PyTorch without the switch keeps FSDP's rule: every
    replica's step uses the same parameters."""
    switch = getattr(root, "set_reduce_scatter_unused_params", None)
    if switch is not None:
        switch(True)


class ShardedGradients:
    """One stage's gradient reduction over its replicas, as ``GradientBuckets`` offers it to
    the step: ``arm`` before the stage's last whole backward, ``launch`` after its last
    backward or W, ``finish`` once the step's program has run, ``reset`` after a failure.

    Between those, the units keep their gradients whole and unreduced
    (``set_requires_gradient_sync(False)``) and their parameters gathered.

    ``fully_shard`` has no public call that reduces a unit at a moment of the caller's choosing
    (after the last W) or forgets a failed step, so this class alone drives its private state:
    each unit's parameter group (``_fsdp_param_group``, ``_unsharded_param``) and the root's
    end-of-backward callback. tests/parallel/test_sharding.py pins that behaviour against
    PyTorch's."""

    def __init__(self, root: FSDPModule, stage: int) -> None:
        from torch.distributed.fsdp import fully_shard

        self.root = root
        self.stage = stage
        self._state = fully_shard.state(root)  # type: ignore[attr-defined]  # @contract adds .state
        self.buckets = [g for s in self._states() if (g := s._fsdp_param_group) is not None]
        self._armed = self._reduced = False
        self._early = 0  # units reduced during the last backward
        _reduce_unused(root)
        self._accumulate()

    def _states(self) -> list[Any]:
        return list(self._state._state_ctx.all_states)

    def _accumulate(self) -> None:
        """Micro-batches: gradients whole, parameters kept for the next backward or W."""
        self.root.set_requires_gradient_sync(False)
        self.root.set_reshard_after_backward(False)
        self.root.set_is_last_backward(False)
        self._armed = self._reduced = False

    def _last(self) -> None:
        self.root.set_requires_gradient_sync(True)
        self.root.set_reshard_after_backward(True)
        self.root.set_is_last_backward(True)

    def arm(self) -> None:
        """The next backward is the stage's last: each unit reduce-scatters as it passes."""
        self._last()
        self._armed = True

    def before_weight(self) -> None:
        """Before a W: its units' parameters whole again, if a forward since freed them."""
        for group in self.buckets:
            if not group.is_unsharded:
                group.unshard()
                group.wait_for_unshard()

    def _pending(self) -> bool:
        """Whether a unit still holds a whole gradient, not reduced yet."""
        return any(
            hasattr(param, "_unsharded_param")
            and (
                param._unsharded_param.grad is not None
                or param.unsharded_accumulated_grad is not None
            )
            for group in self.buckets
            for param in group.fsdp_params
        )

    def launch(self) -> None:
        """After the stage's last backward or W: reduce what is not reduced yet."""
        if self._reduced:
            return
        self._reduced = True
        self._early = len(self.buckets) if self._armed else 0
        if self._armed and not self._pending():  # fully_shard's hooks reduced every unit
            return
        self._early = 0
        self._last()
        for state in reversed(self._states()):
            if state._fsdp_param_group is not None:
                state._fsdp_param_group.post_backward()
        self._state._root_post_backward_final_callback()

    def finish(self) -> tuple[float, int]:
        """Complete the reductions; returns the seconds it took and how many units were
        reduced during the last backward."""
        start = perf_counter()
        self.launch()  # on a GPU, the current stream waits for the reductions
        self._accumulate()
        return perf_counter() - start, self._early

    def reset(self) -> None:
        """Forget a failed step: gradients not yet reduced are dropped, parameters resharded."""
        self._state._reset_iter_state()
        for group in self.buckets:
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                if hasattr(param, "_unsharded_param"):
                    param._unsharded_param.grad = None
        self._accumulate()


class ShardedStages:
    """This rank's stages, each sharded over its replicas (``Replicas.group``)."""

    def __init__(
        self,
        stages: dict[int, Stage],
        replicas: Replicas,
        sharding: Sharding,
        mesh: DeviceMesh | None = None,
    ) -> None:
        """``mesh``: the replicas' dimension of the world's mesh, when the stages are split
        over tensor ranks too (their parameters are then sharded along both)."""
        from torch.distributed.device_mesh import DeviceMesh

        self.sharding = sharding
        device = next(iter(stages.values())).device
        self.mesh = mesh if mesh is not None else DeviceMesh.from_group(replicas.group, device.type)
        self.gradients = {
            index: ShardedGradients(_shard_stage(stage, self.mesh, sharding), index)
            for index, stage in stages.items()
        }

    def reshard(self) -> None:
        """Free the whole parameters a forward without a backward left gathered (the
        optimizer steps on the shards, so they would be stale by the next step)."""
        from torch.distributed.fsdp import FSDPModule

        for gradients in self.gradients.values():
            for module in cast(nn.Module, gradients.root).modules():  # an FSDPModule is one
                if isinstance(module, FSDPModule):
                    module.reshard()
