"""Hugging Face's ``Trainer``, pipelined: ``PipelineTrainer`` and ``pipelined(TrainerClass)``.

A script written for ``transformers.Trainer`` (or a TRL trainer built on it) changes two
lines and is launched with ``torchrun --nproc-per-node K*D``: every rank builds the same
model and arguments, and the trainer cuts the model into K stages, keeps its own, and trains
through ``gpipe.Pipeline`` on D replicas. Everything else stays the ``Trainer``'s: its loop,
learning-rate schedule, logging, callbacks, evaluation and checkpoints.

Where the ``Trainer`` would reach the whole model, the pipeline stands in:

- ``training_step`` runs the batches of one gradient-accumulation window as one pipelined
  step (their micro-batches in order), with the causal-LM loss the model itself computes:
  labels shifted, -100 ignored, summed and divided by the tokens the ``Trainer`` counted over
  the window and the replicas (its ``num_items_in_batch``);
- ``prediction_step`` evaluates through the pipeline and gives every rank the last stage's
  loss and logits;
- the ``Accelerator`` sees one process per replica (``hf_stage.ReplicaAccelerator``): data
  are sharded over the D replicas, gathered over them for metrics, the model is never wrapped
  in DDP, and gradients are clipped by their norm over every stage;
- ``save_model`` gathers the stages to rank 0, which writes one ordinary Hugging Face folder;
  a checkpoint holds that folder, each stage's optimizer state and the ``Trainer``'s own
  files, and ``resume_from_checkpoint`` reads it back, each rank its own stage.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from accelerate import Accelerator
from torch import Tensor, nn
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import enable_full_determinism, set_seed

from gpipe.comm.agreement import on_every_rank
from gpipe.engine import IGNORE_INDEX, StepResult, logits_of
from gpipe.integrations.hf_options import (
    check_own,
    check_own_loss,
    check_trainer_arguments,
    parts_of,
    refused_options,
    stages_of,
)
from gpipe.integrations.hf_stage import (
    TARGETS,
    PipelinedModel,
    ReplicaAccelerator,
    check_unsaved_buffers,
    release_other_stages,
    split_model,
)
from gpipe.pipeline import Pipeline
from gpipe.runtime.microbatch import scatter_payload, split_sizes
from gpipe.splitting import SplitModel
from gpipe.training.hf import LazyWeights

__all__ = ["PipelineTrainer", "PipelinedModel", "pipelined", "refused_options"]

Weights = str | os.PathLike[str] | Mapping[str, Tensor]
_SCHEDULER = "scheduler.pt"  # as the Trainer names it


def _tied_names(model: nn.Module) -> dict[str, str]:
    """Each further name of a parameter that ``model`` ties (the head to the embedding),
    mapped to its first name."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        seen = first.setdefault(id(parameter), name)
        if seen != name:
            tied[name] = seen
    return tied


def _optimizer_file(stage: int, stages: int) -> str:
    return f"optimizer.stage-{stage}-of-{stages}.pt"


