"""PipelineConfig: ``Pipeline``'s options as one typed value, checked where they are given.

Every rank builds its pipeline from the same options, so whatever can be refused is refused
before any process group work, on every rank alike: first what the options say on their own
(``PipelineConfig``, at construction), then what they say about the model and this rank's
device (``PipelineConfig.check_model``). ``gpipe.pipeline_assembly`` builds from what passed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpipe.engine import ScheduleSource
from gpipe.parallel.sharding import Sharding
from gpipe.parallel.world import Dimensions, check_dimensions
from gpipe.planning.auto import check_auto
from gpipe.runtime.compiled import CompileOptions, check_compile
from gpipe.runtime.microbatch import check_chunks
from gpipe.runtime.recompute import Layers, check_autocast, check_checkpoint
from gpipe.runtime.seq_chunks import SeqChunks, check_seq_chunks, check_seq_setup
from gpipe.runtime.stage import LossFn
from gpipe.runtime.stage_streams import check_overlap_stages
from gpipe.schedules import Schedule
from gpipe.skip.skippable import Skip, find_skips

if TYPE_CHECKING:
    import torch.distributed as dist

    from gpipe.parallel.tensor import PlanValue

__all__ = ["LOSS_REDUCTIONS", "ModelSettings", "PipelineConfig"]

LOSS_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """The options of a ``Pipeline``, each as ``Pipeline``'s docstring describes it (all but
    the layers, the ``sample`` and the process ``group``, which are objects of the run rather
    than settings). ``Pipeline(layers, **options)`` builds one; ``Pipeline.from_config``
    takes one. Checked at construction: a bad value raises at once, naming the argument."""

    balance: list[int] | None = None
    chunks: int | None = None
    checkpoint: str | Layers = "except_last"
    schedule: str | Schedule = "gpipe"
    loss_fn: LossFn | None = None
    loss_reduction: str = "mean"
    device: torch.device | str | None = None
    data_parallel: int = 1
    tensor_parallel: int = 1
    tp_plan: dict[str, PlanValue] | None = None
    loss_parallel: bool = False
    bucket_bytes: float | None = None
    shard: str | Sharding | None = None
    deferred_batch_norm: bool = False
    autocast: torch.dtype | None = None
    local_pipes: bool = True
    seed: int = 0
    timeout: float = 60.0
    trace: bool = False
    memory_budget: float | None = None
    overlap_stages: bool | None = None
    compile: bool | dict[str, Any] = False
    seq_chunks: int = 1
    seq_split: str = "even"
    # the schedule checked, once: a given Schedule's validation replays all its programs
    _source: ScheduleSource = field(init=False, repr=False, compare=False)

    __hash__ = None  # type: ignore[assignment]  # its balance and plans are lists and dicts

    def __post_init__(self) -> None:
        checkpoint = check_checkpoint(self.checkpoint)
        object.__setattr__(self, "checkpoint", checkpoint)  # a mode's name, or Layers
        check_auto(self.schedule, self.balance, checkpoint)
        # an unknown name or a bad Schedule is refused here
        object.__setattr__(
            self, "_source", ScheduleSource.of("gpipe" if self.auto else self.schedule)
        )
        if self.chunks is not None:
            object.__setattr__(self, "chunks", check_chunks(self.chunks))
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(self.loss_fn).__name__}")
        timeout = self.timeout
        if isinstance(timeout, bool) or not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        object.__setattr__(self, "timeout", float(timeout))

    @property
    def auto(self) -> bool:
        """Whether ``schedule="auto"`` chooses the schedule, micro-batches and balance."""
        return isinstance(self.schedule, str) and self.schedule == "auto"

    def schedule_source(self) -> ScheduleSource:
        """The schedule as given, checked (under ``"auto"``, the GPipe schedule until one is
        chosen)."""
        return self._source

    def microbatches(self) -> int:
        """``chunks``, or the schedule's own count when it is None."""
        if self.chunks is not None:
            return self.chunks
        return check_chunks(self._source.default_chunks)

    def options(self) -> dict[str, Any]:
        """The options as ``Pipeline``'s keyword arguments (values as they are, not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def check_model(
        self, module: nn.Sequential, device: torch.device, group: dist.ProcessGroup | None
    ) -> ModelSettings:
        """What the options say about ``module`` on this rank's ``device``, checked against
        both: a bad skip, an autocast the device lacks, dimensions the world or the model
        cannot take, sub-sequences or compilation the setting does not run with."""
        skips = find_skips(module)
        autocast = check_autocast(self.autocast, device)
        check_overlap_stages(self.overlap_stages, device)
        dims = check_dimensions(
            module,
            group,
            data_parallel=self.data_parallel,
            bucket_bytes=self.bucket_bytes,
            shard=self.shard,
            tensor_parallel=self.tensor_parallel,
            tp_plan=self.tp_plan,
            loss_parallel=self.loss_parallel,
        )
        seq = check_seq_chunks(self.seq_chunks, self.seq_split, module)
        compiled = check_compile(
            self.compile,
            split_parameters=dims.tensor_parallel > 1 or self.shard is not None,
            sub_sequences=seq is not None,
        )
        layers_policy = isinstance(self.checkpoint, Layers)
        check_seq_setup(seq, self.schedule, layers_policy=layers_policy, skips=bool(skips))
        return ModelSettings(skips, autocast, dims, seq, compiled)


@dataclass(frozen=True)
class ModelSettings:
    """What a ``PipelineConfig`` settles for one model on one device."""

    skips: list[Skip]
    autocast: torch.dtype | None
    dims: Dimensions
    seq_chunks: SeqChunks | None
    compile: CompileOptions | None
