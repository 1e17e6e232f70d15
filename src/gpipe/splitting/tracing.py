"""Tracing a model into one graph with ``torch.export``, every input dimension dynamic.

Every dimension of every tensor input is traced as ``Dim.AUTO``: dynamic unless the model
fixes it, so the stages cut from the graph run micro-batches of any size and sequences of
any length without tracing again. ``torch.export`` fixes a dimension whose example size is
1 (its 0/1 specialisation), so the examples need at least two rows; the graph it traces
for two or more rows then also runs a 1-row micro-batch, and ``check_one_row`` makes sure
the model does not take another path for one row (a ``if x.size(0) == 1`` branch).

A model ``torch.export`` cannot trace ends in a ``TraceError`` of one line: what stopped the
tracer, the line of the model it stopped at, and what to do.

A model traced on the meta device (the way a model too large for one process is split) takes
the branches its code takes for a device that is neither a CPU nor Apple's GPU: Hugging Face's
mixtures of experts count tokens per expert with ``torch.histc`` on integers there, which
PyTorch's CPU kernel refuses. The trace counts them in float32 instead (exact below 2^24
tokens), cast back, so its graph runs on every device.

A Hugging Face model whose config keeps a key/value cache (``use_cache``, on by default in
most) returns the cache object beside its logits, which ``torch.export`` cannot give back:
``without_cache_output`` traces it with the cache off, as training runs it. One with its own
activation checkpointing on (``gradient_checkpointing_enable()``) is traced with it off
(``without_own_checkpointing``): a graph keeps no checkpoint of the model's code (the
pipeline re-materializes whole stages, ``checkpoint=``), and under ``use_reentrant=True`` the
layers would be no places to cut.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

__all__ = [
    "TraceError",
    "check_one_row",
    "trace",
    "without_cache_output",
    "without_own_checkpointing",
]


class TraceError(RuntimeError):
    """``torch.export`` could not trace the model; ``export_error`` holds its own error."""

    def __init__(self, message: str, export_error: BaseException) -> None:
        super().__init__(message)
        self.export_error = export_error


def _dynamic(value: Any) -> Any:
    """Every dimension of every tensor leaf dynamic (``Dim.AUTO``); other leaves static."""
    return pytree.tree_map(
        lambda leaf: {d: Dim.AUTO for d in range(leaf.dim())} if isinstance(leaf, Tensor) else None,
        value,
    )


def _dynamic_shapes(
    model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {name: _dynamic(value) for name, value in bound.arguments.items()}


def _check_rows(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    for path, leaf in pytree.tree_flatten_with_path((args, dict(kwargs)))[0]:
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.size(0) == 1:
            where = (
                "example_args" + pytree.keystr(path[1:])
                if path[0] == pytree.SequenceKey(0)
                else ("example_kwargs" + pytree.keystr(path[1:]))
            )
            raise ValueError(
                f"{where} has 1 row; give examples of at least 2 rows: torch.export fixes a "
                "dimension whose example size is 1, and the stages could then run nothing else"
            )


_USER_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\w+)\n\s+(.+)')


def _reason(exc: BaseException) -> str:
    """The first line of the tracer's reason and where in the model it stopped."""
    text = str(exc).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    found = _USER_LINE.findall(text)
    where = ""
    if found:
        path, line, function, code = found[-1]
        where = f" at {path}:{line} in {function}: `{code.strip()}`"
    return f"{first}{where}"


def _layer(model: nn.Module, exc: BaseException) -> str:
    """Where in ``model`` the tracer stopped: the innermost of its submodules whose code was
    running (`` in its layer blocks.3 (Gate)``), read from the frames of the error and of
    the errors it was raised from; empty if it stopped in the model's own code."""
    names = {id(module): name for name, module in model.named_modules() if name}
    found = ""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        trace = error.__traceback__
        while trace is not None:
            owner = trace.tb_frame.f_locals.get("self")
            name = names.get(id(owner)) if isinstance(owner, nn.Module) else None
            if name is not None:
                found = f" in its layer {name} ({type(owner).__name__})"
            trace = trace.tb_next
        error = error.__cause__ or error.__context__
    return found


