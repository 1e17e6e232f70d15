"""One stage: a partition of the layers on one device, running micro-batches forward and back.

Between a micro-batch's forward and its backward the stage keeps either the autograd graph
(no re-materialization) or only its input and random state (re-materialization), and nothing
else. Gradients of parameters accumulate in ``.grad`` across micro-batches.

With ``seq_chunks`` S > 1 a training step's micro-batches come as S units along the sequence
(``gpipe.runtime.seq_chunks``): unit j of a micro-batch also takes the keys and values that
unit j-1 left on this stage, and its backward hands their gradients to unit j-1's.

Besides the batch it hands to the next stage, a stage may receive skip tensors from earlier
stages and send skips to later ones (``gpipe.skip``); their gradients travel back the same
way, so each stage's backward still ends at its own boundary (``stage_boundary``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from gpipe.comm.payload import check_same_structure, signature, tensors_of, with_tensors
from gpipe.runtime.dtensors import is_dtensor
from gpipe.runtime.kv_cache import CachedLayer
from gpipe.runtime.microbatch import Batch, check_batch
from gpipe.runtime.recompute import AutocastState, RNGState, checkpointing, recomputing
from gpipe.runtime.seq_chunks import Carries, run_cached
from gpipe.runtime.stage_boundary import Grads, Skips, StageBoundary
from gpipe.runtime.weight_gradients import Owners, WeightGradients, owners
from gpipe.skip.layout import StagePorts
from gpipe.skip.tracker import StageTracker, use_tracker

__all__ = ["IGNORE_INDEX", "NO_TARGET", "Grads", "LossFn", "Stage"]

LossFn = Callable[..., Tensor]


class _NoTarget:
    def __repr__(self) -> str:
        return "NO_TARGET"


NO_TARGET: Any = _NoTarget()  # the target of a step without targets: loss_fn(outputs) alone
# a target token that counts for nothing (padding, a document's end): cross_entropy's default
IGNORE_INDEX = -100


@dataclass
class _Saved:
    inputs: Batch
    imported: Skips = field(default_factory=dict)
    # the outputs, then the skips sent on, with their graph; None while to be recomputed
    outputs: list[Tensor | None] | None = None
    loss: Tensor | None = None
    rng: RNGState | None = None
    autocast: AutocastState | None = None  # the caller's, kept for the recomputation
    target: Any = None
    weight: float = 1.0
    weights: WeightGradients | None = None  # set when the backward is split into B and W
    b_ran: bool = False  # B went through the graph (it does not if no input needs a gradient)
    roots: list[Tensor] | None = None  # where W starts, after B
    root_grads: list[Tensor] | None = None
    # a sub-sequence (``seq_chunks``): the tokens before it, the keys and values it took from
    # the unit before (leaves) and those it leaves for the next (with its graph)
    chunked: bool = False
    past: int = 0
    carried: list[Tensor] = field(default_factory=list)
    carry_out: list[Tensor] | None = None


def _leaf(t: Tensor) -> Tensor:
    """A stage-local leaf: the stage's graph ends here, and its gradient lands in ``.grad``."""
    return t.detach().requires_grad_(t.requires_grad)


def _announced(t: Tensor) -> Tensor:
    """A tensor sent after a graph-free pass: recomputation will give every floating tensor a
    graph, so the receiver is told to expect a gradient for it."""
    return t.detach().requires_grad_(t.is_floating_point())


def _maybe(fn: Callable[[Tensor], Tensor], t: Tensor | None) -> Tensor | None:
    return None if t is None else fn(t)


def _recomputed_call(layer: nn.Module, x: Any) -> Any:
    """``layer(x)`` with its forward under ``torch.utils.checkpoint``, inside the call: the
    layer's hooks run as usual around it (and its recomputation, in the backward, runs the
    forward alone, without them)."""
    own = layer.__dict__.get("forward")  # a compiled forward (``compiled``), kept
    forward = layer.forward
    layer.forward = functools.partial(
        torch.utils.checkpoint.checkpoint, forward, use_reentrant=False
    )
    try:
        return layer(x)
    finally:
        if own is None:
            del layer.forward
        else:
            layer.forward = own


