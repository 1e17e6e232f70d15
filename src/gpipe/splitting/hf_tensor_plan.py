"""A Hugging Face causal LM's own tensor-parallel plan, as ``gpipe.parallel.tensor`` takes it:
what each stage cut by the pipeline plan declares as its ``tp_plan``.

A config declares ``base_model_tp_plan`` (keyed inside the base model: ``layers.*.mlp.up_proj``)
and the causal LM class its head's (``{"lm_head": "colwise_gather_output"}``). Both are keyed
here from the causal LM, as a stage names its modules, and their style names translated: the
ones the engine knows by name stay names, so that it checks that ``tensor_parallel`` divides
every split size and the heads of each attention map (key/value heads included); the head's
gathered columns become a ``ColwiseParallel`` that replicates its output; a stacked-experts
module (``moe_tp_experts``) and its parameters' styles become one ``ExpertsParallel``.
Translation waits until a plan is asked for, so a model whose plan uses other styles is
still cut and run without tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

# The styles (PyTorch's DTensor ones and gpipe's own) are imported when a plan is translated
# for tensor parallelism, not when a model is split (gpipe.runtime.dtensors says why).

__all__ = ["HF_STYLES", "held_plan", "model_tp_plan", "torch_plan"]


def _gathered_columns() -> ParallelStyle:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(output_layouts=Replicate())


def _rows_of_whole_input() -> ParallelStyle:
    """Rows split, its input whole on every rank (split there): a map after one that is not
    split (Phi3's fused attention), or an embedding split by vocabulary."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(input_layouts=Replicate())


def _summed_gradients() -> ParallelStyle:
    from gpipe.parallel.summed_gradients import SummedGradients

    return SummedGradients()


# Hugging Face's style names and what each is in gpipe.parallel.tensor's terms
HF_STYLES: dict[str, Callable[[], str | ParallelStyle]] = {
    "colwise": lambda: "colwise",  # ColwiseParallel()
    "rowwise": lambda: "rowwise",  # RowwiseParallel()
    "sequence_parallel": lambda: "sequence",  # SequenceParallel()
    "colwise_gather_output": _gathered_columns,
    "colwise_rep": _gathered_columns,  # its name in older transformers (4.4x)
    "rowwise_split_input": _rows_of_whole_input,
    "embedding_rowwise": _rows_of_whole_input,
    "replicated_with_grad_allreduce": _summed_gradients,
}


def _class_tp_plan(model: nn.Module) -> Mapping[str, str]:
    """The causal LM class's own plan (its head's). transformers declares it only as the class
    attribute ``_tp_plan``; an instance's ``tp_plan`` merges the base model's into it and, from
    5.x, adds a vocabulary split of the embedding that the config does not declare."""
    return getattr(type(model), "_tp_plan", None) or {}


def model_tp_plan(model: nn.Module, base: str) -> dict[str, str]:
    """``model``'s declared plan keyed from the causal LM: its config's ``base_model_tp_plan``
    under ``base`` (the base model's name) and the class's own, less the entries for modules
    that hold a tied weight (a head tied to the embedding stays whole, as the embedding is:
    the copies of a tie must be laid out alike)."""
    config: Any = getattr(model, "config", None)
    declared = getattr(config, "base_model_tp_plan", None) or {}
    plan = {f"{base}.{key}": style for key, style in dict(declared).items()}
    plan.update(_class_tp_plan(model))
    tied = _holding_tied(model)
    return {k: v for k, v in plan.items() if not any(_matches(k, name) for name in tied)}


def _holding_tied(model: nn.Module) -> list[str]:
    """The names of the modules that hold a parameter another module holds too."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(name)
    return [name for names in holders.values() if len(names) > 1 for name in names]


# what each of Hugging Face's styles for a stacked-experts parameter is in ExpertsParallel
_EXPERT_PARAMETER_STYLES = {"packed_colwise": "packed", "colwise": "columns", "rowwise": "rows"}


def _experts_styles(plan: Mapping[str, str]) -> tuple[dict[str, ParallelStyle], set[str]]:
    """The ``moe_tp_experts`` modules of ``plan`` as ``ExpertsParallel`` styles, each with
    the styles of its own parameters (the plan's ``<module>.<parameter>`` entries), and the
    keys those take up."""
    from gpipe.parallel.experts import ExpertsParallel

    styles: dict[str, ParallelStyle] = {}
    used: set[str] = set()
    for key, style in plan.items():
        if style != "moe_tp_experts":
            continue
        kinds: dict[str, list[str]] = {"packed": [], "columns": [], "rows": []}
        for inner, inner_style in plan.items():
            owner, _, attr = inner.rpartition(".")
            if owner == key and inner_style in _EXPERT_PARAMETER_STYLES:
                kinds[_EXPERT_PARAMETER_STYLES[inner_style]].append(attr)
                used.add(inner)
        styles[key] = ExpertsParallel(**kinds)
        used.add(key)
    return styles, used


def torch_plan(plan: Mapping[str, str], model_name: str) -> dict[str, str | ParallelStyle]:
    """``plan``'s styles translated; refuses, in one line, a style that has no translation."""
    experts, used = _experts_styles(plan)
    translated: dict[str, str | ParallelStyle] = dict(experts)
    for key, style in plan.items():
        if key in used:
            continue
        if style not in HF_STYLES:
            raise ValueError(
                f"{model_name}'s tensor plan splits {key!r} as {style!r}, which gpipe does not "
                f"translate (it takes {sorted(HF_STYLES)}, and {sorted(_EXPERT_PARAMETER_STYLES)} "
                "for the parameters of a 'moe_tp_experts' module); pass Pipeline(tp_plan=...) "
                "instead"
            )
        translated[key] = HF_STYLES[style]()
    return translated


def _matches(pattern: str, name: str) -> bool:
    """Whether the dotted module name ``name`` matches ``pattern``, one name per ``*``."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(map(fnmatchcase, parts, atoms))


def held_plan(
    plan: Mapping[str, str | ParallelStyle], names: Iterable[str], elsewhere: set[str]
) -> dict[str, str | ParallelStyle]:
    """The entries of ``plan`` for the modules named ``names`` but not ``elsewhere`` (the
    stand-ins of a stage for modules other stages hold): a pattern stays a pattern unless it
    also matches a stand-in; then it becomes the held modules it matches."""
    names = [n for n in names if n]
    held: dict[str, str | ParallelStyle] = {}
    for key, style in plan.items():
        found = [n for n in names if _matches(key, n)]
        kept = [n for n in found if n not in elsewhere]
        if kept and len(kept) == len(found):
            held[key] = style
        else:
            held.update(dict.fromkeys(kept, style))
    return held
