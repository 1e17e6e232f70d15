"""What a pipelined ``Trainer`` holds in place of the whole model: this rank's stage
(``PipelinedModel``), cut from the model (``split_model``) whose other stages it frees
(``release_other_stages``), and an ``Accelerator`` that sees one process per replica
(``ReplicaAccelerator``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import recursively_apply
from torch import Tensor, nn
from torch.utils.data import DataLoader, RandomSampler

from gpipe.comm.agreement import on_first_rank
from gpipe.pipeline import Pipeline
from gpipe.splitting import SplitModel, split
from gpipe.splitting.hf_layout import declares_plan
from gpipe.splitting.hf_plan import HEAD_ONLY

__all__ = [
    "TARGETS",
    "TRACED_INPUTS",
    "PipelinedModel",
    "ReplicaAccelerator",
    "check_unsaved_buffers",
    "release_other_stages",
    "split_model",
]

# The model's inputs a traced first stage takes: its graph is traced on these.
TRACED_INPUTS = ("input_ids", "attention_mask")
TARGETS = ("labels", "shift_labels")  # a batch's targets, never the first stage's inputs


def split_model(model: nn.Module, parts: int) -> tuple[SplitModel, tuple[str, ...] | None]:
    """``model`` cut into ``parts`` stages, and the inputs its first stage takes (None: any
    the model's forward names). By the model's own pipeline plan where it declares one (its
    real modules in each stage); otherwise traced on ``input_ids`` and ``attention_mask``,
    on the meta device when the model's parameters are there."""
    if declares_plan(model):
        return split(model, parts=parts, plan="hf"), None
    device = next(model.parameters()).device
    ids = torch.zeros(2, 8, dtype=torch.long, device=device)
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return split(model, (), example, parts=parts, plan=None), TRACED_INPUTS


class PipelinedModel(nn.Module):
    """What ``trainer.model`` is: this rank's stage of the model as ``.pipeline`` (a
    ``Pipeline``; its parameters are this module's), beside the model it was cut from
    (``.original``: its config, its ``save_pretrained``) and the ``.split`` that maps the
    stages' names to the model's; ``num_parameters()`` counts the whole model's.

    Calling it runs the pipeline's forward on the first stage's inputs and returns the last
    stage's outputs there (None on other ranks). Its ``forward`` has the original's
    signature, so the ``Trainer`` keeps the dataset columns the model takes.
    """

    def __init__(
        self,
        original: nn.Module,
        pipeline: Pipeline,
        split: SplitModel,
        takes: tuple[str, ...] | None = None,
        tied: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.pipeline = pipeline
        self._tied = dict(tied or {})  # each further name of a tied parameter: its first
        self._held = (original, split)  # not submodules: their other stages are not ours
        self.config = getattr(original, "config", None)
        self.generation_config = getattr(original, "generation_config", None)
        self.main_input_name = getattr(original, "main_input_name", "input_ids")
        signature = inspect.signature(original.forward)
        self._names = set(signature.parameters) - set(HEAD_ONLY) - set(TARGETS)
        self._takes = takes

        def run(*args: Any, **kwargs: Any) -> Any:
            return self.pipeline(self.inputs_of(signature.bind(*args, **kwargs).arguments))

        # the Trainer keeps the dataset columns that the model's forward names
        run.__signature__ = signature  # type: ignore[attr-defined]
        self.forward = run

    @property
    def original(self) -> nn.Module:
        return self._held[0]

    @property
    def split(self) -> SplitModel:
        return self._held[1]

    def inputs_of(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The first stage's inputs in a batch: the model's arguments it holds (keys the
        model's forward does not name are left out, as the model would ignore them)."""
        given = {k: v for k, v in batch.items() if k in self._names and v is not None}
        if "input_ids" not in given:
            raise ValueError(f"the model's input_ids are missing from the batch ({sorted(batch)})")
        if self._takes is None:
            return given
        extra = sorted(set(given) - set(self._takes))
        if extra:
            raise ValueError(
                f"a model cut by tracing takes {list(self._takes)}; this batch also has "
                f"{extra} (a model that declares a pipeline plan takes any of its arguments)"
            )
        given.setdefault("attention_mask", torch.ones_like(given["input_ids"]))
        return given

    def activation_checkpointing_enable(self, **options: Any) -> None:
        """Nothing to do: under ``gradient_checkpointing`` the pipeline was built to
        re-materialize every micro-batch's stage in the backward (``checkpoint="always"``)."""

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """The whole model's count, as ``PreTrainedModel.num_parameters`` gave it before the
        cut (a tied head counted once, though the last stage holds a copy of its own),
        whatever this rank holds: the ``Trainer`` counts a step's operations by it."""
        skipped = set(self._tied)
        if exclude_embeddings:
            embeddings = (
                n for n, m in self.original.named_modules() if isinstance(m, nn.Embedding)
            )
            skipped.update(f"{name}.weight" for name in embeddings)
        return sum(
            p.numel()
            for name, p in self.original.named_parameters()
            if name not in skipped and (p.requires_grad or not only_trainable)
        )

    def floating_point_ops(self, inputs: Mapping[str, Any]) -> int:
        """The whole model's count, as the ``Trainer`` logs it (``total_flos``)."""
        count = getattr(self.original, "floating_point_ops", None)
        return int(count(dict(inputs))) if callable(count) else 0


class ReplicaAccelerator(Accelerator):
    """Accelerate's view of the world as D processes, one per pipeline replica: data are
    sharded and gathered over the replicas (the stages of one replica see the same shard),
    the model is never wrapped (in DDP or anything else), and gradients are clipped by their
    norm over every stage.

    A pipelined ``Trainer`` re-classes the ``Accelerator`` it built as this one, which keeps
    every setting the ``Trainer`` chose (mixed precision, data loader options), then
    ``attach``es its pipeline.
    """

    pipe: Pipeline

    def attach(self, pipe: Pipeline) -> None:
        self.pipe = pipe

    @property
    def num_processes(self) -> int:
        return self.pipe.replicas.data_parallel if self.pipe.replicas is not None else 1

    @property
    def process_index(self) -> int:
        return self.pipe.replicas.replica if self.pipe.replicas is not None else 0

    def prepare_model(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        """``model`` as it is (the pipeline places it, runs it under autocast and synchronizes
        it), known as prepared: the ``Trainer`` otherwise prepares it again at every
        evaluation and logs an ``eval_model_preparation_time`` the plain one does not."""
        if all(m is not model for m in self._models):
            self._models.append(model)
        return model

    def prepare_data_loader(self, data_loader: DataLoader[Any], *args: Any, **kwargs: Any) -> Any:
        sampler = getattr(data_loader, "sampler", None)
        seedable = isinstance(sampler, RandomSampler) and self.use_seedable_sampler
        if not seedable and getattr(sampler, "generator", False) is None:
            # every stage of a replica must draw the same order: rank 0's, drawn as one
            # process draws it (from the global random state, which dropout on each rank
            # would otherwise move apart stage by stage)
            sampler.__class__ = _ordered_by_rank_zero(type(sampler))
        return super().prepare_data_loader(data_loader, *args, **kwargs)

    def gather(self, tensor: Any) -> Any:
        if self.pipe.replicas is None:
            return tensor  # one replica: as a single process's accelerator returns it
        return recursively_apply(self._gather_one, tensor)

    def _gather_one(self, tensor: Tensor) -> Tensor:
        replicas = self.pipe.replicas
        assert replicas is not None
        one = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        parts = [torch.empty_like(one) for _ in range(replicas.data_parallel)]
        dist.all_gather(parts, one, group=replicas.group)
        return torch.cat(parts)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Tensor:
        return self.pipe.clip_grad_norm_(float(max_norm), float(norm_type))


_ORDERED: dict[type, type] = {}


def _ordered_by_rank_zero(sampler_class: type) -> type:
    """``sampler_class`` whose order, each time it is iterated, is the one rank 0 draws,
    told to every rank (collective over the world: every rank iterates its loader in step).
    A subclass with nothing but its ``__iter__``, so that a sampler can be re-classed as it;
    one is made per sampler class, and a sampler already re-classed keeps its class."""
    if sampler_class in _ORDERED.values():
        return sampler_class
    if sampler_class not in _ORDERED:

        def ordered_by_rank_zero(sampler: Any) -> Iterator[Any]:
            own = cast(Any, sampler_class).__iter__
            drawn = on_first_rank(lambda: list(own(sampler)), None, "drawing the batches' order")
            return iter(drawn)

        name = f"{sampler_class.__name__}OfRankZero"
        _ORDERED[sampler_class] = type(name, (sampler_class,), {"__iter__": ordered_by_rank_zero})
    return _ORDERED[sampler_class]


def check_unsaved_buffers(split: SplitModel, pipe: nn.Module, original: nn.Module) -> None:
    """Refuse a stage whose buffers that no checkpoint holds (a rotary embedding's
    frequencies) were built on the meta device: nothing could give them their values."""
    on_meta = {n for n, b in original.named_buffers() if b.is_meta}
    mine = {id(s) for s in split}
    for stage in (m for m in pipe.modules() if id(m) in mine):
        saved = set(stage.state_dict())
        lost = [n for n, _ in stage.named_buffers() if n not in saved and n in on_meta]
        if lost:
            raise ValueError(
                f"the model's buffer {lost[0]} is on the meta device and in no checkpoint: "
                "build the model under accelerate.init_empty_weights(), which puts only "
                "the parameters there"
            )


def release_other_stages(original: nn.Module, split: SplitModel, pipe: nn.Module) -> None:
    """Free the parameters this rank's stage does not hold, in the model and in the other
    stages of its split: they become meta tensors of the same shapes, so that the model
    still describes itself (its config, its parameter count) while holding only the stage."""
    kept = {id(p) for p in pipe.parameters()}
    held = {id(m) for m in pipe.modules()}
    for stage in split:
        if id(stage) not in held:
            stage.to("meta")
    released: dict[int, nn.Parameter] = {}
    for module in original.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in kept or param.is_meta:
                continue
            if id(param) not in released:
                meta = torch.empty_like(param, device="meta")
                released[id(param)] = nn.Parameter(meta, requires_grad=param.requires_grad)
            setattr(module, name, released[id(param)])
