"""Payloads: what a ``Pipeline`` stage takes and returns, any pytree of tensors and plain values.

A payload is a tensor, a tuple of tensors, or any pytree (``torch.utils._pytree``) of them:
lists, dicts, NamedTuples, dataclasses, Hugging Face ``ModelOutput`` ..., whose leaves may
also be plain values (ints, floats, bools, None, strings, enums, dtypes, devices). Its
*tensors* are its tensor leaves in flattening order; they are what autograd and the wire
see. Its *structure* is everything else: the tree and the plain leaves, sent along as a
small pickled description when it is not a bare tensor or a flat tuple.

Dataclasses that no one registered with pytree are registered on first sight, so that their
fields travel as leaves rather than the whole object as one opaque value.

A received structure is unpickled by an allow-list, not trusted because a process of the
same job wrote it: a pickle may name any importable function and call it, so the bytes of
one message would otherwise be enough to run code in the process that reads it. The
globals a structure may name are what a ``TreeSpec`` and a ``Structure`` pickle to; builtins
that are plain values or containers (never ``eval``, ``getattr``, ``type`` ...);
``torch.device`` and the dtypes, layouts and memory formats; and, from modules this process
has already imported (none is imported on a message's word), classes that are registered
pytree nodes, dataclasses, named tuples, ``ModelOutput`` subclasses or enums (an enum member
is rebuilt by looking up its value). A message naming anything else — a function, another
class, a module not imported here — is refused with a ``pickle.UnpicklingError`` that
names it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import io
import pickle
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

__all__ = [
    "FLAT_TUPLE",
    "TENSOR",
    "TREE",
    "Structure",
    "check_same_structure",
    "decode",
    "describe_structure",
    "encode",
    "flatten",
    "is_flat",
    "signature",
    "tensors_of",
    "with_tensors",
]

# How a message's tensors make up the value that was sent: a tuple of them, the tensor
# itself, or a tree described by its structure.
FLAT_TUPLE, TENSOR, TREE = 0, 1, 2


class _TensorSlot:
    """Where a tensor leaf sits in a structure."""

    def __repr__(self) -> str:
        return "<tensor>"

    def __reduce__(self) -> str:
        return "SLOT"


SLOT = _TensorSlot()


@dataclasses.dataclass(frozen=True)
class Structure:
    """A payload less its tensors: the tree, and its leaves with each tensor replaced by
    ``SLOT``."""

    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]


def is_flat(value: object) -> bool:
    """A tensor, or a tuple of tensors (and Nones): the forms that need no structure."""
    if isinstance(value, Tensor):
        return True
    return type(value) is tuple and all(v is None or isinstance(v, Tensor) for v in value)


def _register_dataclasses(leaves: Sequence[Any]) -> bool:
    """Register the unregistered dataclass types among ``leaves``; whether there were any."""
    found = False
    for leaf in leaves:
        cls = type(leaf)
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            if cls not in pytree.SUPPORTED_NODES:
                pytree.register_dataclass(cls)
            found = True
    return found


def flatten(value: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """``tree_flatten``, with unregistered dataclasses registered first."""
    leaves, spec = pytree.tree_flatten(value)
    if _register_dataclasses(leaves):
        leaves, spec = pytree.tree_flatten(value)
    return leaves, spec


def tensors_of(value: Any) -> tuple[Tensor, ...]:
    """The tensor leaves of a payload, in flattening order."""
    if isinstance(value, Tensor):
        return (value,)
    if type(value) is tuple and all(isinstance(v, Tensor) for v in value):
        return value
    leaves, _ = flatten(value)
    return tuple(leaf for leaf in leaves if isinstance(leaf, Tensor))


def with_tensors(value: Any, tensors: Sequence[Tensor | None]) -> Any:
    """``value`` with its tensor leaves replaced, in order, by ``tensors``."""
    if isinstance(value, Tensor):
        (tensor,) = tensors
        return tensor
    if type(value) is tuple and all(isinstance(v, Tensor) for v in value):
        return tuple(tensors)
    leaves, spec = flatten(value)
    given = iter(tensors)
    replaced = [next(given) if isinstance(leaf, Tensor) else leaf for leaf in leaves]
    return pytree.tree_unflatten(replaced, spec)


def describe_structure(value: Any) -> tuple[tuple[Tensor, ...], Structure]:
    """A payload's tensors and its structure."""
    leaves, spec = flatten(value)
    tensors = tuple(leaf for leaf in leaves if isinstance(leaf, Tensor))
    slots = tuple(SLOT if isinstance(leaf, Tensor) else leaf for leaf in leaves)
    return tensors, Structure(spec, slots)


