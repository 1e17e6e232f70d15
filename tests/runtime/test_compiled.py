"""Pipeline(compile=...): every layer compiled in place, under each schedule and mode of
re-materialization, equal to the eager pipeline and to un-pipelined training in float64,
across real processes; under a split backward the layers train eager and run compiled in
forward passes. The tests compile with AOTAutograd's graphs and no code generation
(backend "aot_eager"); BENCHMARKS.md measures the default backend."""

import copy
import re
import warnings

import pytest
import torch
from torch import nn

from gpipe import Pipeline
from gpipe.runtime.compiled import check_compile, compile_layers

from ..workers import run
from . import compiled_cases as cases

V_BALANCE = [2, 2, 2, 3]  # a V of four stages on two processes


@pytest.mark.parametrize("checkpoint", ["never", "always", "layers"])
@pytest.mark.parametrize(
    ("schedule", "balance"),
    [("gpipe", [4, 5]), ("1f1b", [4, 5]), ("zero-bubble", [4, 5]), ("zero-bubble-v", V_BALANCE)],
)
def test_compiled_layers_train_as_eager_ones(schedule, balance, checkpoint):
    results = run(cases.compiled_against_eager, 2, (schedule, balance, checkpoint), threads=1)
    # the Probe, the last layer, sits on the last stage: rank 1, or rank 0 at the V's end
    last = 0 if schedule == "zero-bubble-v" else 1
    split = schedule.startswith("zero-bubble")
    assert results[last]["probe_compiled_calls"][False] == 0
    assert results[last]["probe_compiled_calls"][True] > 0  # the forward pass, at least
    # a split backward keeps its split: the layers train eager
    trained_compiled = results[last]["probe_compiled_calls_in_training"][True]
    assert trained_compiled == 0 if split else trained_compiled > 0
    for result in results.values():
        assert result["compiled"] and result["eager_untouched"]
        assert len(result["warned"]) == (1 if split else 0)
        if split:
            assert (
                f"compile=True under '{schedule}', whose backward is split" in (result["warned"][0])
            )
            assert "the layers train eager" in result["warned"][0]


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        ("yes", TypeError, "compile must be True, False or a dict of torch.compile's keyword"),
        (1, TypeError, r"keyword arguments, got 1 \(int\)$"),
        (
            {1: "x"},
            TypeError,
            r"compile's keys must be torch.compile's keyword names .*got \{1: 'x'\}",
        ),
        ({"backend": "nope"}, ValueError, "backend 'nope' is not one torch.compile knows: "),
    ],
)
def test_a_bad_compile_is_refused(value, error, words):
    with pytest.raises(error, match=words):
        check_compile(value)


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        ({"bogus": 1}, TypeError, "unexpected keyword argument 'bogus'"),
        ({"mode": "fastest"}, ValueError, "Unrecognized mode=fastest"),
        ({"dynamic": "yes"}, ValueError, "Expected enable to be a bool"),
        ({"options": {"no_such_option": 1}}, ValueError, "Unexpected optimization option"),
        ({"backend": 3}, TypeError, "backend must be a name or a callable, got 3"),
        ({"backend": None}, TypeError, "backend must be a name or a callable, got None"),
    ],
)
def test_options_torch_compile_does_not_take_are_refused_in_one_line_naming_compile(
    monkeypatch, value, error, words
):
    """Checked when the pipeline is built, before any process group work: not by every
    rank's torch.compile after it, nor at the first step's forward (a backend that is not
    callable fails only there, and the other ranks then lose its stage)."""
    with pytest.raises(error, match=f"^compile={re.escape(repr(value))}: .*{words}") as caught:
        check_compile(value)
    assert "\n" not in str(caught.value)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(error, match=f"^compile={re.escape(repr(value))}: "):
        Pipeline(nn.Sequential(nn.Linear(2, 2)), [1], compile=value)


def test_one_whole_graph_a_layer_is_refused_on_sub_sequences():
    """A sub-sequence's attention over the earlier ones runs outside the graphs, which
    fullgraph=True forbids: refused when the pipeline is built, not at the first step."""
    assert check_compile({"fullgraph": True}) == {"fullgraph": True}
    with pytest.raises(ValueError, match="fullgraph=True cannot run seq_chunks"):
        check_compile({"fullgraph": True}, sub_sequences=True)


def test_what_compile_takes():
    assert check_compile(False) is None and check_compile(None) is None
    assert check_compile(True) == {}
    assert check_compile({"backend": "aot_eager"}) == {"backend": "aot_eager"}


def test_compile_with_tensor_parallel_is_refused_before_any_process_group_work(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="compile=True is not supported with tensor_parallel"):
        Pipeline(
            nn.Sequential(nn.Linear(2, 2)),
            [1],
            compile=True,
            tensor_parallel=2,
            tp_plan={"0": "colwise"},
        )


def _no_tanh(graph_module, example_inputs):
    """A backend that cannot compile tanh: it compiles the other layers' graphs as they are."""
    if any("tanh" in str(node.target) for node in graph_module.graph.nodes):
        raise RuntimeError("this backend cannot compile tanh")
    _no_tanh.compiled += 1
    return graph_module.forward


@pytest.mark.parametrize("split_backward", [False, True])
def test_a_layer_torch_compile_fails_on_runs_eager_and_says_so_once(split_backward):
    """The other layers stay compiled; the step's results are eager ones; an input that eager
    code refuses too raises eager code's own error, not a fall back."""
    torch.compiler.reset()  # the linear layers' code compiled by the case before, and kept
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    eager = copy.deepcopy(layers)
    _no_tanh.compiled = 0
    compile_layers(layers, {"backend": _no_tanh}, split_backward=split_backward)
    x = torch.randn(5, 3, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            layers(x).sum().backward()
            with torch.no_grad():  # where a split backward's layers run compiled
                torch.testing.assert_close(layers(x), eager(x), rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
            layers(torch.randn(5, 7, dtype=torch.float64))
    eager(x).sum().backward()
    for (name, p), q in zip(layers.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, 3 * q.grad, msg=name)
    said = [str(w.message) for w in caught if "compile:" in str(w.message)]
    assert said == [
        "compile: layer '1' (Tanh) cannot be compiled, so it runs eager (BackendCompilerFailed: "
        "backend='_no_tanh' raised: RuntimeError: this backend cannot compile tanh)"
    ]
    assert _no_tanh.compiled >= 2  # both linear layers
