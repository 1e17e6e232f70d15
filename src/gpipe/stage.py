"""One stage: a partition of the layers on one device, running micro-batches forward and back.

Between a micro-batch's forward and its backward the stage keeps either the autograd graph
(no re-materialization) or only its input and random state (re-materialization), and nothing
else. Gradients of parameters accumulate in ``.grad`` across micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .checkpointing import RNGState
from .microbatch import Batch, as_tuple, unpack
from .weightgrad import WeightGradients

__all__ = ["LossFn", "Stage"]

LossFn = Callable[..., Tensor]
Grads = tuple[Tensor | None, ...]


@dataclass
class _Saved:
    inputs: Batch
    outputs: Batch | None = None  # None when the forward is to be recomputed
    loss: Tensor | None = None
    rng: RNGState | None = None
    target: Any = None
    weight: float = 1.0
    weights: WeightGradients | None = None  # set when the backward is split into B and W
    b_ran: bool = False  # B went through the graph (it does not if no input needs a gradient)
    roots: list[Tensor] | None = None  # where W starts, after B
    root_grads: list[Tensor] | None = None


def _leaf(t: Tensor) -> Tensor:
    """A stage-local leaf: the stage's graph ends here, and its gradient lands in ``.grad``."""
    return t.detach().requires_grad_(t.requires_grad)


class Stage:
    """Partition ``index`` of ``n_stages``, holding ``module`` on ``device``.

    The last stage may own the loss: ``forward`` then also takes the micro-batch's target and
    the weight of its loss in the mini-batch loss, and ``backward`` starts from that loss.
    """

    def __init__(
        self,
        index: int,
        n_stages: int,
        module: nn.Module,
        device: torch.device,
        loss_fn: LossFn | None = None,
    ) -> None:
        self.index = index
        self.n_stages = n_stages
        self.module = module
        self.device = device
        self.loss_fn = loss_fn
        self._saved: dict[int, _Saved] = {}

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    def _run(self, inputs: Batch, saved: _Saved) -> tuple[Batch, Tensor | None]:
        outputs = as_tuple(self.module(unpack(inputs)))
        if not all(isinstance(t, Tensor) for t in outputs):
            kinds = [type(t).__name__ for t in outputs]
            raise TypeError(
                f"partition returned {kinds}; a stage must return a Tensor or a tuple of Tensors"
            )
        loss = None
        if self.is_last and self.loss_fn is not None and saved.target is not None:
            loss = self.loss_fn(unpack(outputs), saved.target)
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
                raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
            loss = loss * saved.weight
        return outputs, loss

    def forward(
        self,
        microbatch: int,
        inputs: Batch,
        *,
        build_graph: bool,
        checkpoint: bool = False,
        target: Any = None,
        weight: float = 1.0,
        split_backward: bool = False,
    ) -> tuple[Batch, Tensor | None]:
        """Run one micro-batch; returns its outputs and, on a loss stage, its weighted loss.

        With ``build_graph`` the stage keeps what the backward of this micro-batch needs; the
        outputs it returns are then detached leaves that say by ``requires_grad`` whether a
        gradient is expected back for them. With ``split_backward`` the backward comes in two
        halves, ``backward_input`` and then ``backward_weight``.
        """
        saved = _Saved(inputs=inputs, target=target, weight=weight)
        if split_backward and build_graph:
            saved.weights = WeightGradients()
        if not build_graph:
            with torch.no_grad():
                outputs, loss = self._run(inputs, saved)
            return outputs, loss
        saved.inputs = tuple(_leaf(t) for t in inputs)
        if checkpoint:
            saved.rng = RNGState(self.device)
            with torch.no_grad():
                outputs, loss = self._run(saved.inputs, saved)
            # Recomputation will give every floating output a graph; say so to the next stage.
            sent = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in outputs)
        else:
            with torch.enable_grad(), self._capturing(saved):
                outputs, loss = self._run(saved.inputs, saved)
            saved.outputs, saved.loss = outputs, loss
            sent = tuple(_leaf(t) for t in outputs)
        self._saved[microbatch] = saved
        return sent, None if loss is None else loss.detach()

    def _capturing(self, saved: _Saved) -> Any:
        return saved.weights.capturing(self.module) if saved.weights is not None else nullcontext()

    def _graph(self, microbatch: int, pop: bool) -> _Saved:
        """What the forward of ``microbatch`` kept, with its graph rebuilt if it was not."""
        try:
            saved = self._saved.pop(microbatch) if pop else self._saved[microbatch]
        except KeyError:
            raise RuntimeError(
                f"backward of micro-batch {microbatch} without a forward that kept its graph"
            ) from None
        if saved.rng is not None:
            with saved.rng.replay(), torch.enable_grad(), self._capturing(saved):
                saved.outputs, saved.loss = self._run(saved.inputs, saved)
            saved.rng = None
        assert saved.outputs is not None
        return saved

    def _roots(
        self, saved: _Saved, microbatch: int, grad_outputs: Grads | None
    ) -> tuple[list[Tensor], list[Tensor] | None]:
        """Where this micro-batch's backward starts: its loss, or its outputs and their
        gradients from the next stage."""
        if saved.loss is not None and grad_outputs is None:
            return [saved.loss], None
        if grad_outputs is None or len(grad_outputs) != len(saved.outputs):
            got = "none" if grad_outputs is None else len(grad_outputs)
            raise ValueError(
                f"expected {len(saved.outputs)} output gradients for micro-batch "
                f"{microbatch}, got {got}"
            )
        pairs = [
            (o, g)
            for o, g in zip(saved.outputs, grad_outputs, strict=True)
            if g is not None and o.requires_grad
        ]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def backward(self, microbatch: int, grad_outputs: Grads | None) -> Grads:
        """Backward of one micro-batch from its loss or from ``grad_outputs``; returns the
        gradients of the stage's inputs (None where an input needs none)."""
        saved = self._graph(microbatch, pop=True)
        roots, grads = self._roots(saved, microbatch, grad_outputs)
        if roots:
            torch.autograd.backward(roots, grads)
        return tuple(t.grad if t.requires_grad else None for t in saved.inputs)

    def backward_input(self, microbatch: int, grad_outputs: Grads | None) -> Grads:
        """B of a split backward: only the gradients of the stage's inputs; the graph is kept
        for ``backward_weight``."""
        saved = self._graph(microbatch, pop=False)
        if saved.weights is None:
            raise RuntimeError(
                f"micro-batch {microbatch} was run forward without split_backward=True"
            )
        roots, grads = self._roots(saved, microbatch, grad_outputs)
        wanted = [t for t in saved.inputs if t.requires_grad]
        found: dict[int, Tensor | None] = {}
        if roots and wanted:
            got = torch.autograd.grad(roots, wanted, grads, retain_graph=True, allow_unused=True)
            found = {id(t): g for t, g in zip(wanted, got, strict=True)}
            saved.b_ran = True
        saved.roots, saved.root_grads = roots, grads
        return tuple(found.get(id(t)) for t in saved.inputs)

    def backward_weight(self, microbatch: int) -> None:
        """W of a split backward: the weight gradients, accumulated into ``.grad``."""
        saved = self._saved.pop(microbatch, None)
        if saved is None or saved.weights is None:
            raise RuntimeError(f"weight gradients of micro-batch {microbatch} before its B")
        if saved.roots:
            saved.weights.compute(self.module, saved.roots, saved.root_grads, saved.b_ran)

    def clear(self) -> None:
        """Drop whatever a failed or abandoned step left behind."""
        self._saved.clear()
