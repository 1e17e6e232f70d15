"""Where a stage's graph meets other stages': the batch and skips that come in and go out,
and their gradients the other way, as messages in the order both ends agree on."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import Tensor

from gpipe.comm.payload import tensors_of
from gpipe.runtime.microbatch import Batch
from gpipe.skip.layout import StagePorts
from gpipe.skip.namespace import SkipKey

__all__ = ["Grads", "Skips", "StageBoundary"]

Grads = tuple[Tensor | None, ...]
Skips = dict[SkipKey, Tensor | None]


class StageBoundary:
    """Stage ``index``'s boundary: its batch from the stage before and to the stage after,
    and its skips through ``ports`` (from each earlier stage, to each later one), always in
    the order of ``ports``, which both ends of a message agree on."""

    def __init__(self, index: int, ports: StagePorts) -> None:
        self.index = index
        self.ports = ports

    @property
    def n_exported(self) -> int:
        """How many skip tensors the stage sends on, to every stage together."""
        return sum(len(keys) for keys in self.ports.exports.values())

    def imported(self, skips: Mapping[int, Grads]) -> Skips:
        """The skips received, by key, from the messages of each source stage."""
        imported: Skips = {}
        for src, keys in self.ports.imports.items():
            message = skips.get(src)
            if message is None or len(message) != len(keys):
                got = "nothing" if message is None else f"{len(message)} tensors"
                raise RuntimeError(
                    f"stage {self.index} expected {len(keys)} skip tensors from stage {src}, "
                    f"got {got}"
                )
            imported.update(zip(keys, message, strict=True))
        return imported

    def exported(self, stashed: Skips, microbatch: int) -> list[Tensor | None]:
        """The skips to send on, in order, from what the stage's layers stashed."""
        out = []
        for keys in self.ports.exports.values():
            for key in keys:
                if key not in stashed:
                    raise RuntimeError(
                        f"skip {key[1]!r} is popped on a later stage, but no layer of stage "
                        f"{self.index} stashed it in micro-batch {microbatch}"
                    )
                out.append(stashed[key])
        return out

    def by_destination(self, exported: list[Tensor | None]) -> dict[int, Grads]:
        """``exported`` cut into one message per destination stage."""
        out, start = {}, 0
        for dst, keys in self.ports.exports.items():
            out[dst] = tuple(exported[start : start + len(keys)])
            start += len(keys)
        return out

    def roots(
        self,
        outputs: list[Tensor | None],
        loss: Tensor | None,
        microbatch: int,
        grad_outputs: Grads | None,
        skip_grads: Mapping[int, Grads],
    ) -> tuple[list[Tensor], list[Tensor] | None]:
        """Where a micro-batch's backward starts: its ``loss``, or its ``outputs`` (then the
        skips it sent on), with their gradients from later stages."""
        if loss is not None and grad_outputs is None:
            return [loss], None
        n_outputs = len(outputs) - self.n_exported
        if grad_outputs is None or len(grad_outputs) != n_outputs:
            got = "none" if grad_outputs is None else len(grad_outputs)
            raise ValueError(
                f"expected {n_outputs} output gradients for micro-batch {microbatch}, got {got}"
            )
        grads = [*grad_outputs, *self._exported_grads(skip_grads, microbatch)]
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads, strict=True)
            if g is not None and o is not None and o.requires_grad
        ]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _exported_grads(
        self, skip_grads: Mapping[int, Grads], microbatch: int
    ) -> list[Tensor | None]:
        """The gradients of the skips sent on, in order, from each destination's message."""
        grads: list[Tensor | None] = []
        for dst, keys in self.ports.exports.items():
            message = skip_grads.get(dst)
            if message is None or len(message) != len(keys):
                raise RuntimeError(
                    f"stage {self.index} expected {len(keys)} skip gradients from stage {dst} "
                    f"for micro-batch {microbatch}"
                )
            grads += message
        return grads

    def input_grads(
        self, inputs: Batch, imported: Skips, grad_of: Callable[[Tensor], Tensor | None]
    ) -> tuple[Grads, dict[int, Grads]]:
        """Gradients of the batch input and, by source stage, of the skips received (None
        where one needs none)."""

        def of(t: Tensor | None) -> Tensor | None:
            return grad_of(t) if t is not None and t.requires_grad else None

        batch = tuple(of(t) for t in tensors_of(inputs))
        skips = {
            src: tuple(of(imported[k]) for k in keys) for src, keys in self.ports.imports.items()
        }
        return batch, skips
