"""Layers compiled one by one with ``torch.compile``, under every schedule.

Each layer of a stage (each child of its ``nn.Sequential``: a transformer block, an
embedding, a head) gets its ``forward`` compiled in place, so its parameters keep their names
and its hooks run around the compiled code. Re-materialization works as it does for eager
layers: a graph-free forward, then the same compiled forward again with a graph. A layer
that ``torch.compile`` fails on (a backend that cannot compile one of its operations, code
Dynamo cannot trace) runs eager from then on, and says so once; the others stay compiled.

A split backward (the zero-bubble family) asks autograd for the input gradients first (B),
keeping the graph, and for the weight gradients later (W), in the slots where the schedule
has nothing else to run. A compiled layer is one node in the autograd graph whose backward
computes the gradients of its inputs and of its parameters together, and frees what it saved
as it runs (AOTAutograd's donated buffers), so it can be neither split nor kept for a second
pass. Under such a schedule the layers therefore train eager, keeping the split the schedule
is chosen for (a compiled stage that ran its whole backward at B measured 9 % slower than
eager zero-bubble on a CPU: BENCHMARKS.md, section 26), and run compiled where no graph is
built: evaluation and forward passes.

Sub-sequences (``seq_chunks``) run each layer's ``forward_cached`` rather than its
``forward``; it is compiled too. What changes from one sub-sequence to the next is the
cache's Python state (how many earlier sub-sequences it holds), so a layer keeps its cache
outside the graphs (``torch.compiler.disable``, as the built-in GPT's attention does), or
it compiles again for each number of earlier sub-sequences.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from gpipe.runtime.recompute import is_checkpointing

__all__ = [
    "CompileOptions",
    "check_backend",
    "check_compile",
    "compile_layers",
    "warn_eager_training",
]

CompileOptions = Mapping[str, Any]


def check_compile(
    compile: object, *, split_parameters: bool = False, sub_sequences: bool = False
) -> CompileOptions | None:
    """``compile=`` as ``torch.compile``'s keyword arguments (None: no compilation), its
    backend one that ``torch.compile`` knows; refused where parameters are split over ranks
    (``tensor_parallel``, ``shard``), not yet tried, and as one whole graph a layer (
    ``fullgraph``) on sub-sequences, whose attention over the earlier ones' keys and values
    runs outside the graphs."""
    if compile is False or compile is None:
        return None
    if compile is True:
        options: dict[str, Any] = {}
    elif isinstance(compile, Mapping):
        if not all(isinstance(k, str) for k in compile):
            raise TypeError(
                f"compile's keys must be torch.compile's keyword names (strings), got {compile!r}"
            )
        options = dict(compile)
    else:
        raise TypeError(
            "compile must be True, False or a dict of torch.compile's keyword arguments, "
            f"got {compile!r} ({type(compile).__name__})"
        )
    if split_parameters:
        raise ValueError(
            "compile=True is not supported with tensor_parallel or shard yet: pass "
            "compile=False, or train without them"
        )
    if sub_sequences and options.get("fullgraph"):
        raise ValueError(
            "compile with fullgraph=True cannot run seq_chunks: a layer's attention over the "
            "earlier sub-sequences' keys and values runs outside the compiled graphs; leave "
            "fullgraph out"
        )
    check_backend(options.get("backend", "inductor"))
    _check_options(compile, options)
    return options


def _check_options(given: object, options: dict[str, Any]) -> None:
    """Refuse, in one line naming ``compile=``, what ``torch.compile`` refuses of
    ``options`` (a keyword it does not take, a mode, an inductor option or a ``dynamic`` it
    does not know), and a backend that is neither a name nor a callable, which it would
    refuse only at the first forward: here, when the pipeline is built, rather than on
    every rank after the process group is joined. Nothing is compiled (``torch.compile``
    compiles at the first call)."""
    backend = options.get("backend", "inductor")
    if not (isinstance(backend, str) or callable(backend)):
        raise TypeError(
            f"compile={given!r}: torch.compile's backend must be a name or a callable, "
            f"got {backend!r}"
        )
    try:
        torch.compile(_nothing, **options)
    except (TypeError, ValueError, RuntimeError, AssertionError) as exc:
        error = TypeError if isinstance(exc, TypeError) else ValueError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise error(f"compile={given!r}: torch.compile refuses these options: {first}") from None


def _nothing(x: Any) -> Any:
    """What the options are tried on."""
    return x


def check_backend(backend: object) -> None:
    """Refuse a backend named that ``torch.compile`` does not know (a callable is taken as
    given), before any process waits on a compilation that fails."""
    if not isinstance(backend, str):
        return
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(
            f"compile's backend {backend!r} is not one torch.compile knows: {', '.join(known)}"
        )


def warn_eager_training(schedule: str) -> None:
    """Say that under ``schedule``, whose backward is split, the layers train eager."""
    warnings.warn(
        f"compile=True under {schedule!r}, whose backward is split: a compiled layer's "
        "backward computes its input and weight gradients at once, so the layers train "
        "eager, keeping the schedule's split, and run compiled in evaluation and forward "
        "passes only",
        stacklevel=3,
    )


def compile_layers(
    layers: nn.Sequential,
    options: CompileOptions,
    *,
    split_backward: bool = False,
    sub_sequences: bool = False,
) -> None:
    """Compile the ``forward`` of each of ``layers``' children in place, and with
    ``sub_sequences`` their ``forward_cached`` too (what a sub-sequence runs); under a
    ``split_backward``, for the passes that build no graph only."""
    methods = ("forward", "forward_cached") if sub_sequences else ("forward",)
    for name, layer in layers.named_children():
        for method in methods:
            eager = getattr(layer, method, None)
            if eager is None:
                continue
            where = f"layer {name!r} ({type(layer).__name__})" + (
                f"'s {method}" if method != "forward" else ""
            )
            compiled = _eager_where_it_fails(where, eager, torch.compile(eager, **options))
            setattr(layer, method, _graph_free(eager, compiled) if split_backward else compiled)


def _eager_where_it_fails(
    where: str, eager: Callable[..., Any], compiled: Callable[..., Any]
) -> Callable[..., Any]:
    """``compiled``, until ``torch.compile`` fails on it (a backend that cannot compile one
    of its operations, code Dynamo cannot trace): then ``eager`` from that call on, said
    once. An input that eager code refuses too raises eager code's own error, and the layer
    stays compiled."""
    failed = False

    def forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal failed
        if failed:
            return eager(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:
            if not _compile_failed(exc):
                raise
            out = eager(*args, **kwargs)
            failed = True
            warnings.warn(
                f"compile: {where} cannot be compiled, so it runs eager "
                f"({type(exc).__name__}: {_first_paragraph(exc)})",
                stacklevel=2,
            )
            return out

    return forward


def _compile_failed(exc: Exception) -> bool:
    """Whether ``exc`` is ``torch.compile`` failing (Dynamo's errors, the backend's wrapped
    in them), not the layer's own code: imported here, where Dynamo already is, as
    ``import gpipe`` does not load it."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(exc, TorchDynamoException)


def _first_paragraph(exc: BaseException) -> str:
    """What ``exc`` says before its first blank line, on one line and at most 200
    characters (torch's messages go on with hints and logging advice for a page)."""
    text = str(exc).strip().split("\n\n", 1)[0]
    said = " ".join(line.strip() for line in text.splitlines() if line.strip())
    return (said[:197] + "...") if len(said) > 200 else said or "no message"


def _graph_free(eager: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` where autograd records nothing, ``eager`` in training: there, and in the
    graph-free first pass of re-materialization, whose recomputation must match it."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() or is_checkpointing():
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    return forward
