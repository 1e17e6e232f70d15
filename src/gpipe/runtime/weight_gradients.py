"""Splitting a stage's backward into input gradients (B) and weight gradients (W).

B runs autograd only towards the stage's inputs: that is all the previous stage waits for.
On its way it passes the output of every layer that holds parameters; B asks autograd for
the gradient there too (the forward noted where each such output entered the graph). W then
needs, per such layer, only one short autograd call from that output to the layer's own
parameters, so the split costs no recomputation.

A layer may return outputs made from one another (a mixture-of-experts router returns its
logits and the scores it computed from them): the gradient B finds at the first already holds
what flowed back through the second, so W starting from both would count it twice. Such an
output is left out when the paths from it to the layer's inputs all pass through another
output; where one also reaches a parameter directly, the layer's parameters get their
gradients from the stage's output instead, as a layer that B did not pass does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from gpipe.comm.payload import tensors_of

__all__ = ["Owners", "WeightGradients", "owners"]

Owners = list[tuple[nn.Module, list[nn.Parameter]]]

# autograd's engine without the checks of torch.autograd.backward, which re-validate a
# gradient autograd itself produced: they are a third of a W call on narrow layers
_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _backward_to(edge: GradientEdge, grad: Tensor, params: list[nn.Parameter]) -> None:
    """Accumulate into ``params``' ``.grad`` the backward from ``edge`` given ``grad``."""
    if _engine_run_backward is None:
        torch.autograd.backward([edge], [grad], inputs=params, retain_graph=True)
        return
    _engine_run_backward(
        (edge,), (grad,), True, False, tuple(params), allow_unreachable=True, accumulate_grad=True
    )


def owners(module: nn.Module) -> Owners:
    """Layers that hold parameters directly (not through a child), with those parameters;
    the ones that need no gradient are left out when W runs."""
    found = []
    for layer in module.modules():
        params = list(layer.parameters(recurse=False))
        if params:
            found.append((layer, params))
    return found


@dataclass
class _Part:
    """One output of a parameter-holding layer: where it entered the graph, the layer, and
    the gradient that reached it during B (None if B did not pass it)."""

    edge: GradientEdge
    layer: nn.Module
    grad: Tensor | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        """The layer's parameters as W finds them: read then, not at the forward, since a
        sharded layer (``fully_shard``) swaps in its gathered parameters only while they
        are in use."""
        return list(self.layer.parameters(recurse=False))