def _rebuild(structure: Structure, tensors: Sequence[Tensor | None]) -> Any:
    given = iter(tensors)
    leaves = [next(given) if leaf is SLOT else leaf for leaf in structure.leaves]
    return pytree.tree_unflatten(leaves, structure.spec)


def _pickled(structure: Structure) -> bytes:
    # equal structures may still differ in their leaves' types (True == 1 == 1.0) or in a
    # float's sign (-0.0 == 0.0), which the bytes must keep: both are in the cache's key
    exact = tuple(
        (type(leaf), repr(leaf) if isinstance(leaf, float) else None) for leaf in structure.leaves
    )
    return _pickled_exactly(structure, exact)


@functools.lru_cache(maxsize=256)
def _pickled_exactly(structure: Structure, exact: tuple[tuple[type, str | None], ...]) -> bytes:
    return pickle.dumps(structure)


# The globals a structure may name outright: what a Structure and a TreeSpec pickle to, and
# builtins that are plain values or containers.
_PLAIN_BUILTINS = (
    "bool",
    "int",
    "float",
    "complex",
    "str",
    "bytes",
    "bytearray",
    "tuple",
    "list",
    "dict",
    "set",
    "frozenset",
    "slice",
    "range",
    "Ellipsis",
    "NotImplemented",
)
_NAMED = frozenset(
    {
        (__name__, "Structure"),
        (__name__, "SLOT"),
        ("torch.utils._pytree", "TreeSpec"),
        ("torch.utils._pytree", "LeafSpec"),
        ("collections", "namedtuple"),  # the node type pytree gives every NamedTuple
        ("torch", "device"),
        ("torch.serialization", "_get_layout"),  # how torch.strided and its kind pickle
        *(("builtins", name) for name in _PLAIN_BUILTINS),
    }
)
_HELD = "tensors, plain builtins, pytree nodes, dataclasses, named tuples, enums, ModelOutput"


def _imported(module: str, name: str) -> object:
    """``module.name`` as this process already has it, or None: never importing a module,
    nor calling a module's or a class's ``__getattr__``."""
    found: object = sys.modules.get(module)
    for part in name.split("."):
        if not isinstance(found, (types.ModuleType, type)):
            return None
        found = vars(found).get(part)
    return found


def _may_hold(found: object) -> bool:
    """Whether a payload's structure may hold ``found``, a class or value a message names."""
    if isinstance(found, (torch.dtype, torch.layout, torch.memory_format, enum.Enum)):
        return True
    if not isinstance(found, type):
        return False
    return (
        found in pytree.SUPPORTED_NODES
        or dataclasses.is_dataclass(found)
        or (issubclass(found, tuple) and hasattr(found, "_fields"))
        or issubclass(found, enum.Enum)
        or any(
            c.__name__ == "ModelOutput" and c.__module__.startswith("transformers.")
            for c in found.__mro__
        )
    )


