"""How a saved Hugging Face folder's tensors become the tensors of the model's state dict, as
``from_pretrained`` makes them, read one at a time: a saved name is renamed (GPT-NeoX saves
its ``lm_head`` as ``embed_out``), and a mixture of experts saved one expert a tensor is
stacked into the model's one tensor per layer (and its gate and up maps joined), by
transformers' own checkpoint conversion mapping for the model.

Of transformers' conversion operations, stacking (``MergeModulelist``) and joining
(``Concatenate``) are read, which is what the mixture-of-experts families use; a tensor
another operation makes is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Merged", "names_as_loaded"]


@dataclass(frozen=True)
class Merged:
    """A tensor of the model that transformers builds from several saved ones as it loads:
    the saved names of each source pattern in the order of their index, each group stacked
    along ``stack_dim`` (when given) and the groups joined along ``join_dim`` (when given)."""

    name: str
    groups: tuple[tuple[str, ...], ...]
    stack_dim: int | None
    join_dim: int | None
    shape: tuple[int, ...]

    def build(self, read: Callable[[str], Tensor]) -> Tensor:
        """The model's tensor, from ``read`` (a saved tensor by its saved name)."""
        parts = [
            torch.stack([read(k) for k in keys], self.stack_dim)
            if self.stack_dim is not None
            else read(keys[0])
            for keys in self.groups
        ]
        tensor = torch.cat(parts, self.join_dim) if self.join_dim is not None else parts[0]
        if tuple(tensor.shape) != self.shape:
            raise ValueError(
                f"{self.name}: the saved tensors {list(self.groups[0][:2])}... make a tensor "
                f"of shape {list(tensor.shape)}, but the model's is {list(self.shape)}"
            )
        return tensor


def names_as_loaded(
    model: nn.Module, saved: Iterable[str], folder: Path
) -> tuple[dict[str, str], dict[str, Merged]]:
    """For each name a tensor is saved under in ``folder``, the name of ``model``'s state
    dict that ``from_pretrained`` loads it into: transformers' own checkpoint conversion
    mapping for the model (its renamings, and the legacy ones), with the base model's prefix
    added or dropped as it does; and the tensors it builds from several saved ones
    (``Merged``), by their names in the model. ``save_pretrained`` writes the reverse, so a
    folder it wrote reads back whole.

    Before transformers 5, which has no conversion mapping, and for a model that is no
    ``PreTrainedModel``, each tensor keeps its saved name."""
    saved = list(saved)
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        return {key: key for key in saved}, {}
    if not isinstance(model, PreTrainedModel):
        return {key: key for key in saved}, {}
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    names = model.state_dict()  # its names, to add or drop the base model's prefix by
    loaded: dict[str, str] = {}
    sources: dict[str, dict[str, list[str]]] = {}  # model name -> pattern -> saved names
    for key in saved:
        name, converted = rename_source_key(
            key, renamings, converters, model.base_model_prefix, names
        )
        if converted is None:
            loaded[key] = name
        else:
            sources.setdefault(name, {}).setdefault(converted, []).append(key)
    merged = {
        name: _merged(name, by_pattern, converters, names, folder, type(model).__name__)
        for name, by_pattern in sources.items()
    }
    return loaded, merged


def _merged(
    name: str,
    by_pattern: dict[str, list[str]],
    converters: list[Any],
    names: dict[str, Tensor],
    folder: Path,
    model_name: str,
) -> Merged:
    """How transformers builds ``name`` from the saved tensors ``by_pattern`` (its source
    patterns' saved names), if by stacking and joining; else a ValueError naming them."""
    first = next(iter(by_pattern.values()))[0]
    converter = next(c for c in converters if set(by_pattern) <= set(c.source_patterns))
    ops = [(type(op).__name__, op) for op in converter.operations]
    kinds = [kind for kind, _ in ops]
    stack = ops[0][1].dim if kinds[:1] == ["MergeModulelist"] else None
    rest = kinds[1:] if stack is not None else kinds
    join_op = ops[-1][1] if rest == ["Concatenate"] else None
    readable = (
        rest in ([], ["Concatenate"])
        and name in names
        and set(by_pattern) == set(converter.source_patterns)
        and (join_op is None or getattr(join_op, "num_shards_attribute", None) is None)
        and (stack is not None or all(len(keys) == 1 for keys in by_pattern.values()))
        and (join_op is not None or len(by_pattern) == 1)
    )
    if not readable:
        raise ValueError(
            f"{folder}: its tensor {first} is saved in a layout that transformers converts as "
            f"it loads a {model_name} ({'+'.join(kinds)} into {name!r}), which gpipe cannot "
            "read tensor by tensor: save the model's own state dict instead"
        )
    groups = tuple(_in_order(pattern, by_pattern[pattern]) for pattern in converter.source_patterns)
    return Merged(
        name,
        groups,
        stack,
        join_op.dim if join_op is not None else None,
        tuple(names[name].shape),
    )


def _in_order(pattern: str, keys: list[str]) -> tuple[str, ...]:
    """The saved names ``keys`` of ``pattern`` in the order of the number that stands for its
    ``*`` (the expert's index)."""
    number = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))

    def index(key: str) -> int:
        found = number.search(key)
        return int(found.group(1)) if found and found.groups() else 0

    return tuple(sorted(keys, key=index))
