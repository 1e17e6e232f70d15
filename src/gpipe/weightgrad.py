"""Splitting a stage's backward into input gradients (B) and weight gradients (W).

B runs autograd only towards the stage's inputs: that is all the previous stage waits for.
On its way it passes the output of every layer that holds parameters; a hook keeps the
gradient that arrives there. W then needs, per such layer, only one short autograd call from
that output to the layer's own parameters, so the split costs no recomputation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["WeightGradients"]


@dataclass
class _Part:
    """One output of a parameter-holding layer: where it entered the graph, its parameters,
    and the gradient that reached it during B."""

    edge: GradientEdge
    params: list[nn.Parameter]
    grads: list[Tensor] = field(default_factory=list)


def _owners(module: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Layers that hold trainable parameters directly (not through a child)."""
    owners = []
    for layer in module.modules():
        params = [p for p in layer.parameters(recurse=False) if p.requires_grad]
        if params:
            owners.append((layer, params))
    return owners


class WeightGradients:
    """The W half of one micro-batch's backward on one stage."""

    def __init__(self) -> None:
        self._parts: list[_Part] = []

    @contextmanager
    def capturing(self, module: nn.Module) -> Iterator[None]:
        """Run a forward of ``module`` inside this to note every parameter-holding layer's
        output, and have B keep the gradient that reaches it."""

        def note(layer: nn.Module, params: list[nn.Parameter], output: Any) -> None:
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for out in outputs:
                if isinstance(out, Tensor) and out.requires_grad:
                    part = _Part(get_gradient_edge(out), params)
                    out.register_hook(part.grads.append)
                    self._parts.append(part)

        handles = [
            layer.register_forward_hook(
                lambda layer, args, output, params=params: note(layer, params, output)
            )
            for layer, params in _owners(module)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

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
        missed = {id(p) for part in self._parts if not part.grads for p in part.params}
        covered: set[int] = set()
        for part in self._parts:
            if part.grads and not any(id(p) in missed for p in part.params):
                grad = part.grads[0] if len(part.grads) == 1 else torch.stack(part.grads).sum(0)
                torch.autograd.backward([part.edge], [grad], inputs=part.params, retain_graph=True)
                covered.update(id(p) for p in part.params)
        rest = [p for p in module.parameters() if p.requires_grad and id(p) not in covered]
        if rest:
            torch.autograd.backward(roots, root_grads, inputs=rest, retain_graph=True)
        self._parts.clear()