class _StructureUnpickler(pickle.Unpickler):
    """Unpickles a structure, resolving only the globals a payload may hold."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NAMED:
            return super().find_class(module, name)
        found = _imported(module, name)
        if found is not None and _may_hold(found):
            return found
        unknown = "" if module in sys.modules else f" (this process has not imported {module})"
        raise pickle.UnpicklingError(
            f"a payload's structure names {module}.{name}, which is not a type a payload may "
            f"hold ({_HELD}){unknown}"
        )


@functools.lru_cache(maxsize=256)
def _unpickled(data: bytes) -> Structure:
    with warnings.catch_warnings():  # torch's own unpickling of a TreeSpec warns of itself
        warnings.filterwarnings("ignore", "`isinstance\\(treespec, LeafSpec\\)`", FutureWarning)
        structure = _StructureUnpickler(io.BytesIO(data)).load()
    if not isinstance(structure, Structure):
        raise TypeError(f"a message's structure is a {type(structure).__name__}")
    _register_nodes(structure.spec)
    return structure


def _register_nodes(spec: pytree.TreeSpec) -> None:
    """Register the dataclasses a received structure uses, as the sender had them."""
    if (
        isinstance(spec.type, type)
        and dataclasses.is_dataclass(spec.type)
        and spec.type not in pytree.SUPPORTED_NODES
    ):
        pytree.register_dataclass(spec.type)
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    for child in children:
        _register_nodes(child)


def _serialized(structure: Structure) -> bytes:
    try:
        return _pickled(structure)
    except TypeError:  # a leaf that cannot be hashed: pickle it every time
        return pickle.dumps(structure)


def encode(message: Any) -> tuple[tuple[Tensor | None, ...], int, bytes]:
    """What goes on the wire: the tensors, how they make up the message, its structure."""
    if isinstance(message, Tensor):
        return (message,), TENSOR, b""
    if is_flat(message):
        return message, FLAT_TUPLE, b""
    tensors, structure = describe_structure(message)
    return tensors, TREE, _serialized(structure)


def decode(items: tuple[Tensor | None, ...], form: int, structure: bytes) -> Any:
    """The message ``encode`` described, from the tensors received."""
    if form == TENSOR:
        return items[0]
    if form == FLAT_TUPLE:
        return items
    return _rebuild(_unpickled(structure), items)


def signature(value: Any) -> Any:
    """What two micro-batches' payloads must share: the tree, and where its tensors are (not
    the tensors, nor the plain leaves' values). Small: it holds no tensor."""
    if isinstance(value, Tensor):
        return "tensor"
    if is_flat(value):
        return len(value)
    _, structure = describe_structure(value)
    return structure


def _paths(value: Any) -> dict[str, str]:
    """Each leaf's path (as ``keystr`` writes it) and what it is."""
    if isinstance(value, Structure):
        value = pytree.tree_unflatten(list(value.leaves), value.spec)
    elif isinstance(value, int):  # a flat tuple's signature: its length
        value = (SLOT,) * value
    elif value == "tensor":
        value = SLOT
    found, _ = pytree.tree_flatten_with_path(value)
    return {
        pytree.keystr(path): "a tensor"
        if leaf is SLOT or isinstance(leaf, Tensor)
        else type(leaf).__name__
        for path, leaf in found
    }


def _same(first: Any, now: Any) -> bool:
    if isinstance(first, Structure) and isinstance(now, Structure):
        if first.spec != now.spec:
            return False
        return all(
            (a is SLOT) == (b is SLOT) for a, b in zip(first.leaves, now.leaves, strict=True)
        )
    return type(first) is type(now) and first == now


def check_same_structure(first: Any, value: Any, where: str) -> None:
    """Raise if ``value`` is not shaped like the payload whose ``signature`` is ``first``:
    the same tree, tensors in the same places. ``where`` names whose value it is."""
    now = signature(value)
    if _same(first, now):
        return
    before, after = _paths(first), _paths(now)
    for path in sorted(set(before) | set(after)):
        if before.get(path) != after.get(path):
            was = before.get(path, "absent")
            is_now = after.get(path, "absent")
            leaf = path or "the value itself"
            raise ValueError(
                f"{where} changed structure within the step at leaf {leaf}: {was} in "
                f"micro-batch 0, {is_now} now; every micro-batch of a step must give the same "
                "tree, with tensors in the same places"
            )
    raise ValueError(
        f"{where} changed structure within the step; every micro-batch of a step must give "
        "the same tree, with tensors in the same places"
    )
