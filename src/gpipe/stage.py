"""One stage: a partition of the layers on one device, running micro-batches forward and back.

Between a micro-batch's forward and its backward the stage keeps either the autograd graph
(no re-materialization) or only its input and random state (re-materialization), and nothing
else. Gradients of parameters accumulate in ``.grad`` across micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .checkpointing import RNGState
from .microbatch import Batch, as_tuple, unpack

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
    ) -> tuple[Batch, Tensor | None]:
        """Run one micro-batch; returns its outputs and, on a loss stage, its weighted loss.

        With ``build_graph`` the stage keeps what the backward of this micro-batch needs; the
        outputs it returns are then detached leaves that say by ``requires_grad`` whether a
        gradient is expected back for them.
        """
        saved = _Saved(inputs=inputs, target=target, weight=weight)
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
            with torch.enable_grad():
                outputs, loss = self._run(saved.inputs, saved)
            saved.outputs, saved.loss = outputs, loss
            sent = tuple(_leaf(t) for t in outputs)
        self._saved[microbatch] = saved
        return sent, None if loss is None else loss.detach()

    def backward(self, microbatch: int, grad_outputs: Grads | None) -> Grads:
        """Backward of one micro-batch from its loss or from ``grad_outputs``; returns the
        gradients of the stage's inputs (None where an input needs none)."""
        try:
            saved = self._saved.pop(microbatch)
        except KeyError:
            raise RuntimeError(
                f"backward of micro-batch {microbatch} without a forward that kept its graph"
            ) from None
        if saved.rng is not None:
            with saved.rng.replay(), torch.enable_grad():
                saved.outputs, saved.loss = self._run(saved.inputs, saved)
        assert saved.outputs is not None
        if saved.loss is not None and grad_outputs is None:
            torch.autograd.backward(saved.loss)
        else:
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
            if pairs:
                tensors, grads = zip(*pairs, strict=True)
                torch.autograd.backward(tensors, grads)
        return tuple(t.grad if t.requires_grad else None for t in saved.inputs)

    def clear(self) -> None:
        """Drop whatever a failed or abandoned step left behind."""
        self._saved.clear()
