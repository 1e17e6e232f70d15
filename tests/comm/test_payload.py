"""Payloads between stages: any pytree of tensors and plain values (gpipe.comm.payload)."""

import collections
import dataclasses
import enum
import os
import pickle
import sys
from typing import NamedTuple

import pytest
import torch

from gpipe.comm import envelope, payload
from gpipe.runtime.microbatch import check_payload, gather_payload, scatter_payload

from ..workers import run
from . import payload_cases as cases


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: object


class Named(NamedTuple):
    t: torch.Tensor
    n: int


def _wire(message):
    """Through the envelope's header and a byte buffer, as between two processes."""
    items, form, structure = payload.encode(message)
    described = envelope.describe(items, form, (1, 3, 4), structure)
    buffer = envelope.pack(items, described)
    words = envelope.header_words(buffer)
    got, form, info, _, structure = envelope.read(buffer, words)
    assert info == (1, 3, 4)
    return payload.decode(got, form, structure)


def test_trees_cross_the_wire_with_their_plain_leaves_and_requires_grad():
    x = torch.randn(2, 3, requires_grad=True)
    message = {
        "pair": Pair(a=x, b="text"),
        "named": Named(t=torch.arange(4), n=7),
        "list": [None, 1.5, True, torch.zeros(0)],
    }
    got = _wire(message)
    assert got["pair"].b == "text" and isinstance(got["pair"], Pair)
    assert torch.equal(got["pair"].a, x.detach()) and got["pair"].a.requires_grad
    assert isinstance(got["named"], Named) and got["named"].n == 7
    assert torch.equal(got["named"].t, torch.arange(4)) and not got["named"].t.requires_grad
    assert got["list"][:3] == [None, 1.5, True] and got["list"][3].shape == (0,)


class Color(enum.Enum):
    RED = "red"


def test_every_kind_of_node_and_plain_leaf_a_payload_may_hold_crosses_the_wire():
    x = torch.randn(2, 3)
    message = {
        "pair": Pair(a=x, b=Named(t=x, n=3)),
        "ordered": collections.OrderedDict(b=x, a=[1, (2.5, x)]),
        "default": collections.defaultdict(list, {"k": x}),
        "deque": collections.deque([x], maxlen=2),
        "size": torch.Size([2, 3]),
        "max": x.max(0),  # a torch.return_types structseq
        "plain": [torch.float64, torch.device("cpu"), torch.strided, torch.channels_last],
        "more": [Color.RED, complex(1, 2), b"raw", bytearray(b"buf"), slice(1, None), {1, 2}],
        "frozen": frozenset({"a"}),
        "none": None,
    }
    got = _wire(message)
    assert isinstance(got["pair"], Pair) and isinstance(got["pair"].b, Named)
    assert torch.equal(got["pair"].b.t, x) and got["pair"].b.n == 3
    assert type(got["ordered"]) is collections.OrderedDict and list(got["ordered"]) == ["b", "a"]
    assert got["ordered"]["a"][1][0] == 2.5 and torch.equal(got["ordered"]["a"][1][1], x)
    assert got["default"].default_factory is list and torch.equal(got["default"]["k"], x)
    assert got["deque"].maxlen == 2 and got["size"] == torch.Size([2, 3])
    assert type(got["max"]) is type(message["max"]) and torch.equal(got["max"].values, x.max(0)[0])
    assert got["plain"] == message["plain"] and got["more"] == message["more"]
    assert got["frozen"] == frozenset({"a"}) and got["none"] is None


def test_a_model_output_crosses_the_wire():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    logits = torch.randn(2, 5)
    got = _wire({"out": outputs.CausalLMOutput(logits=logits), "n": 1})["out"]
    assert type(got) is outputs.CausalLMOutput and got.loss is None
    assert torch.equal(got.logits, logits) and list(got.keys()) == ["logits"]


RAN = []


def _record(what):
    RAN.append(what)