def _holds_optimizer(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` holds optimizer states (of any stages, or of a plain
    ``Trainer``) or a schedule: one saved with ``save_only_model`` holds neither, and the
    ``Trainer`` then resumes with a fresh optimizer and schedule."""
    if (checkpoint / _SCHEDULER).is_file():
        return True
    return any(checkpoint.glob("optimizer.*"))


def _targets(inputs: Mapping[str, Any]) -> Tensor:
    """Each position's next token, -100 where there is none: the labels shifted as the
    model's own causal-LM loss shifts them (or ``shift_labels`` as a collator gives them)."""
    if inputs.get("shift_labels") is not None:
        return inputs["shift_labels"]
    return F.pad(inputs["labels"][..., 1:], (0, 1), value=IGNORE_INDEX)


# From transformers 5 on, the Trainer divides an evaluation batch's summed loss by the labels
# it counts: shifted for a model whose loss is the causal-LM loss, as the labels it predicts;
# all of them for one whose class names no loss (GPT-2's LMHeadModel), one more a row.
_TRAINER_COUNTS_EVAL_LABELS = int(transformers.__version__.split(".")[0]) >= 5


def _counted_labels(original: nn.Module, inputs: Mapping[str, Any], targets: Tensor) -> Tensor:
    """The labels a plain ``Trainer`` counts for an evaluation batch of ``original``, whose
    shifted ``targets`` the loss is taken on."""
    if not _TRAINER_COUNTS_EVAL_LABELS or inputs.get("shift_labels") is not None:
        return targets
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    causal = LOSS_MAPPING.get(str(getattr(original, "loss_type", None))) is ForCausalLMLoss
    return targets if causal else inputs["labels"]


class _Pipelined:
    """The behaviour ``pipelined`` adds to a ``Trainer`` class (``PipelineTrainer`` says
    what it is); it comes first in the class's bases, so its methods replace the Trainer's."""

    # set by the Trainer class after this one in the bases
    args: TrainingArguments
    model: Any
    model_wrapped: Any
    accelerator: Any
    callback_handler: Any
    optimizer: Any
    lr_scheduler: Any
    processing_class: Any
    current_gradient_accumulation_steps: int
    model_accepts_loss_kwargs: bool

    def __init__(
        self,
        *args: Any,
        chunks: int = 1,
        schedule: str = "gpipe",
        data_parallel: int = 1,
        weights: Weights | None = None,
        **kwargs: Any,
    ) -> None:
        check_own(chunks, schedule, data_parallel)
        check_own_loss(type(self), _Pipelined)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        check_trainer_arguments(
            training_args, kwargs, kwargs.get("model", args[0] if args else None)
        )
        if training_args is not None:  # it joined torchrun's process group: check it first
            stages_of(training_args, data_parallel)
        super().__init__(*args, **kwargs)
        self._window: list[tuple[dict[str, Any], Tensor]] = []
        self._stage_losses: list[Tensor] = []  # the last stage's, in the latest step
        self._cut(chunks, schedule, data_parallel, weights)

    # -- the cut ------------------------------------------------------------------------------
    def _cut(self, chunks: int, schedule: str, data_parallel: int, weights: Weights | None) -> None:
        """Cut the model the ``Trainer`` holds, keep this rank's stage, and put the pipeline
        in the model's place (and the replicas' view into the ``Accelerator``)."""
        refused = refused_options(self.args)  # as the Trainer (or TRL) completed them
        if refused:
            raise ValueError(f"PipelineTrainer cannot honour {refused[0]}")
        if type(self.accelerator) is not Accelerator:
            raise ValueError(
                f"PipelineTrainer cannot take over a {type(self.accelerator).__name__}: it "
                "replaces the Trainer's accelerate.Accelerator by one that sees the replicas"
            )
        original = self.model
        meta = any(p.is_meta for p in original.parameters())
        if meta and weights is None:
            raise ValueError(
                "the model's parameters are on the meta device: pass weights= (a Hugging "
                "Face folder, or a mapping by the model's names) for each rank to read its "
                "stage from"
            )
        if callable(getattr(original, "tie_weights", None)):
            original.tie_weights()  # as from_pretrained does; a model built on meta is not yet
        # read before the other stages are released, which unties what this rank does not hold
        self._tied_names = _tied_names(original)
        # The stages run the model class's own forward: a forward a trainer set on the
        # instance (TRL's fused LM head) would run the whole model, and the model's own
        # activation checkpointing is the pipeline's to do (checkpoint= below).
        vars(original).pop("forward", None)
        if _current(original, "is_activation_checkpointing", "is_gradient_checkpointing"):
            _current(
                original, "activation_checkpointing_disable", "gradient_checkpointing_disable"
            )()
        stages = stages_of(self.args, data_parallel)
        split, takes = split_model(original, parts_of(schedule, stages))
        self.pipeline = Pipeline(
            split,
            chunks=chunks,
            schedule=schedule,
            data_parallel=data_parallel,
            checkpoint="always" if _recomputes(self.args) else "except_last",
            loss_fn=self._stage_loss,
            loss_reduction="sum",
            device=self.args.device,
            autocast=torch.bfloat16 if self.args.bf16 else None,
            timeout=float(self.args.ddp_timeout),
        )

        def load() -> None:
            if weights is not None:
                found = weights if isinstance(weights, Mapping) else LazyWeights(Path(weights))
                split.load_original_state_dict(found, module=self.pipeline)
            check_unsaved_buffers(split, self.pipeline, original)

        on_every_rank(load, "reading this rank's stage")
        release_other_stages(original, split, self.pipeline)
        self.model = self.model_wrapped = PipelinedModel(
            original, self.pipeline, split, takes, self._tied_names
        )
        self.callback_handler.model = self.model
        # The Trainer builds its Accelerator in one method, with no hook for the class:
        # re-classing it keeps every setting the Trainer chose.
        self.accelerator.__class__ = ReplicaAccelerator
        self.accelerator.attach(self.pipeline)
        # seeded again, as the Trainer seeded before the model was cut: the same data order
        if self.args.full_determinism:
            enable_full_determinism(self.args.seed)
        else:
            set_seed(self.args.seed)

    @property
    def split(self) -> SplitModel:
        """The stages, and the map between their names and the model's own."""
        return self.model.split

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """The Trainer's rule judged on the model as written, for this rank's names of its
        parameters: a traced stage holds a norm's weight in a plain module, where the rule's
        test of the layer's type (``nn.LayerNorm``) would miss it and decay GPT-2's norms."""
        trainer = cast(Any, super())
        if not isinstance(model, PipelinedModel):
            return list(trainer.get_decay_parameter_names(model))
        decayed = set(trainer.get_decay_parameter_names(model.original))
        return [
            name
            for name, _ in model.named_parameters()
            if model.split.original_name(name.removeprefix("pipeline.")) in decayed
        ]

    # -- steps --------------------------------------------------------------------------------
    def _stage_loss(self, outputs: Any, targets: tuple[Tensor, Tensor]) -> Tensor:
        """A micro-batch's causal-LM loss (last stage): each row's summed token losses times
        its row's scale, the share of the step's loss that the ``Trainer`` gives it."""
        labels, scale = targets
        logits = logits_of(outputs).float()
        per_token = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            labels.reshape(-1).to(logits.device),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        share = (per_token.view(labels.size(0), -1).sum(1) * scale.to(logits.device)).sum()
        self._stage_losses.append(share.detach())
        return share

    def _labelled(self, inputs: Mapping[str, Any]) -> tuple[dict[str, Any], Tensor]:
        if all(inputs.get(k) is None for k in TARGETS):
            raise ValueError(
                "PipelineTrainer trains causal language models on batches with labels; this "
                f"batch has {sorted(inputs)} (a collator such as "
                "DataCollatorForLanguageModeling(mlm=False) sets them)"
            )
        return self.model.inputs_of(inputs), _targets(inputs)

    def _replicas(self) -> int:
        return self.pipeline.replicas.data_parallel if self.pipeline.replicas else 1

    def _window_targets(self, window: list[Tensor], num_items_in_batch: Any) -> list[Any]:
        """Each batch's targets with each row's scale, so that the window's loss is the plain
        ``Trainer``'s: the summed token losses over the tokens it counted over the window
        (and the replicas, unless ``average_tokens_across_devices`` is off); without a
        count, each batch's mean over its tokens, averaged over the batches of the window
        and the replicas (as DDP averages the processes' gradients)."""
        replicas = self._replicas()
        if num_items_in_batch is not None:
            per_replica = not self.args.average_tokens_across_devices
            tokens = float(num_items_in_batch) * (replicas if per_replica else 1)
            divisors = [tokens] * len(window)
        else:
            batches = self.current_gradient_accumulation_steps * replicas
            divisors = [max(int((t != IGNORE_INDEX).sum()), 1) * batches for t in window]
        return [
            (t, torch.full((t.size(0),), 1.0 / d, device=t.device))
            for t, d in zip(window, divisors, strict=True)
        ]

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        """One batch of a gradient-accumulation window: the window's last runs all of its
        micro-batches as one pipelined step and returns the window's loss; the others 0."""
        model.train()
        self._window.append(self._labelled(inputs))
        zero = torch.zeros((), device=self.args.device)
        if not self.accelerator.sync_gradients:
            return zero
        window, self._window = self._window, []
        targets = self._window_targets([t for _, t in window], num_items_in_batch)
        self._stage_losses = []
        chunks = self.pipeline.chunks
        microbatches = [
            (x, (labels, scale))
            for (stage_inputs, _), (batch_labels, batch_scale) in zip(window, targets, strict=True)
            for x, labels, scale in zip(
                scatter_payload(stage_inputs, chunks),
                batch_labels.split(split_sizes(batch_labels.size(0), chunks)),
                batch_scale.split(split_sizes(batch_scale.size(0), chunks)),
                strict=True,
            )
        ]
        loss = self.pipeline.step(microbatches=microbatches)
        assert isinstance(loss, Tensor)
        return loss.detach().to(zero)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The batch's loss as a plain ``Trainer`` process reports it (its tokens' summed loss
        over every replica's tokens, times the replicas), and unless
        ``prediction_loss_only`` its logits and labels: the same on every rank of a
        pipeline."""
        model.eval()
        if all(inputs.get(k) is None for k in TARGETS):  # predictions without a loss
            outputs = self.pipeline(self.model.inputs_of(inputs))
            logits = logits_of(outputs) if outputs is not None else None
            return None, None if prediction_loss_only else self._from_last_stage(logits), None
        stage_inputs, labels = self._labelled(inputs)
        counted = self._eval_tokens(_counted_labels(self.model.original, inputs, labels))
        scale = torch.full((labels.size(0),), 1.0 / counted, device=labels.device)
        self._stage_losses = []
        result = self.pipeline.evaluate(
            stage_inputs, (labels, scale), return_outputs=not prediction_loss_only
        )
        # this replica's own share, as each process of a plain Trainer reports its own
        mine = torch.zeros((), dtype=torch.float64, device=self.pipeline.device)
        if self.pipeline.is_last:
            mine += sum(float(x) for x in self._stage_losses)
        loss = self._from_last_stage(mine).float() * self._eval_scale()
        if prediction_loss_only:
            return loss, None, None
        assert isinstance(result, StepResult)
        logits = logits_of(result.outputs) if result.outputs is not None else None
        return loss, self._from_last_stage(logits), inputs.get("labels")

    def _over_replicas(self) -> bool:
        """Whether a plain ``Trainer`` divides an evaluation batch's loss by the tokens of
        every process's batch (and multiplies it by the processes), or takes each one's
        own mean: only where the model takes the count and the tokens are averaged."""
        return bool(self.model_accepts_loss_kwargs and self.args.average_tokens_across_devices)

    def _eval_tokens(self, targets: Tensor) -> float:
        """The tokens an evaluation batch's summed loss is divided by, as the plain
        ``Trainer`` counts them: over every replica's batch, or this replica's own."""
        count = torch.tensor([float((targets != IGNORE_INDEX).sum())], dtype=torch.float64)
        replicas = self.pipeline.replicas
        if self._over_replicas() and replicas is not None:
            dist.all_reduce(count, group=replicas.group)
        return float(count.clamp(min=1))

    def _eval_scale(self) -> int:
        return self._replicas() if self._over_replicas() else 1

    def _from_last_stage(self, tensor: Tensor | None) -> Tensor:
        """The last stage's ``tensor`` on every rank of this pipeline."""
        pipe = self.pipeline
        src = pipe.global_rank(pipe.rank_of(pipe.n_stages - 1))
        header: list[Any] = [None if tensor is None else (tuple(tensor.shape), tensor.dtype)]
        dist.broadcast_object_list(header, src=src, group=pipe.group)
        shape, dtype = header[0]
        held = torch.empty(shape, dtype=dtype, device=pipe.device) if tensor is None else tensor
        held = held.contiguous()
        dist.broadcast(held, src=src, group=pipe.group)
        return held.to(self.args.device)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The whole model's count for the batch on the rank of each replica's first stage,
        0 on the others: the ``Trainer`` sums every process's count into ``total_flos``, and
        the stages of a replica share its batches (each counting it: K times too many)."""
        if not self.pipeline.is_first:
            return 0
        return int(cast(Any, super()).floating_point_ops(inputs))

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Rows per optimizer step: a replica's batch x accumulation x the D replicas."""
        return args.train_batch_size * args.gradient_accumulation_steps * self._replicas()

    # -- saving and resuming ------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the whole model as one Hugging Face folder that ``from_pretrained`` loads:
        the first replica's stages send their weights, by the model's own names, to rank 0,
        which writes them with the model's ``save_pretrained``. Collective."""
        folder = str(output_dir if output_dir is not None else self.args.output_dir)
        pipe = self.pipeline
        first_replica = pipe.replicas is None or pipe.replicas.replica == 0
        held = self.split.original_state_dict(module=pipe) if first_replica else {}
        mine = {k: v.detach().to("cpu") for k, v in held.items()}
        rank = dist.get_rank()
        pieces: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, pieces, dst=0)
        if pieces is not None:
            whole = {k: v for piece in pieces for k, v in piece.items()}
            # Each stage holds its own copy of a tied parameter, equal after every step;
            # save_pretrained writes a tied parameter once where its names share one tensor.
            for name, first in self._tied_names.items():
                if name in whole and first in whole:
                    whole[name] = whole[first]
            os.makedirs(folder, exist_ok=True)
            self.model.original.save_pretrained(folder, state_dict=whole)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(folder)
            torch.save(self.args, os.path.join(folder, "training_args.bin"))
        dist.barrier()

    # The Trainer saves and loads the optimizer, reads the weights back and moves the model
    # only in the private methods below, each written for a model whole on every rank: a
    # pipeline's stages keep their own optimizer states and read their own weights.
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        pipe = self.pipeline
        if pipe.replicas is None or pipe.replicas.replica == 0:  # replicas hold the same
            name = _optimizer_file(pipe.stage_index, pipe.n_stages)
            torch.save(self.optimizer.state_dict(), os.path.join(output_dir, name))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        pipe = self.pipeline
        file = Path(checkpoint) / _optimizer_file(pipe.stage_index, pipe.n_stages)
        if not _holds_optimizer(Path(checkpoint)):
            return  # saved with save_only_model: a fresh optimizer, as the plain Trainer's
        if not file.is_file():
            raise ValueError(
                f"{checkpoint} has no {file.name}: a pipelined checkpoint holds one optimizer "
                f"state per stage, and this run has {pipe.n_stages} stages"
            )
        # loaded on the CPU; the optimizer moves each state to its parameter's device
        self.optimizer.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))
        scheduler = torch.load(Path(checkpoint) / _SCHEDULER, weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        def load() -> None:
            weights = LazyWeights(resume_from_checkpoint)
            self.split.load_original_state_dict(weights, module=self.pipeline)

        on_every_rank(load, f"reading this rank's stage from {resume_from_checkpoint}")

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The pipeline places its stage; the whole model (perhaps on meta) stays put."""


T = TypeVar("T", bound=type[Trainer])
_made: dict[type, type] = {}


def _current(owner: Any, name: str, older: str) -> Any:
    """``owner.name``, or where this transformers predates it, ``owner.older`` (the name
    transformers 5 deprecates with a warning at every use)."""
    return getattr(owner, name) if hasattr(type(owner), name) else getattr(owner, older, False)


def _recomputes(args: TrainingArguments) -> bool:
    return bool(_current(args, "activation_checkpointing", "gradient_checkpointing"))


def pipelined(trainer_class: T) -> T:
    """``trainer_class`` (``transformers.Trainer`` or a subclass, such as TRL's
    ``SFTTrainer``) with ``PipelineTrainer``'s behaviour: the same arguments, plus
    ``chunks=``, ``schedule=``, ``data_parallel=`` and ``weights=``."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"pipelined() takes a Trainer class, got {trainer_class!r}")
    if issubclass(trainer_class, _Pipelined):
        return trainer_class
    if trainer_class not in _made:
        name = f"Pipelined{trainer_class.__name__}"
        made = type(name, (_Pipelined, trainer_class), {"__doc__": PipelineTrainer.__doc__})
        made.__module__ = __name__
        _made[trainer_class] = made
    return _made[trainer_class]  # type: ignore[return-value]


class PipelineTrainer(_Pipelined, Trainer):
    """``transformers.Trainer`` over a pipeline of K stages and D replicas, launched with
    ``torchrun --nproc-per-node K*D`` (K is the world size over D).

    Takes the ``Trainer``'s arguments, plus:

    Args:
        chunks: micro-batches per batch of ``per_device_train_batch_size`` rows, the batch of
            one pipeline replica; a gradient-accumulation window of G batches runs as one
            pipelined step of G x chunks micro-batches.
        schedule: the pipeline's schedule (``gpipe.schedules.SCHEDULES`` names them); under
            a V schedule the model is cut into 2K stages, two a process.
        data_parallel: D, the replicas of the pipeline, each on its own shard of the data.
        weights: where each rank reads its stage's weights: a Hugging Face folder (as
            ``save_pretrained`` writes it) or a mapping by the model's own names, read
            lazily. Needed when the model's parameters are on the meta device; otherwise
            the model's own weights are trained.

    ``model`` is the whole causal language model, built the same way on every rank (each
    rank then frees the other stages' parameters), or built under
    ``accelerate.init_empty_weights()`` with ``weights=``, so that no rank ever holds more
    than its stage. Afterwards ``trainer.model`` is a ``PipelinedModel`` and
    ``trainer.pipeline`` its ``gpipe.Pipeline``.
    """


_made[Trainer] = PipelineTrainer
