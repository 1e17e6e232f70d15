"""GPipe: the single-process facade, one partition per device, driven by autograd.

``model(x)`` runs the forward half of the GPipe schedule, one worker thread per device; the
output's ``backward()`` runs the backward half the same way (``gpipe.engine.workers``). A
caller's ``torch.autocast`` applies inside every partition, worker threads and recomputations
included. Public API and behaviour follow torchgpipe's ``GPipe`` (and PyTorch's retired
``Pipe``) so migrating is changing an import.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from gpipe.engine.given_batches import check_microbatches
from gpipe.engine.step_schedule import ScheduleSource, StepSchedules
from gpipe.engine.workers import DeviceWorkers
from gpipe.errors import MovingDenied
from gpipe.parallel.ties import find_ties, untie
from gpipe.runtime.batchnorm import commit_deferred_batch_norm, convert_deferred_batch_norm
from gpipe.runtime.microbatch import as_tuple, check_batch, check_chunks, like
from gpipe.runtime.partitions import as_sequential, check_balance, split_sequential
from gpipe.runtime.recompute import Layers, check_checkpoint, recomputed_layers
from gpipe.runtime.stage import Stage
from gpipe.runtime.timeline import Event, Recorder
from gpipe.skip.layout import SkipLayout
from gpipe.skip.skippable import find_skips

__all__ = ["GPipe"]

Device = torch.device | int | str


def _as_device(device: Device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _devices_for(devices: Iterable[Device] | None, n: int) -> list[torch.device]:
    """A device for each of ``n`` partitions: the first ``n`` of ``devices`` (default: every
    CUDA device, else CPU for all)."""
    if devices is not None:
        found = [_as_device(d) for d in devices]
    elif torch.cuda.is_available():
        found = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    else:
        found = [torch.device("cpu")] * n
    if len(found) < n:
        raise IndexError(
            f"too few devices to hold given partitions (devices: {len(found)}, partitions: {n})"
        )
    return found[:n]


def _refuse_lazy(module: nn.Module) -> None:
    """GPipe places, ties and converts the tensors when it is built: a lazy layer's have no
    shape yet (torch's own message about it speaks of ``load_state_dict``)."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if nn.parameter.is_lazy(t):
            raise ValueError(
                f"module has an uninitialized lazy tensor {name!r}; expected initialized "
                "layers: run the module once on a sample before wrapping it in GPipe"
            )


class GPipe(nn.Module):
    """Wraps an ``nn.Sequential`` for GPipe pipeline parallelism in one process.

    Args:
        module: the model, an ``nn.Sequential`` cut into consecutive partitions. Its layers
            may be ``gpipe.skip.skippable``: a skip that crosses partitions is copied straight
            to the partition that pops it.
        balance: number of layers in each partition (a list or tuple); ``gpipe.planning.balancing``
            chooses one from measured costs.
        devices: one device per partition (default: every CUDA device, else CPU).
        chunks: number of micro-batches a mini-batch is split into.
        checkpoint: when to re-materialize: ``"always"``, ``"except_last"`` or ``"never"``;
            or ``gpipe.runtime.recompute.Layers(...)`` to recompute only some layers.
        deferred_batch_norm: replace every BatchNorm by
            ``gpipe.runtime.batchnorm.DeferredBatchNorm``,
            so running statistics are tracked once per mini-batch, from all its micro-batches.
        timeout: seconds a stage waits for its neighbour before it gives up.
        trace: record what each stage runs when, for ``timeline`` (``self.recorder``).

    The forward and its backward are run by ``self.workers``, a ``gpipe.engine.DeviceWorkers``:
    a worker thread per device, and the GPUs' copy streams (``workers.copies``).
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Iterable[int] | None = None,
        *,
        devices: Iterable[Device] | None = None,
        chunks: int = 1,
        checkpoint: str | Layers = "except_last",
        deferred_batch_norm: bool = False,
        timeout: float = 60.0,
        trace: bool = False,
    ) -> None:
        super().__init__()
        self.chunks = check_chunks(chunks)
        self.checkpoint = check_checkpoint(checkpoint)
        self.deferred_batch_norm = deferred_batch_norm
        module = as_sequential(module)
        _refuse_lazy(module)
        self.balance = check_balance(len(module), balance)
        skips = find_skips(module)
        self.devices = _devices_for(devices, len(self.balance))
        if deferred_batch_norm:
            # a Sequential is converted in place, and stays one
            module = cast(
                nn.Sequential, convert_deferred_batch_norm(module, self.chunks, auto_commit=False)
            )
        # a parameter that layers of several partitions share: a copy on each, gradients
        # summed after the backward (so the copies stay equal)
        self.ties = find_ties(module, self.balance)
        untie(module, self.ties)
        parts = split_sequential(module, self.balance)
        self.partitions = cast(  # a ModuleList of Sequentials, typed as torchgpipe types it
            list[nn.Sequential],
            nn.ModuleList([nn.Module.to(p, d) for p, d in zip(parts, self.devices, strict=True)]),
        )
        self.skip_layout = SkipLayout(skips, self.balance)
        self.recorder = Recorder(0) if trace else None
        self.workers = self._workers(module, timeout)

    def _workers(self, module: nn.Sequential, timeout: float) -> DeviceWorkers:
        """A stage per partition on its device, run by a worker thread per device on the
        GPipe schedule; ``module`` (the partitions' layers, untied) names the tied copies."""
        recomputed = recomputed_layers(self.checkpoint, module, self.balance)
        k = len(self.partitions)
        # between partitions any payload may pass (a split model's sizes ride along); what
        # the last one returns is a tensor or a tuple of tensors, as torchgpipe's rule says
        stages = [
            Stage(
                j,
                k,
                partition,
                device,
                ports=self.skip_layout.ports(j),
                recomputed_layers=layers,
                payloads=j < k - 1,
            )
            for j, (partition, device, layers) in enumerate(
                zip(self.partitions, self.devices, recomputed, strict=True)
            )
        ]
        schedules = StepSchedules(
            ScheduleSource.of("gpipe"),
            k,
            tuple(range(k)),
            self.skip_layout.routes,
            self.checkpoint,
        )
        return DeviceWorkers(
            stages,
            schedules,
            timeout,
            tied=[[module.get_parameter(tie.name(s)) for s in tie.stages] for tie in self.ties],
            on_action=None if self.recorder is None else self.recorder.on_action,
        )

    # -- Sequential-like access to the layers -------------------------------------------------
    def __len__(self) -> int:
        return sum(len(p) for p in self.partitions)

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self)
        try:
            return layers[index]
        except IndexError:
            raise IndexError(f"layer index {index} out of range for {len(layers)} layers") from None

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition

    # -- Placement is fixed by `devices` ------------------------------------------------------
    def cuda(self, device: Any = None) -> GPipe:
        raise MovingDenied(
            "denied to move parameters and buffers, because GPipe places them by its devices"
        )

    def cpu(self) -> GPipe:
        raise MovingDenied(
            "denied to move parameters and buffers, because GPipe places them by its devices"
        )

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        moving = (
            "device" in kwargs
            or "tensor" in kwargs
            or (args and isinstance(args[0], (torch.device, int, str, Tensor)))
        )
        if moving:
            raise MovingDenied(
                "denied to move parameters and buffers, because GPipe places "
                "them by its devices; only dtype casts are allowed"
            )
        return super().to(*args, **kwargs)

    # -- Running -----------------------------------------------------------------------------
    def forward(
        self,
        input: Tensor | tuple[Tensor, ...] | None = None,
        *,
        microbatches: Sequence[Tensor | tuple[Tensor, ...]] | None = None,
    ) -> Any:
        """Pipelined forward over micro-batches; the output is on the last device, a tensor
        or a tuple as the last partition returns it.

        ``microbatches=[x0, x1, ...]`` runs your own micro-batches instead of splitting
        ``input`` into ``chunks``: each a tensor or a tuple of tensors of one structure, of
        its own rows and length, run in order; returns the list of their outputs (which
        cannot be joined when their lengths differ), through which ``backward`` runs as one.
        """
        if microbatches is not None:
            if input is not None:
                raise ValueError("give input or microbatches=[...], not both")
            return self._forward_given(microbatches)
        if not self.partitions:  # an empty Sequential is the identity
            return check_batch(input, batched=False)
        if self.recorder is not None:
            self.recorder.step()  # a step is this forward and the backward of its output
        batch = check_batch(input)
        batch = like(batch, [t.to(self.devices[0]) for t in as_tuple(batch)])
        output = self.workers.forward(batch, self.chunks, self.training)
        self._commit()
        return output

    def _forward_given(self, given: object) -> list[Any]:
        """The forward over the user's own micro-batches: a list of their outputs."""
        microbatches = check_microbatches(given, self.devices[0])
        if not self.partitions:
            return microbatches
        if self.recorder is not None:
            self.recorder.step()
        outputs = self.workers.forward_each(microbatches, self.training)
        self._commit()
        return outputs

    def _commit(self) -> None:
        """After a training forward, fold the micro-batches' BatchNorm statistics in."""
        if self.deferred_batch_norm and self.training:
            for partition in self.partitions:
                commit_deferred_batch_norm(partition)

    def timeline(self) -> list[Event]:
        """What every stage ran in the last step: the last forward and its backward, if run."""
        if self.recorder is None:
            raise RuntimeError("timeline() needs a recording; pass trace=True to GPipe")
        return self.recorder.events()

    def extra_repr(self) -> str:
        return (
            f"balance={self.balance}, chunks={self.chunks}, checkpoint={self.checkpoint!r}, "
            f"devices={[str(d) for d in self.devices]}"
        )