def _advice(exc: BaseException) -> str:
    name = type(exc).__name__
    if "DataDependent" in name or "data-dependent" in str(exc):
        return (
            "the model branches on a tensor's values; compute the branch with torch.cond, move "
            "it out of the model, or give GPipe/Pipeline an nn.Sequential whose layers keep "
            "it whole"
        )
    return (
        "make that code traceable by torch.export (see its documentation on non-strict "
        "tracing), or give GPipe/Pipeline an nn.Sequential whose layers keep it whole"
    )


@contextlib.contextmanager
def without_cache_output(model: nn.Module, kwargs: Mapping[str, Any]) -> Iterator[None]:
    """Inside it, ``model``'s config keeps no key/value cache, unless the examples pass
    ``use_cache`` themselves; the config is left as it was afterwards."""
    config = getattr(model, "config", None)
    if config is None or "use_cache" in kwargs or getattr(config, "use_cache", None) is not True:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


@contextlib.contextmanager
def without_own_checkpointing(model: nn.Module) -> Iterator[None]:
    """Inside it, the modules of ``model`` that checkpoint their activations themselves (a
    Hugging Face layer's ``gradient_checkpointing`` flag) do not; put back afterwards."""
    flagged: list[Any] = [  # Any: a plain attribute, not what nn.Module types its own as
        m for m in model.modules() if getattr(m, "gradient_checkpointing", None) is True
    ]
    for module in flagged:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in flagged:
            module.gradient_checkpointing = True


def trace(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> ExportedProgram:
    """``torch.export`` of ``model`` on the examples, every tensor dimension dynamic."""
    _check_rows(args, kwargs)
    try:
        shapes = _dynamic_shapes(model, args, kwargs)
    except TypeError as exc:
        raise TypeError(
            f"the example inputs do not fit {type(model).__name__}.forward: {exc}"
        ) from None
    try:
        program = torch.export.export(
            model, args, dict(kwargs), dynamic_shapes=shapes, strict=False
        )
    except Exception as exc:  # the tracer's errors have no common base
        layer = _layer(model, exc)
        message = (
            f"torch.export could not trace {type(model).__name__}{layer}: {_reason(exc)}; "
            f"{_advice(exc)}"
        )
        raise TraceError(message, exc) from None
    _count_in_float(program)
    return program


def _count_in_float(program: ExportedProgram) -> None:
    """Give every ``histc`` of integers in ``program`` float32 to count, and its counts back
    in their integer type: the CPU has no kernel for integers (see the module's docstring)."""
    graph = program.graph_module.graph
    histc = torch.ops.aten.histc.default
    changed = False
    for node in list(graph.nodes):
        source = node.args[0] if node.target is histc else None
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(value, Tensor) or value.dtype.is_floating_point:
            continue
        counts = node.meta["val"]
        with graph.inserting_before(node):
            as_float = graph.call_function(torch.ops.aten.to.dtype, (source, torch.float32))
        as_float.meta["val"] = value.to(torch.float32)
        node.replace_input_with(source, as_float)
        node.meta["val"] = counts.to(torch.float32)
        with graph.inserting_after(node):
            back = graph.call_function(torch.ops.aten.to.dtype, (node, counts.dtype))
        back.meta["val"] = counts
        node.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
        changed = True
    if changed:
        graph.lint()
        program.graph_module.recompile()


def check_one_row(
    model: nn.Module, graph: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> None:
    """Raise if the traced graph and the model disagree on the first row of the examples:
    a model that branches on a size being 1 would give wrong results for 1-row
    micro-batches."""
    rows = next(
        (t.size(0) for t in pytree.tree_leaves((args, dict(kwargs))) if isinstance(t, Tensor)),
        None,
    )
    if rows is None:
        return

    def first_row(leaf: Any) -> Any:
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.size(0) == rows:
            return leaf[:1]
        return leaf

    one_args, one_kwargs = pytree.tree_map(first_row, (args, dict(kwargs)))
    results = []
    for run in (model, graph):
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(0)
            results.append(run(*one_args, **one_kwargs))
    expected, got = ([t for t in pytree.tree_leaves(r) if isinstance(t, Tensor)] for r in results)
    same = len(expected) == len(got) and all(
        a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
        for a, b in zip(expected, got, strict=True)
    )
    if not same:
        raise ValueError(
            f"{type(model).__name__} computes something else for a 1-row input than the graph "
            "torch.export traced for more rows (a branch on a size being 1?): keep every "
            "micro-batch at 2 rows or more, and pass check=False to split"
        )
