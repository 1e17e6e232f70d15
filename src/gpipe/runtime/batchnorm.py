"""BatchNorm for micro-batches: normalize each micro-batch by its own statistics, but track
running statistics once per mini-batch, as plain BatchNorm would on the whole batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from gpipe.runtime.microbatch import check_chunks
from gpipe.runtime.recompute import is_recomputing

__all__ = [
    "DeferredBatchNorm",
    "commit_deferred_batch_norm",
    "convert_deferred_batch_norm",
    "discard_deferred_batch_norm",
]


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm whose running statistics are updated once per mini-batch of ``chunks``
    micro-batches, from the statistics of all of them merged (Chan et al.'s parallel
    algorithm): the running mean and the unbiased running variance are those PyTorch's own
    BatchNorm records when it sees the micro-batches together as one batch, and
    ``num_batches_tracked`` counts mini-batches. A micro-batch's recomputation
    (re-materialization) is never counted twice.

    Used alone, it commits after every ``chunks`` calls in training mode; in a pipeline,
    ``commit()`` is called at the end of each step, whatever its number of micro-batches.
    Works on inputs of any rank (N, C, ...), like ``BatchNorm1d/2d/3d``.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        chunks: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        auto_commit: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, True, device, dtype)
        self.chunks = check_chunks(chunks)
        self.auto_commit = auto_commit  # pipelines commit themselves, once per step
        self.discard()

    def discard(self) -> None:
        """Forget the micro-batches counted since the last commit (a step that failed)."""
        self._calls = 0
        self._count = 0  # values per channel seen since the last commit
        self._mean: Tensor | None = None
        self._m2: Tensor | None = None  # sum of squared deviations from the mean

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"expected an input of 2 or more dimensions (N, C, ...), got {input.dim()}"
            )

    @property
    def pending(self) -> int:
        """Micro-batches counted since the last commit."""
        return self._calls

    def _accumulate(self, input: Tensor) -> None:
        x = input.detach()
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        dims = [d for d in range(x.dim()) if d != 1]
        var, mean = torch.var_mean(x, dim=dims, correction=0)
        wide = _wide(x.device)
        n = x.numel() // x.size(1)
        self._merge(n, mean.to(wide), var.to(wide) * n)
        self._calls += 1

    def _merge(self, n: int, mean: Tensor, m2: Tensor) -> None:
        """Chan et al.'s update: the statistics of the values seen so far and of ``n`` more."""
        if self._mean is None or self._m2 is None:
            self._count, self._mean, self._m2 = n, mean, m2
            return
        total = self._count + n
        delta = mean - self._mean
        self._mean = self._mean + delta * (n / total)
        self._m2 = self._m2 + m2 + delta * delta * (self._count * n / total)
        self._count = total

    def pending_statistics(self) -> tuple[int, int, Tensor | None, Tensor | None]:
        """What was counted since the last commit (micro-batches, values per channel, mean,
        sum of squared deviations), on the CPU, for other replicas to merge."""
        cpu = [None if t is None else t.cpu() for t in (self._mean, self._m2)]
        return self._calls, self._count, cpu[0], cpu[1]

    def replace_statistics(
        self, parts: list[tuple[int, int, Tensor | None, Tensor | None]]
    ) -> None:
        """Replace what was counted by the merge, in order, of several replicas' counts
        (each statistic taken to this norm's device, in the dtype it counts in)."""
        assert self.running_mean is not None
        device = self.running_mean.device
        self.discard()
        for calls, n, mean, m2 in parts:
            if calls and mean is not None and m2 is not None:
                self._merge(n, mean.to(device, _wide(device)), m2.to(device, _wide(device)))
                self._calls += calls

    def commit(self) -> None:
        """Fold the micro-batches counted since the last commit into the running statistics,
        as one mini-batch; nothing happens if none were counted."""
        if self._calls == 0 or self._mean is None or self._m2 is None:
            return
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        n = self._count
        var = self._m2 / (n - 1) if n > 1 else torch.full_like(self._m2, float("nan"))
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        with torch.no_grad():
            for running, stat in ((self.running_mean, self._mean), (self.running_var, var)):
                updated = factor * stat + (1.0 - factor) * running.to(stat.dtype)
                running.copy_(updated)
        self.discard()

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        if not is_recomputing():
            self._accumulate(input)
        output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if self.auto_commit and self._calls >= self.chunks:
            self.commit()
        return output

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return f"{base}, chunks={self.chunks}"

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """``module`` with every BatchNorm that tracks running statistics replaced by a
        DeferredBatchNorm sharing its parameters and buffers (same state-dict keys); those
        with ``track_running_stats=False`` are left as they are."""
        return convert_deferred_batch_norm(module, chunks)


def _wide(device: torch.device) -> torch.dtype:
    """The dtype statistics are counted in: float64, or float32 on MPS, which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


def _convert_one(bn: _BatchNorm, chunks: int, auto_commit: bool) -> DeferredBatchNorm:
    if isinstance(bn, DeferredBatchNorm) and bn.chunks == chunks:
        bn.auto_commit = auto_commit
        return bn
    # built empty on the meta device, then given the original's tensors themselves
    dbn = DeferredBatchNorm(
        bn.num_features, bn.eps, bn.momentum, False, chunks, device="meta", auto_commit=auto_commit
    )
    dbn.affine = bn.affine
    for name in ("weight", "bias"):
        dbn.register_parameter(name, getattr(bn, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        dbn.register_buffer(name, getattr(bn, name))
    dbn.train(bn.training)
    return dbn


def convert_deferred_batch_norm(
    module: nn.Module, chunks: int = 1, *, auto_commit: bool = True
) -> nn.Module:
    """See ``DeferredBatchNorm.convert_deferred_batch_norm``; ``auto_commit=False`` leaves
    the commit to the caller (a pipeline commits once per step, whatever its M)."""
    if isinstance(module, _BatchNorm) and module.track_running_stats:
        return _convert_one(module, chunks, auto_commit)
    for name, child in module.named_children():
        converted = convert_deferred_batch_norm(child, chunks, auto_commit=auto_commit)
        if converted is not child:
            module._modules[name] = converted
    return module


def commit_deferred_batch_norm(module: nn.Module) -> None:
    """Commit every DeferredBatchNorm inside ``module`` (the end of a pipelined step)."""
    for layer in module.modules():
        if isinstance(layer, DeferredBatchNorm):
            layer.commit()


def discard_deferred_batch_norm(module: nn.Module) -> None:
    """Forget what every DeferredBatchNorm inside ``module`` counted (a step that failed)."""
    for layer in module.modules():
        if isinstance(layer, DeferredBatchNorm):
            layer.discard()
