"""The JSON records of a run folder (``run.json``, each checkpoint's ``gpipe.json``), read as
data of a known shape.

A run folder may come from someone else, so a record is checked against the dataclasses it
was written from (the GPT's config, ``TrainModel``, ``TrainOptions``) before any of it is
used: a field of the wrong type or a name gpipe does not know is refused with one line naming
the file and the field, rather than failing somewhere deep in a spawned process.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

__all__ = ["check_fields", "checked_run_record", "dataclass_types", "read_json"]

_RECORD_FIELDS: dict[str, Any] = {
    "model": dict[str, Any],
    "train": dict[str, Any],
    "config": dict[str, Any],
    "job": str | None,
    "step": int,
    "stages": int,
    "data_parallel": int,
    "tensor_parallel": int,
    "balance": list[int],
}


def _matches(value: Any, hint: Any) -> bool:
    """Whether a JSON value has the type ``hint`` (the annotations dataclasses here use)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        _, item = typing.get_args(hint)
        return isinstance(value, dict) and all(
            isinstance(k, str) and _matches(v, item) for k, v in value.items()
        )
    return False


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def check_fields(values: Any, types_: dict[str, Any], where: str, *, others: bool = False) -> None:
    """ValueError unless ``values`` is a JSON object whose keys are among ``types_`` (or,
    with ``others``, whatever else it holds is left alone) and whose values have those
    types; ``where`` names it in the message."""
    if not isinstance(values, dict):
        raise ValueError(f"{where} is a {type(values).__name__}, expected an object")
    unknown = sorted(set(values) - set(types_))
    if unknown and not others:
        raise ValueError(f"{where} has unknown fields {unknown}")
    for name, value in values.items():
        if name in types_ and not _matches(value, types_[name]):
            raise ValueError(
                f"{where}.{name} is {value!r} ({type(value).__name__}), "
                f"expected {_type_name(types_[name])}"
            )


def dataclass_types(cls: type) -> dict[str, Any]:
    """Each field of the dataclass ``cls`` by name, with its type."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def read_json(path: Path) -> Any:
    """The JSON value in the file ``path``; a ValueError naming the file if it cannot be read
    or is not JSON."""
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: unreadable ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None


def checked_run_record(path: Path, *, require_step: bool = False) -> dict[str, Any]:
    """The record in the JSON file ``path``, checked: the fields gpipe writes have their
    types, and its model (the GPT's config, or a ``TrainModel``) and its training options
    have the fields gpipe knows. Fields of the caller's own (``save_checkpoint``'s
    ``description`` may hold any) are left alone. ``require_step`` for a checkpoint's
    description. ValueError naming the file otherwise."""
    from gpipe.models.gpt import GPTConfig
    from gpipe.training.models.sources import TrainModel
    from gpipe.training.options import TrainOptions

    record = read_json(path)
    try:
        check_fields(record, _RECORD_FIELDS, "the record", others=True)
        if require_step and "step" not in record:
            raise ValueError("the record has no step")
        model = record.get("model", {})
        if model.get("source", "gpt") == "gpt":
            gpt = {k: v for k, v in model.items() if k != "source"}
            check_fields(gpt, dataclass_types(GPTConfig), "model")
        else:
            check_fields(model, dataclass_types(TrainModel), "model")
        check_fields(record.get("train", {}), dataclass_types(TrainOptions), "train")
        _check_values(record)
    except ValueError as exc:
        raise ValueError(f"{path}: not a record gpipe wrote: {exc}") from None
    return record


_COUNTS = ("stages", "data_parallel", "tensor_parallel")  # of the record, each at least 1
_GPT_SIZES = ("n_layer", "d_model", "n_head", "d_ff", "vocab_size", "seq_len")


def _check_values(record: dict[str, Any]) -> None:
    """The values of the fields that start processes or size tensors: counts and sizes of
    at least 1, stages of at least one layer each, as many as the processes or a multiple
    (several a process), that cut the GPT's layers, and a known precision (the types are
    checked before; a record edited by someone else may still say 0)."""
    from gpipe.models.gpt import GPTConfig
    from gpipe.training.options import PRECISIONS

    if record.get("step", 0) < 0:
        raise ValueError(f"the record's step is {record['step']}")
    for name in _COUNTS:
        if record.get(name, 1) < 1:
            raise ValueError(f"the record's {name} is {record[name]}, expected at least 1")
    balance = record.get("balance")
    if balance is not None:
        if not balance or min(balance) < 1:
            raise ValueError(
                f"the record's balance is {_shown(balance)}: expected layers per stage"
            )
        if len(balance) % record.get("stages", 1):
            raise ValueError(
                f"the record's balance holds {len(balance)} stages, not a multiple of its "
                f"{record['stages']} processes"
            )
    model = record.get("model", {})
    if model.get("source", "gpt") == "gpt":
        for name in _GPT_SIZES:
            if model.get(name) is not None and model[name] < 1:
                raise ValueError(f"the model's {name} is {model[name]}, expected at least 1")
        layers = model.get("n_layer", GPTConfig().n_layer) + 2  # embedding, blocks, head
        if balance is not None and sum(balance) != layers:
            raise ValueError(
                f"the record's balance {_shown(balance)} cuts {sum(balance)} layers, not {layers}"
            )
    precision = record.get("train", {}).get("precision", "fp32")
    if precision not in PRECISIONS:
        raise ValueError(f"the run's precision is {precision!r}, not one of {sorted(PRECISIONS)}")


def _shown(balance: list[int]) -> str:
    """A balance for a one-line message: a long one (an edited record's, say) cut short."""
    if len(balance) <= 16:
        return str(balance)
    return f"[{', '.join(map(str, balance[:8]))}, ... ({len(balance)} stages)]"
