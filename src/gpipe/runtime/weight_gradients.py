"""Splitting a stage's backward into input gradients (B) and weight gradients (W).

B runs autograd only towards the stage's inputs: that is all the previous stage waits for.
On its way it passes the output of every layer that holds parameters; B asks autograd for
the gradient there too (the forward noted where each such output entered the graph). W then
needs, per such layer, only one short autograd call from that output to the layer's own
parameters, so the split costs no recomputation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

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

    @contextmanager
    def capturing(self, layers: Owners) -> Iterator[None]:
        """Run a forward inside this to note the output of every layer of ``layers``: through
        their forward hooks, and through ``note`` for calls that run none (a sub-sequence's
        cached forward)."""

        def hook(layer: nn.Module, args: Any, output: Any) -> None:
            self.note(layer, output)

        self._owners = {id(layer) for layer, _ in layers}
        handles = [layer.register_forward_hook(hook) for layer, _ in layers]
        try:
            yield
        finally:
            self._owners = None
            for handle in handles:
                handle.remove()

    def note(self, layer: nn.Module, output: Any) -> None:
        """Note ``output`` of ``layer`` as a place B stops at, if this is capturing and
        ``layer`` holds parameters of its own; each edge once."""
        if self._owners is None or id(layer) not in self._owners:
            return
        for out in tensors_of(output):  # every leaf, however nested
            if out.requires_grad:
                edge = get_gradient_edge(out)
                if (edge.node, edge.output_nr) not in self._noted:
                    self._noted.add((edge.node, edge.output_nr))
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
            if part.grad is None
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