class Calls:
    """A plain leaf whose unpickling would call ``call(*args)``."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


class Opaque:
    """A plain leaf of a class that is none of the kinds a payload may hold."""


def _structure_holding(leaf) -> bytes:
    _, structure = payload.describe_structure({"x": torch.ones(1), "leaf": 0})
    return pickle.dumps(payload.Structure(structure.spec, (payload.SLOT, leaf)))


def test_a_structure_naming_a_function_is_refused_by_name_and_nothing_runs():
    for call, args, named in [
        (eval, ("RAN.append('eval')",), "builtins.eval"),
        (os.system, ("true",), f"{os.system.__module__}.system"),
        (_record, ("ran",), f"{__name__}._record"),  # a function of an imported module
        (getattr, (Color, "RED"), "builtins.getattr"),
        (type, ("Made", (), {}), "builtins.type"),
    ]:
        data = _structure_holding(Calls(call, *args))
        with pytest.raises(pickle.UnpicklingError, match=rf"names {named}, which is not a type"):
            payload.decode((torch.ones(1),), payload.TREE, data)
    assert RAN == []


def test_a_structure_naming_a_class_of_no_allowed_kind_is_refused_by_name():
    data = _structure_holding(Opaque())
    with pytest.raises(pickle.UnpicklingError, match=rf"names {__name__}\.Opaque, which is not"):
        payload.decode((torch.ones(1),), payload.TREE, data)


def test_a_structure_naming_a_module_not_imported_here_is_refused_without_importing_it():
    assert "this" not in sys.modules  # importing it prints the Zen of Python
    data = b"\x80\x04cthis\ns\n."  # the global this.s
    with pytest.raises(pickle.UnpicklingError, match="this process has not imported this"):
        payload.decode((), payload.TREE, data)
    assert "this" not in sys.modules


def test_equal_plain_leaves_of_other_types_keep_their_type():
    """True == 1 == 1.0 and -0.0 == 0.0 (and hash alike): each still arrives as sent."""
    x = torch.zeros(2)
    for value in (True, 1, 1.0, 0.0, -0.0, False, 0):
        got = _wire({"x": x, "flag": value})["flag"]
        assert type(got) is type(value) and repr(got) == repr(value), (value, got)


def test_flat_messages_need_no_structure():
    x, y = torch.ones(2), torch.zeros(3)
    for message, form in [(x, payload.TENSOR), ((x,), payload.FLAT_TUPLE), ((x, None), 0)]:
        _, got_form, structure = payload.encode(message)
        assert got_form == form and structure == b""
    assert isinstance(_wire(x), torch.Tensor)
    assert isinstance(_wire((x,)), tuple) and len(_wire((x,))) == 1
    assert _wire((x, None, y))[1] is None


def test_tensors_of_and_with_tensors_keep_the_tree():
    value = {"a": torch.ones(1), "b": [2, torch.zeros(2)]}
    tensors = payload.tensors_of(value)
    assert len(tensors) == 2
    rebuilt = payload.with_tensors(value, [t + 1 for t in tensors])
    assert rebuilt["b"][0] == 2 and torch.equal(rebuilt["b"][1], torch.ones(2))


def test_batched_leaves_are_split_and_the_rest_given_whole():
    x = torch.arange(10).view(5, 2)
    value = {"x": x, "other": torch.ones(3), "scalar": torch.tensor(2.0), "k": 4}
    assert check_payload(value) == 5
    parts = scatter_payload(value, 2)
    assert [p["x"].size(0) for p in parts] == [3, 2]
    assert all(p["other"].shape == (3,) and p["k"] == 4 for p in parts)
    joined = gather_payload(parts)
    assert torch.equal(joined["x"], x) and joined["k"] == 4
    assert joined["other"].shape == (6,)  # not batched, but a tensor with dims: concatenated
    assert joined["scalar"].shape == (2,)  # 0-d tensors: one per micro-batch


def test_a_payload_without_a_batched_tensor_is_refused_by_name():
    with pytest.raises(TypeError, match=r"inputs must hold a tensor with a batch dimension"):
        check_payload({"a": 1, "b": "x"})
    with pytest.raises(TypeError, match="targets must hold a tensor"):
        check_payload({"a": torch.tensor(1.0)}, "targets")
    with pytest.raises(ValueError, match="empty batch"):
        check_payload({"a": torch.zeros(0, 2)})


def test_a_changed_structure_names_the_leaf():
    first = payload.signature({"h": torch.ones(1), "n": 1})
    payload.check_same_structure(first, {"h": torch.zeros(2), "n": 5}, "x")  # values may differ
    with pytest.raises(ValueError, match=r"at leaf \['extra'\]: absent in micro-batch 0"):
        payload.check_same_structure(first, {"h": torch.ones(1), "n": 1, "extra": 2}, "x")
    with pytest.raises(ValueError, match=r"at leaf \['n'\]: int in micro-batch 0, a tensor now"):
        payload.check_same_structure(first, {"h": torch.ones(1), "n": torch.ones(1)}, "x")
    with pytest.raises(ValueError, match=r"at leaf \[0\]: a tensor in micro-batch 0, int now"):
        payload.check_same_structure(payload.signature((torch.ones(1),)), (1, 2), "y")


def test_pytree_payloads_every_schedule_and_mode_exact():
    results = run(cases.every_schedule, 2)
    assert results[0] == results[1] == 36


def test_token_counts_weight_micro_batches_exactly():
    results = run(cases.token_counts, 2)
    # weighting by rows instead would be off: padding differs between micro-batches
    assert all(gap > 1e-3 for gap in results[0].values())


def test_a_structure_change_between_micro_batches_names_stage_and_leaf():
    results = run(cases.changing_structure, 2)
    assert results[0].startswith(
        "ValueError: the output of stage 0 changed structure within the step at leaf "
        "['odd']: a tensor in micro-batch 0, absent now"
    ), results[0]