class WeightGradients:
    """The W half of one micro-batch's backward on one stage."""

    def __init__(self) -> None:
        self._parts: list[_Part] = []
        self._noted: set[tuple[Any, int]] = set()  # the edges of ``_parts``
        self._owners: set[int] | None = None  # while capturing: the layers whose outputs count
        self._inputs: dict[int, list[set[Node]]] = {}  # per layer, its calls' input nodes
        self._from_roots: set[int] = set()  # layers W serves from the stage's output

    @contextmanager
    def capturing(self, layers: Owners) -> Iterator[None]:
        """Run a forward inside this to note the output of every layer of ``layers``: through
        their forward hooks, and through ``note`` for calls that run none (a sub-sequence's
        cached forward)."""

        def before(layer: nn.Module, args: Any, kwargs: Any) -> None:
            made = {
                get_gradient_edge(t).node for t in tensors_of((args, kwargs)) if t.requires_grad
            }
            self._inputs.setdefault(id(layer), []).append(made)

        def hook(layer: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            calls = self._inputs.get(id(layer))
            self.note(layer, output, calls.pop() if calls else None)

        self._owners = {id(layer) for layer, _ in layers}
        handles = [
            handle
            for layer, _ in layers
            for handle in (
                layer.register_forward_pre_hook(before, with_kwargs=True),
                layer.register_forward_hook(hook, with_kwargs=True),
            )
        ]
        try:
            yield
        finally:
            self._owners = None
            self._inputs.clear()
            for handle in handles:
                handle.remove()

    def note(self, layer: nn.Module, output: Any, inputs: set[Node] | None = None) -> None:
        """Note ``output`` of ``layer`` as a place B stops at, if this is capturing and
        ``layer`` holds parameters of its own; each edge once. ``inputs``, the graph nodes of
        the call's inputs, bound the search for outputs made from other outputs."""
        if self._owners is None or id(layer) not in self._owners:
            return
        edges: dict[tuple[Any, int], GradientEdge] = {}
        for out in tensors_of(output):  # every leaf, however nested
            if out.requires_grad:
                edge = get_gradient_edge(out)
                edges.setdefault((edge.node, edge.output_nr), edge)
        if len(edges) > 1:
            kept = _upstream_outputs(edges, inputs or set())
            if kept is None:
                self._from_roots.add(id(layer))
                return
            edges = {key: edges[key] for key in kept}
        for key, edge in edges.items():
            if key not in self._noted:
                self._noted.add(key)
                self._parts.append(_Part(edge, layer))

    @property
    def edges(self) -> list[GradientEdge]:
        """Where B should also stop to collect a gradient (``take`` the results)."""
        return [part.edge for part in self._parts]

    def take(self, grads: Sequence[Tensor | None]) -> None:
        """The gradients B found at ``edges``, in their order."""
        for part, grad in zip(self._parts, grads, strict=True):
            part.grad = grad

    def compute(
        self,
        module: nn.Module,
        roots: Sequence[Tensor],
        root_grads: Sequence[Tensor] | None,
        b_ran: bool,
    ) -> None:
        """Accumulate the weight gradients into ``.grad``.

        ``b_ran`` says whether B went through the graph (it does not on a stage whose inputs
        need no gradient); if not, W is the whole backward. Parameters whose layer output B
        did not pass get their gradient from the roots directly.
        """
        if not b_ran:
            torch.autograd.backward(roots, root_grads)
            return
        # a parameter is served by its layers' outputs only if B reached every one of them
        held = [part.params for part in self._parts]
        missed = {
            id(p)
            for part, ps in zip(self._parts, held, strict=True)
            if part.grad is None or id(part.layer) in self._from_roots
            for p in ps
        }
        covered: set[int] = set()
        for part, ps in zip(self._parts, held, strict=True):
            params = [p for p in ps if p.requires_grad]
            if part.grad is None or not params or any(id(p) in missed for p in params):
                continue
            _backward_to(part.edge, part.grad, params)
            covered.update(id(p) for p in params)
        rest = [p for p in module.parameters() if p.requires_grad and id(p) not in covered]
        if rest:
            torch.autograd.backward(roots, root_grads, inputs=rest, retain_graph=True)
        self._parts.clear()
        self._noted.clear()
        self._from_roots.clear()


# how many graph nodes the search for outputs made from other outputs may visit in one layer
_SEARCH_LIMIT = 1024


def _upstream_outputs(
    edges: dict[tuple[Any, int], GradientEdge], inputs: set[Node]
) -> list[tuple[Any, int]] | None:
    """The outputs of one layer call (``edges``) that W starts from: those not made from
    another; None when one is made from another and from a parameter besides (or the search
    goes past ``_SEARCH_LIMIT`` nodes), which W cannot split without counting twice."""
    kept = []
    for key, edge in edges.items():
        others = set(edges) - {key}
        reached_output, reached_parameter = False, False
        seen: set[Node] = set()
        stack = [edge.node]
        while stack:
            for nxt, nr in stack.pop().next_functions:
                if nxt is None or nxt in inputs:
                    continue
                if (nxt, nr) in others:
                    reached_output = True
                elif hasattr(nxt, "variable"):  # a leaf's accumulator: a parameter
                    reached_parameter = True
                elif nxt not in seen:
                    if len(seen) == _SEARCH_LIMIT:
                        return None
                    seen.add(nxt)
                    stack.append(nxt)
        if reached_output and reached_parameter:
            return None
        if not reached_output:
            kept.append(key)
    return kept