class Stage:
    """Partition ``index`` of ``n_stages``, holding ``module`` on ``device``.

    The last stage may own the loss: ``forward`` then also takes the micro-batch's target and
    the weight of its loss in the mini-batch loss, and ``backward`` starts from that loss.
    ``ports`` says which skip tensors the stage receives from and sends to which stages.
    With ``payloads`` the stage takes and returns any pytree (``gpipe.comm.payload``), else a
    tensor or a tuple of tensors, as torchgpipe's did.
    """

    def __init__(
        self,
        index: int,
        n_stages: int,
        module: nn.Module,
        device: torch.device,
        loss_fn: LossFn | None = None,
        ports: StagePorts | None = None,
        autocast: torch.dtype | None = None,
        recomputed_layers: frozenset[int] = frozenset(),
        payloads: bool = False,
        loss_context: Callable[[], AbstractContextManager[Any]] | None = None,
        seq_chunks: int = 1,
    ) -> None:
        self.index = index
        self.n_stages = n_stages
        self.module = module
        self.device = device
        self.loss_fn = loss_fn
        self._boundary = StageBoundary(index, ports if ports is not None else StagePorts())
        self.autocast = autocast  # the stage's own: its forwards and recomputations run under it
        # positions of the layers (children of ``module``) recomputed in the backward
        self.recomputed_layers = recomputed_layers
        self.payloads = payloads
        # what the loss and every backward run under (torch's loss_parallel: the loss over
        # logits split by vocabulary across tensor ranks)
        self._loss_context = loss_context if loss_context is not None else nullcontext
        self._saved: dict[int, _Saved] = {}
        self._first_output: Any = None  # micro-batch 0's, which the others must be shaped like
        self._owners: Owners | None = None  # parameter-holding layers, for a split backward
        # sub-sequences per micro-batch in a training step, and what they hand each other
        self.seq_chunks = seq_chunks
        self._carries = Carries(seq_chunks, index)

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    @property
    def ports(self) -> StagePorts:
        """Which skips the stage receives from and sends to which stages."""
        return self._boundary.ports

    # -- forward --------------------------------------------------------------------------
    def _run(
        self, inputs: Batch, imported: Skips, saved: _Saved, microbatch: int
    ) -> tuple[Batch, list[Tensor | None], Tensor | None]:
        tracker = StageTracker(imported)
        own = (
            torch.autocast(self.device.type, dtype=self.autocast)
            if self.autocast is not None
            else nullcontext()
        )
        with own, use_tracker(tracker):
            if saved.chunked:
                layers = cast(list[CachedLayer], list(self.module.children()))
                # a split backward's W needs each layer's output, which hooks do not see here
                noted = saved.weights.note if saved.weights is not None else None
                raw, saved.carry_out = run_cached(
                    layers, inputs, saved.carried, saved.past, on_output=noted
                )
            else:
                raw = self._layers(inputs)
            outputs = self._checked(raw, microbatch)
            exported = self._boundary.exported(tracker.stashed, microbatch)
            loss = None
            if self.is_last and self.loss_fn is not None and saved.target is not None:
                with self._loss_context():
                    if saved.weight == 0:  # nothing of it counts (a padding sub-sequence)
                        loss = _nothing_counted(outputs)
                    elif saved.target is NO_TARGET:
                        loss = self.loss_fn(outputs)
                    else:
                        loss = self.loss_fn(outputs, saved.target)
        if is_dtensor(loss):  # over split logits: the same whole value on every rank
            loss = loss.full_tensor()
        if loss is not None:
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
                raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
            loss = loss * saved.weight
        return outputs, exported, loss

    def _checked(self, raw: Any, microbatch: int) -> Any:
        """The stage's output, refused if it is no payload this stage may send, or if its
        structure differs from micro-batch 0's."""
        where = f"the output of stage {self.index}"
        if not self.payloads:
            return check_batch(raw, where, batched=False)
        if microbatch == 0:
            self._first_output = signature(raw)
        elif self._first_output is not None:
            check_same_structure(self._first_output, raw, where)
        return raw

    def _layers(self, inputs: Batch) -> Any:
        """The module on ``inputs``; with ``recomputed_layers``, layer by layer, those under
        ``torch.utils.checkpoint`` when a graph is built (their inputs kept, their insides
        recomputed in the backward, random state and autocast replayed)."""
        if not self.recomputed_layers or not torch.is_grad_enabled():
            return self.module(inputs)
        x: Any = inputs
        layers = cast(nn.Sequential, self.module)  # recomputed layers are a Sequential's children
        for position, layer in enumerate(layers):
            again = position in self.recomputed_layers
            x = _recomputed_call(layer, x) if again else layer(x)
        return x

    def forward(
        self,
        microbatch: int,
        inputs: Batch,
        skips: Mapping[int, Grads] | None = None,
        *,
        build_graph: bool,
        checkpoint: bool = False,
        target: Any = None,
        weight: float = 1.0,
        split_backward: bool = False,
    ) -> tuple[Batch, dict[int, Grads], Tensor | None]:
        """Run one micro-batch; returns its outputs, the skips to send (by destination stage)
        and, on a loss stage, its weighted loss.

        ``skips`` holds what earlier stages sent, by source stage. With ``build_graph`` the
        stage keeps what the backward of this micro-batch needs; the tensors it returns are
        then detached leaves that say by ``requires_grad`` whether a gradient is expected
        back for them. With ``split_backward`` the backward comes in two halves,
        ``backward_input`` and then ``backward_weight``.
        """
        imported = self._boundary.imported(skips or {})
        saved = _Saved(inputs=inputs, imported=imported, target=target, weight=weight)
        if split_backward and build_graph:
            saved.weights = WeightGradients()
        if build_graph and self.seq_chunks > 1:
            saved.chunked = True
            saved.past, saved.carried = self._carries.take(microbatch)
        if not build_graph:
            with torch.no_grad():
                outputs, exported, loss = self._run(inputs, imported, saved, microbatch)
            return outputs, self._boundary.by_destination(exported), loss
        saved.inputs = with_tensors(inputs, [_leaf(t) for t in tensors_of(inputs)])
        saved.imported = {key: _maybe(_leaf, t) for key, t in imported.items()}
        if checkpoint:
            saved.rng = RNGState(self.device)
            saved.autocast = AutocastState.capture()
            with torch.no_grad(), checkpointing():
                outputs, exported, loss = self._run(saved.inputs, saved.imported, saved, microbatch)
            sent = with_tensors(outputs, [_announced(t) for t in tensors_of(outputs)])
            sent_skips = [_maybe(_announced, t) for t in exported]
            self._leave_carry(saved, microbatch, _announced)
            saved.carry_out = None  # recomputed with its graph
        else:
            with torch.enable_grad(), self._capturing(saved):
                outputs, exported, loss = self._run(saved.inputs, saved.imported, saved, microbatch)
            saved.outputs, saved.loss = [*tensors_of(outputs), *exported], loss
            sent = with_tensors(outputs, [_leaf(t) for t in tensors_of(outputs)])
            sent_skips = [_maybe(_leaf, t) for t in exported]
            self._leave_carry(saved, microbatch, _leaf)
        self._saved[microbatch] = saved
        loss = None if loss is None else loss.detach()
        return sent, self._boundary.by_destination(sent_skips), loss

    def _leave_carry(self, saved: _Saved, unit: int, as_leaf: Callable[[Tensor], Tensor]) -> None:
        """Keep the keys and values of a sub-sequence, as leaves, for the next one."""
        if saved.chunked:
            assert saved.carry_out is not None
            tokens = saved.past + tensors_of(saved.inputs)[0].shape[1]
            self._carries.leave(unit, tokens, saved.carry_out, as_leaf)

    def _with_carry(self, saved: _Saved, unit: int, roots: list[Tensor], grads: Any) -> Any:
        """With a sub-sequence's keys and values among the roots of its backward."""
        if not saved.chunked:
            return roots, grads
        assert saved.carry_out is not None
        return self._carries.roots(unit, saved.carry_out, roots, grads)

    def _capturing(self, saved: _Saved) -> Any:
        """Note the layer outputs that B stops at for W; not on a stage whose inputs need no
        gradient, where B has nothing to do and W is the whole backward."""
        leaves = [*tensors_of(saved.inputs), *saved.imported.values(), *saved.carried]
        if saved.weights is None or not any(t is not None and t.requires_grad for t in leaves):
            return nullcontext()
        if self._owners is None:
            self._owners = owners(self.module)
        return saved.weights.capturing(self._owners)

    def _graph(self, microbatch: int, pop: bool) -> _Saved:
        """What the forward of ``microbatch`` kept, with its graph rebuilt if it was not."""
        try:
            saved = self._saved.pop(microbatch) if pop else self._saved[microbatch]
        except KeyError:
            raise RuntimeError(
                f"backward of micro-batch {microbatch} without a forward that kept its graph"
            ) from None
        if saved.rng is not None:
            autocast = saved.autocast.restore() if saved.autocast is not None else nullcontext()
            with (
                saved.rng.replay(),
                autocast,
                torch.enable_grad(),
                recomputing(),
                self._capturing(saved),
            ):
                outputs, exported, saved.loss = self._run(
                    saved.inputs, saved.imported, saved, microbatch
                )
            saved.outputs = [*tensors_of(outputs), *exported]
            saved.rng = None
        return saved

    def recompute(self, microbatch: int) -> None:
        """Rebuild a re-materialized micro-batch's graph now, ahead of its backward (the R of a
        schedule): it needs no gradient, so it can run while the gradient is on its way."""
        self._graph(microbatch, pop=False)

    # -- backward -------------------------------------------------------------------------
    def backward(
        self,
        microbatch: int,
        grad_outputs: Grads | None,
        skip_grads: Mapping[int, Grads] | None = None,
    ) -> tuple[Grads, dict[int, Grads]]:
        """Backward of one micro-batch from its loss or from ``grad_outputs`` (and the
        gradients of the skips it sent, by destination stage); returns the gradients of the
        stage's inputs (None where one needs none) and of the skips it received."""
        saved = self._graph(microbatch, pop=True)
        assert saved.outputs is not None
        roots, grads = self._boundary.roots(
            saved.outputs, saved.loss, microbatch, grad_outputs, skip_grads or {}
        )
        roots, grads = self._with_carry(saved, microbatch, roots, grads)
        if roots:
            with self._loss_context():
                torch.autograd.backward(roots, grads)
        if saved.chunked:  # the gradients of the keys and values it took, for the unit before
            self._carries.hand_back(microbatch, [t.grad for t in saved.carried])
        return self._boundary.input_grads(saved.inputs, saved.imported, lambda t: t.grad)

    def backward_input(
        self,
        microbatch: int,
        grad_outputs: Grads | None,
        skip_grads: Mapping[int, Grads] | None = None,
    ) -> tuple[Grads, dict[int, Grads]]:
        """B of a split backward: only the gradients of the stage's inputs; the graph is kept
        for ``backward_weight``."""
        saved = self._graph(microbatch, pop=False)
        if saved.weights is None:
            raise RuntimeError(
                f"micro-batch {microbatch} was run forward without split_backward=True"
            )
        assert saved.outputs is not None
        roots, grads = self._boundary.roots(
            saved.outputs, saved.loss, microbatch, grad_outputs, skip_grads or {}
        )
        roots, grads = self._with_carry(saved, microbatch, roots, grads)
        leaves = [*tensors_of(saved.inputs), *saved.imported.values(), *saved.carried]
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        found: dict[int, Tensor | None] = {}
        if roots and wanted:
            edges = saved.weights.edges  # W's starting points: B collects their gradients
            with self._loss_context():
                got = torch.autograd.grad(
                    roots,
                    [*wanted, *edges],  # type: ignore[arg-type]  # torch takes tensors and edges mixed; its stub does not
                    grads,
                    retain_graph=True,
                    allow_unused=True,
                )
            found = {id(t): g for t, g in zip(wanted, got[: len(wanted)], strict=True)}
            saved.weights.take(got[len(wanted) :])
            saved.b_ran = True
        saved.roots, saved.root_grads = roots, grads
        if saved.chunked:
            self._carries.hand_back(microbatch, [found.get(id(t)) for t in saved.carried])
        return self._boundary.input_grads(saved.inputs, saved.imported, lambda t: found.get(id(t)))

    def backward_weight(self, microbatch: int) -> None:
        """W of a split backward: the weight gradients, accumulated into ``.grad``."""
        saved = self._saved.pop(microbatch, None)
        if saved is None or saved.weights is None:
            raise RuntimeError(f"weight gradients of micro-batch {microbatch} before its B")
        if saved.roots:
            with self._loss_context():
                saved.weights.compute(self.module, saved.roots, saved.root_grads, saved.b_ran)

    def take_saved(self) -> dict[int, object]:
        """Take out what the forwards since the last take kept for their backward, by
        micro-batch, for ``give_saved`` to put back before that backward: so a caller may run
        several steps' forwards before their backwards, each keeping its own (``GPipe``)."""
        saved, self._saved = self._saved, {}
        return cast(dict[int, object], saved)

    def give_saved(self, saved: dict[int, object]) -> None:
        """Put back what ``take_saved`` took, in place of whatever the stage holds."""
        self._saved = cast(dict[int, _Saved], dict(saved))

    def clear(self) -> None:
        """Drop whatever a failed or abandoned step left behind."""
        self._saved.clear()
        self._carries.clear()


def _nothing_counted(outputs: Any) -> Tensor:
    """The loss of a micro-batch of no weight: zero, with a zero gradient for each of its
    outputs, where ``loss_fn`` may have no value (a mean over no counted token)."""
    found = tensors_of(outputs)
    kept = [t for t in found if t.requires_grad]
    if not kept:
        return torch.zeros((), device=found[0].device if found else None)
    loss = kept[0].float().sum() * 0.0
    for t in kept[1:]:
        loss = loss + t.float().sum() * 0.0
    return loss
